"""How long a failing torchrun job takes to end, plain and under distcheck, side by side.

    .venv/bin/python bench/bench_fail_fast.py [--rounds 3]

Each round runs bench/_ddp_fail_train.py (DDP, rank 1 raises OSError at step 2) once as
``torchrun --standalone --nproc-per-node 2 SCRIPT`` and once as ``torchrun ... -m distcheck run -- SCRIPT`` (the
default --timeout, 300 s), in alternating order, and times each from start to torchrun's exit. It prints every run,
the median of each mode and their difference; the target is distcheck within 2 s of plain torchrun. It also says
whether distcheck's report was there when torchrun returned, and how long after that it came.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "_ddp_fail_train.py"
LIMIT = 400.0


def one_run(mode: str, workdir: Path, index: int) -> tuple[float, int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    report = workdir / f"report-{index}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(SCRIPT)] if mode == "torchrun" else ["-m", "distcheck", "run", "--report-dir", str(report), "--",
                                                    str(SCRIPT)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=LIMIT)
    seconds = time.monotonic() - started
    note = ""
    if mode == "distcheck":
        waited = 0.0
        while not (report / "report.json").exists() and waited < 30:
            time.sleep(0.05)
            waited += 0.05
        if (report / "report.json").exists():
            data = json.loads((report / "report.json").read_text())
            kinds = sorted({f["kind"] for f in data["findings"]})
            note = (f"report {'there at exit' if waited == 0 else f'{waited:.2f}s after exit'}, ok={data['ok']}, "
                    f"findings: {', '.join(kinds)}")
        else:
            note = "NO REPORT"
    return seconds, proc.returncode, note


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"torchrun": [], "distcheck": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in (("torchrun", "distcheck") if i % 2 == 0 else ("distcheck", "torchrun")):
                seconds, code, note = one_run(mode, Path(tmp), i)
                times[mode].append(seconds)
                print(f"round {i} {mode:<9} {seconds:6.2f}s exit {code} {note}", flush=True)
    plain, ours = statistics.median(times["torchrun"]), statistics.median(times["distcheck"])
    print(f"median: torchrun {plain:.2f}s, distcheck run {ours:.2f}s: distcheck ends {ours - plain:+.2f}s later "
          f"({'within' if ours - plain <= 2.0 else 'NOT within'} the 2 s target)")


if __name__ == "__main__":
    main()
