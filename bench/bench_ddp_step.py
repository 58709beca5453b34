"""Cost of distcheck on a DDP training step: ``distcheck run --nproc 2`` against plain ``torchrun``, side by side.

    .venv/bin/python bench/bench_ddp_step.py [--rounds 5] [--steps 150]

Each round runs bench/_ddp_step_train.py once under plain torchrun and once under ``distcheck run`` (tracer,
Flight Recorder status thread and phase marks, zero-code checks: everything a user gets), in alternating order,
so load drift on a shared machine hits both alike. A run's figures are the median step times of rank 0 in two
windows: steps 10 to 49, where distcheck checks every step's gradients for NaN/Inf (the first steps pay for DDP's
bucket rebuild and distcheck's drift check on steps 1 to 3), and steps 50 on, the steady state, where it checks
every 10th step's; each as wall time and as the training thread's CPU time (time.thread_time: what distcheck's
hooks add to the step, without the waits a slow spell of another process adds to the wall time); the NaN watch's
own time (its state's ``seconds``) is printed per step beside them. Per window the bench prints each mode's fastest and median round, and three ratios; the target
is within 3%. The verdict
takes the median of the rounds' paired ratios (each round's two runs are back to back): this 2-core VM has slow
spells of 10 to 20% that hit a whole run of either mode, and one such run moves the fastest-round ratio (it did:
+5.2% fastest, -0.7% median rounds, +1.0% paired in one run of 9 rounds) but barely the paired median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "_ddp_step_train.py"
WARMUP = 10
DENSE = 50  # rank/autocheck/nan_watch.GRAD_DENSE_STEPS (the bench imports nothing of distcheck)
NAN_SECONDS: list[float] = []  # per distcheck run: the NaN watch's own seconds per step on rank 0


def one_run(mode: str, steps: int, workdir: Path, index: int) -> tuple[float, float, float, float]:
    out = workdir / f"times-{index}-{mode}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [str(SCRIPT), "--steps", str(steps), "--out", str(out)]
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    else:
        cmd = [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "120", "--report-dir",
               str(workdir / f"report-{index}"), "--", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    times, cpu = data["steps"], data["cpu"]
    if mode == "distcheck":  # what the NaN/Inf watch timed of itself on rank 0, per step: the cost it explains
        state = json.loads((workdir / f"report-{index}" / "autocheck-rank0.json").read_text()).get("nan_watch") or {}
        NAN_SECONDS.append(state.get("seconds", 0.0) / len(times))
    # Two windows: the steps where every step's gradients are checked for NaN/Inf (rank/autocheck/nan_watch.py:
    # GRAD_DENSE_STEPS), and the steady state after them, where one step in GRAD_EVERY is.
    # Each as wall time and as the training thread's CPU time.
    return (statistics.median(times[WARMUP:DENSE]), statistics.median(times[DENSE:] or times[WARMUP:]),
            statistics.median(cpu[WARMUP:DENSE]), statistics.median(cpu[DENSE:] or cpu[WARMUP:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="distcheck-bench-ddp-"))
    runs: dict[str, list[tuple[float, float, float, float]]] = {"torchrun": [], "distcheck": []}
    for i in range(args.rounds):
        for mode in (("torchrun", "distcheck") if i % 2 == 0 else ("distcheck", "torchrun")):
            runs[mode].append(one_run(mode, args.steps, workdir, i))
    summary = {}
    for window, key, label in (
            (1, "steady", f"steady state (steps {DENSE}+: gradients checked every 10th step), wall time"),
            (0, "dense", f"steps {WARMUP}-{DENSE - 1} (gradients checked every step), wall time"),
            (3, "steady_cpu", "steady state, CPU time of the training thread"),
            (2, "dense_cpu", f"steps {WARMUP}-{DENSE - 1}, CPU time of the training thread")):
        figures = {mode: [r[window] for r in values] for mode, values in runs.items()}
        print(label)
        for mode, values in figures.items():
            print(f"  {mode:10s} step: fastest round {min(values) * 1e3:.2f} ms, median round "
                  f"{statistics.median(values) * 1e3:.2f} ms (rounds: {', '.join(f'{v * 1e3:.2f}' for v in values)})")
        fastest = min(figures["distcheck"]) / min(figures["torchrun"])
        median = statistics.median(figures["distcheck"]) / statistics.median(figures["torchrun"])
        # Each round runs both modes back to back: the median of the rounds' own ratios is the figure a slow
        # spell moves least (a spell covers both runs of a round, or is one outlier round among many).
        paired = statistics.median(d / t for d, t in zip(figures["distcheck"], figures["torchrun"]))
        print(f"  ddp_step distcheck/torchrun = {paired:.3f} ({(paired - 1) * 100:+.1f}%, median of the rounds' "
              f"paired ratios; target <= 3%), {fastest:.3f} ({(fastest - 1) * 100:+.1f}%, fastest rounds), "
              f"{median:.3f} ({(median - 1) * 100:+.1f}%, median rounds)")
        summary[key] = {**figures, "ratio_paired_median": paired,
                                                    "ratio_fastest": fastest, "ratio_median": median}
    torchrun_steady = statistics.median(summary["steady"]["torchrun"])
    nan = statistics.median(NAN_SECONDS)
    print(f"  the NaN/Inf watch's own time, averaged over every step: {nan * 1e3:.3f} ms per step "
          f"({nan / torchrun_steady * 100:.1f}% of a plain step), median of the rounds")
    summary["nan_watch_seconds_per_step"] = NAN_SECONDS
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
