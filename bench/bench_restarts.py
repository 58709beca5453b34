"""Elastic restarts under distcheck against plain torchrun: the same restart job, alternately, N times each.

    .venv/bin/python bench/bench_restarts.py --runs 10

The job (fixtures/torchrun_restart_after_init.py) fails its first torchrun attempt after init_process_group and one DDP step, and
passes its second (``--standalone --nproc-per-node 2 --max-restarts 1``). A run passes when torchrun exits 0 (under
distcheck the report's verdict, the last attempt's, is also read). torch 2.13's agent serves one store for every
attempt and its env:// rendezvous adds no per-attempt prefix, so attempt 1's gloo can read attempt 0's dead
addresses (Connection refused, or both ranks waiting in init_process_group); distcheck gives each attempt its own
key space on one node (rank/bootstrap.isolate_attempt_keys). Prints one line per run and

    restarts runs=N plain_passed=P distcheck_passed=D

Every launch runs in its own session with a timeout, and is ended by its process group.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "fixtures" / "torchrun_restart_after_init.py"
BIN = Path(sys.executable).parent


def launch(distcheck: bool, out: Path, timeout: float) -> tuple[bool, str]:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += ["-m", "distcheck", "run", "--timeout", "30", "--report-dir", str(out), "--", str(JOB)] if distcheck \
        else [str(JOB)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        output = f"timed out after {timeout:.0f}s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    ok = proc.returncode == 0
    if distcheck and ok:
        try:
            ok = bool(json.loads((out / "report.json").read_text())["ok"])
        except (OSError, ValueError, KeyError):
            ok = False
    why = next((line.strip() for line in output.splitlines() if "connectFullMesh" in line or "init_process_group"
                in line or "timed out" in line), "")
    return ok, why[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds one launch may take")
    args = ap.parse_args()
    passed = {False: 0, True: 0}
    with tempfile.TemporaryDirectory(prefix="distcheck-restarts-") as tmp:
        for i in range(args.runs):
            for distcheck in (False, True):
                began = time.monotonic()
                ok, why = launch(distcheck, Path(tmp) / f"run{i}", args.timeout)
                passed[distcheck] += ok
                print(f"run {i} {'distcheck' if distcheck else 'plain'}: {'passed' if ok else 'FAILED'} "
                      f"({time.monotonic() - began:.1f}s){' ' + why if not ok and why else ''}", flush=True)
    print(f"restarts runs={args.runs} plain_passed={passed[False]} distcheck_passed={passed[True]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
