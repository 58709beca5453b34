"""Rank output under ``distcheck run --nproc 2`` against plain ``torchrun``: whole lines, and the time to write them.

    .venv/bin/python bench/bench_output.py [--rounds 3] [--lines 200000]

Each round runs bench/_flood.py once under plain torchrun and once under ``distcheck run --nproc 2``, in
alternating order: every rank writes ``--lines`` lines of 100 bytes to stderr, one write per line, and both
ranks' stderr go into one pipe that this process reads to the end (what a CI step capturing the output sees).
For each run: the flood time (the slowest rank's, between two barriers: a rank blocks while its output is not
drained), the whole command's wall time, and how many lines arrived spliced (not exactly as written). The verdict
is the ratio of the fastest rounds of each mode: distcheck / torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "_flood.py"
LINE = re.compile(rb"^rank [01] line \d{8} x{78}$")


def one_run(mode: str, lines: int, workdir: Path, index: int) -> tuple[float, float, int, int]:
    out = workdir / f"times-{index}-{mode}"
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTCHECK_ZYGOTE="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [str(SCRIPT), "--lines", str(lines), "--out", str(out)]
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    else:
        cmd = [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "120", "--report-dir",
               str(workdir / f"report-{index}"), "--", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    whole = spliced = 0
    for line in proc.stderr.split(b"\n"):
        if LINE.match(line):
            whole += 1
        elif b"line 0" in line or b"xxxx" in line:
            spliced += 1
    flood = max(json.loads(Path(f"{out}.rank{r}").read_text())["seconds"] for r in (0, 1))
    return flood, wall, whole, spliced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=200000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="distcheck-bench-output-"))
    figures: dict[str, list[tuple[float, float, int, int]]] = {"torchrun": [], "distcheck": []}
    for i in range(args.rounds):
        for mode in (("torchrun", "distcheck") if i % 2 == 0 else ("distcheck", "torchrun")):
            figures[mode].append(one_run(mode, args.lines, workdir, i))
            flood, wall, whole, spliced = figures[mode][-1]
            print(f"round {i} {mode:9s}: flood {flood:.3f} s, wall {wall:.2f} s, {whole} whole lines, "
                  f"{spliced} spliced", flush=True)
    for mode, runs in figures.items():
        floods = [r[0] for r in runs]
        print(f"{mode:9s} flood: fastest {min(floods):.3f} s, median {statistics.median(floods):.3f} s; wall: "
              f"fastest {min(r[1] for r in runs):.2f} s; spliced lines: {sum(r[3] for r in runs)} in all, whole: "
              f"{min(r[2] for r in runs)} of {2 * args.lines} in the worst run")
    ratio = min(r[0] for r in figures["distcheck"]) / min(r[0] for r in figures["torchrun"])
    median = (statistics.median(r[0] for r in figures["distcheck"])
              / statistics.median(r[0] for r in figures["torchrun"]))
    print(f"flood time distcheck / torchrun: fastest rounds {ratio:.2f}, median rounds {median:.2f} (target <= 1)")


if __name__ == "__main__":
    main()
