"""Benchmarks for the consistency command (docs/performance.md).

    .venv/bin/python bench/bench_consistency.py

(i)  wall time of `torchrun --nproc-per-node 2 -m distcheck consistency` divided by a bare torchrun script that
     does one all_reduce (same launcher, same interpreter start-up), both measured in this run, alternating.
(ii) on a 100M-parameter float32 model, the fingerprint pass divided by one torch.sum over the same tensors
     (the memory-read floor).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BARE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - start


def bench_command(repeats: int = 3) -> dict:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare.py"
        bare.write_text(BARE)
        base = [torchrun, "--standalone", "--nproc-per-node", "2"]
        bare_times, check_times = [], []
        for _ in range(repeats):
            bare_times.append(timed(base + [str(bare)]))
            check_times.append(timed(base + ["-m", "distcheck", "consistency", "--report-dir", f"{tmp}/r"]))
    b, c = statistics.median(bare_times), statistics.median(check_times)
    return {"bare_s": b, "consistency_s": c, "ratio": c / b}


def bench_fingerprint(repeats: int = 9) -> dict:
    from distcheck.rank.checks.fingerprint import fingerprint_many

    # ~100M parameters in transformer-like shapes: 46 matrices [2048, 1024], embedding and head [2000, 1024],
    # and small norm vectors (many tiny tensors are where per-tensor overhead would show).
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2048, 1024, generator=gen) for _ in range(46)]
    tensors += [torch.randn(2000, 1024, generator=gen) for _ in range(2)]
    tensors += [torch.randn(1024, generator=gen) for _ in range(25)]
    numel = sum(t.numel() for t in tensors)
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]

    def sums():
        return [t.sum() for t in tensors]

    def fps():
        return fingerprint_many(named)

    sums(), fps()  # warm up both paths
    s_times, f_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        sums()
        s_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        fps()
        f_times.append(time.perf_counter() - start)
    s, f = statistics.median(s_times), statistics.median(f_times)
    return {"params": numel, "sum_s": s, "fingerprint_s": f, "ratio": f / s}


def main() -> None:
    fp = bench_fingerprint()
    print(f"fingerprint pass, {fp['params'] / 1e6:.0f}M float32 params: {fp['fingerprint_s'] * 1e3:.1f} ms vs "
          f"torch.sum {fp['sum_s'] * 1e3:.1f} ms -> ratio {fp['ratio']:.2f} (target <= 1.2)")
    cmd = bench_command()
    print(f"torchrun 2 ranks: consistency {cmd['consistency_s']:.2f} s vs bare all_reduce script "
          f"{cmd['bare_s']:.2f} s -> ratio {cmd['ratio']:.2f} (target <= 3)")


if __name__ == "__main__":
    main()
