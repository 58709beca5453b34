"""Overhead of ``distcheck compare``, and the cost of ``distcheck.record`` outside distcheck.

    .venv/bin/python bench/bench_compare.py [--script fixtures/cmp_ddp_ok.py] [--nproc 2] [--rounds 3]

Per round, interleaved so load drift on a shared machine hits every mode alike: a plain 1-rank run and a plain
N-rank run of the same script through torchrun (--standalone), then ``python -m distcheck compare --nproc N`` on
it. The ratio is compare's wall time / (plain 1-rank + plain N-rank); target <= 1.5. Reported for the fastest
round (slower rounds measure the scheduler) and the median. Then ``distcheck.record`` with no DISTCHECK_REPORT_DIR
is timed in a loop against an empty function call: the no-op must cost nothing measurable next to a training step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def timed(cmd: list[str], env: dict[str, str], timeout: float = 600) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, cwd=ROOT)
    seconds = time.perf_counter() - started
    if proc.returncode not in (0,):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return seconds


def noop_cost(calls: int = 1_000_000) -> tuple[float, float, float]:
    """ns per call outside distcheck: distcheck.record, distcheck.rank.records.record, and an empty function (the floor)."""
    code = f"""
import os, time, torch
os.environ.pop("DISTCHECK_REPORT_DIR", None)
import distcheck
import distcheck.rank.records
direct = distcheck.rank.records.record
t = torch.ones(4)
def empty(name, value, step=None):
    return None
for fn in (empty, distcheck.record, direct):
    fn("loss", t)
best = {{}}
for _ in range(3):
    for label, fn in (("empty", empty), ("record", distcheck.record), ("direct", direct)):
        s = time.perf_counter()
        for i in range({calls}):
            fn("loss", t)
        best[label] = min(best.get(label, 1e9), (time.perf_counter() - s) / {calls} * 1e9)
print(best["record"], best["direct"], best["empty"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={k: v for k, v in os.environ.items() if k != "DISTCHECK_REPORT_DIR"})
    rec, direct, empty = map(float, out.stdout.split())
    return rec, direct, empty


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--script", default=str(ROOT / "fixtures" / "cmp_ddp_ok.py"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("DISTCHECK_REPORT_DIR", None)
    ratios, rows = [], []
    with tempfile.TemporaryDirectory(prefix="distcheck-bench-compare-") as tmp:
        for i in range(args.rounds):
            one = timed([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", args.script], env)
            many = timed([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={args.nproc}", args.script], env)
            cmp = timed([sys.executable, "-m", "distcheck", "compare", "--nproc", str(args.nproc), "--report-dir",
                         str(Path(tmp) / f"r{i}"), "--", args.script], env)
            ratios.append(cmp / (one + many))
            rows.append((one, many, cmp))
            print(f"round {i}: plain 1-rank {one:.2f}s + plain {args.nproc}-rank {many:.2f}s; "
                  f"compare {cmp:.2f}s; ratio {ratios[-1]:.2f}", flush=True)
    best = min(range(len(ratios)), key=lambda i: rows[i][2])
    one, many, cmp = rows[best]
    print(f"compare overhead ({Path(args.script).name}, --nproc {args.nproc}): fastest round "
          f"{cmp:.2f}s / ({one:.2f}s + {many:.2f}s) = {cmp / (one + many):.2f}; median ratio "
          f"{statistics.median(ratios):.2f} (target <= 1.5)")
    rec, direct, empty = noop_cost()
    print(f"outside distcheck: distcheck.record {rec:.0f} ns/call, distcheck.rank.records.record {direct:.0f} ns/call, "
          f"an empty function call {empty:.0f} ns")


if __name__ == "__main__":
    main()
