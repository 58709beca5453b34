"""Overhead of the zero-code checks (model discovery + check at the first forward, NaN/Inf per step, replica
drift after the first 3 steps) on a 20-step FSDP2 or DDP run over 2 ranks: ``distcheck run`` with them (default)
vs ``DISTCHECK_AUTOCHECK=0``. FSDP2 replicates nothing, so the drift check costs it nothing; DDP pays for it.

    .venv/bin/python bench/bench_autocheck.py [--rounds 3] [--steps 20] [--wrap fsdp2|ddp|both]   # default both

One invocation runs both modes alternately, round by round, so load drift on a shared machine hits both alike.
It reports the in-rank training loop time (rank 0, first forward to last optimizer step, so process start-up and
torch import are excluded) and the total wall time of each ``distcheck run``, as the fastest round of each mode
(on a loaded machine the slower rounds measure the scheduler) and the median; the target is <= 10% on the loop.
The collective tracer is on in both modes (it is part of ``distcheck run``); only the automatic checks differ.
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
SCRIPT = ROOT / "bench" / "_autocheck_train.py"


def one_run(autocheck: bool, steps: int, workdir: Path, index: int, wrap: str) -> dict[str, float]:
    out = workdir / f"times-{index}-{int(autocheck)}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTCHECK_AUTOCHECK="1" if autocheck else "0")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "120", "--report-dir",
           str(workdir / f"report-{index}-{int(autocheck)}"), "--", str(SCRIPT), "--steps", str(steps),
           "--out", str(out), "--wrap", wrap]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    total = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    report = json.loads((workdir / f"report-{index}-{int(autocheck)}" / "report.json").read_text())
    checks = {c["name"]: c["seconds"] for c in report["checks"]}
    times = json.loads(out.read_text())
    return {"loop": times["loop"], "first_step": times["first_step"], "total": total,
            "model_check": checks.get("model_check", 0.0), "bad_values": checks.get("bad_values", 0.0),
            "replica_drift": checks.get("replica_drift", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--wrap", choices=("fsdp2", "ddp", "both"), default="both")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="distcheck-bench-autocheck-"))
    results = {wrap: bench(wrap, args.rounds, args.steps, workdir)
               for wrap in (("fsdp2", "ddp") if args.wrap == "both" else (args.wrap,))}
    print(json.dumps(results))


def bench(wrap: str, rounds: int, steps: int, workdir: Path) -> dict:
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for i in range(rounds):
        runs["off"].append(one_run(False, steps, workdir, i, wrap))
        runs["on"].append(one_run(True, steps, workdir, i, wrap))
    print(f"{steps}-step {wrap.upper()} run on 2 gloo ranks (4-block MLP, dim 256), {rounds} rounds per mode")
    summary: dict[str, dict[str, float]] = {}
    for key in ("loop", "total"):
        best_off = min(r[key] for r in runs["off"])
        best_on = min(r[key] for r in runs["on"])
        med_off = statistics.median(r[key] for r in runs["off"])
        med_on = statistics.median(r[key] for r in runs["on"])
        summary[key] = {"off": best_off, "on": best_on, "ratio": best_on / best_off,
                        "median_off": med_off, "median_on": med_on}
        print(f"  {key:5s}: without {best_off:7.3f}s  with {best_on:7.3f}s  overhead {100 * (best_on / best_off - 1):+6.1f}%"
              f"   (medians {med_off:.3f}s / {med_on:.3f}s: {100 * (med_on / med_off - 1):+.1f}%)")
    mc = [r["model_check"] for r in runs["on"]]
    bv = [r["bad_values"] for r in runs["on"]]
    rd = [r["replica_drift"] for r in runs["on"]]
    print(f"  model_check (once, first forward): {min(mc):.3f}s min, {statistics.median(mc):.3f}s median;"
          f" per-step NaN/Inf checks: {min(bv):.4f}s total over {steps} steps; replica drift (first forward + 3 "
          f"steps): {min(rd):.4f}s")
    ok = summary["loop"]["ratio"] <= 1.10
    print(f"  verdict: loop overhead {'within' if ok else 'ABOVE'} the 10% target")
    return {"runs": runs, "summary": summary}


if __name__ == "__main__":
    main()
