"""`make soak`: correct FSDP2 and DDP scripts, many runs in a row under `distcheck run --nproc 2`; zero findings.

    .venv/bin/python bench/soak.py            # 50 runs of each (about 10 minutes on 2 cores)
    .venv/bin/python bench/soak.py --runs 5

Catches what one run does not: a rare false finding (torch's gloo teardown aborting after a finished script was
one in about 18 runs before ranks ended themselves). Teardown aborts that still happen are warnings, counted
separately; they do not fail the verdict. Exit 1 if any run has a finding or a non-zero exit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_soak_train.py"
MODES = ("fsdp2", "ddp")


def one_run(mode: str) -> tuple[int, list, list, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "120",
                               "--report-dir", tmp, "--", str(SCRIPT), mode], capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        seconds = time.monotonic() - t0
        try:
            report = json.loads((Path(tmp) / "report.json").read_text())
        except (OSError, ValueError):
            return proc.returncode, [{"kind": "no report", "message": proc.stderr[-500:]}], [], seconds
        return proc.returncode, report["findings"], report.get("warnings", []), seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    bad = 0
    for name in MODES:
        findings = warnings = failed = 0
        times = []
        for i in range(args.runs):
            code, found, warned, seconds = one_run(name)
            times.append(seconds)
            findings += len(found)
            warnings += len(warned)
            failed += code != 0
            for f in found:
                print(f"  {name} run {i}: [{f['kind']}] {f['message'][:300]}", flush=True)
        times.sort()
        print(f"soak {name}: {args.runs} runs of distcheck run --nproc 2, {findings} findings, {failed} non-zero "
              f"exits, {warnings} teardown warnings; median run {times[len(times) // 2]:.1f} s", flush=True)
        bad += findings + failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
