"""The CPU one start of a rank's stderr copier costs (rank/stderr_tee.py run as ``python -I -S``, its input at its
end at once): this tree against another commit, in turn, in one run. Every rank of every run starts one.

    .venv/bin/python bench/bench_copier_start.py --against 1da11fc     # A B A B, 40 starts of each per turn
    .venv/bin/python bench/bench_copier_start.py                       # this tree alone

B is that commit's tree as bench_run_cpu.py's `checkout` makes it (a temporary folder). The figure is user +
system time of the copier processes (RUSAGE_CHILDREN), per start.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_run_cpu import checkout  # bench/ is on the path: this file is run as a script

ROOT = Path(__file__).resolve().parent.parent


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def per_start(tree: Path, starts: int, copy_to: str) -> float:
    """CPU-ms per copier start of the tree's stderr_tee.py."""
    script = str(tree / "distcheck" / "rank" / "stderr_tee.py")
    before = _children_cpu()
    for _ in range(starts):
        subprocess.run([sys.executable, "-I", "-S", script, "--copy", copy_to], stdin=subprocess.DEVNULL,
                       check=True, timeout=60)
    return (_children_cpu() - before) / starts * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a commit to compare this tree with")
    parser.add_argument("--starts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="distcheck-bench-copier-")
    trees = {"this tree": ROOT}
    try:
        if args.against:
            try:
                trees[args.against] = checkout(args.against)
            except subprocess.CalledProcessError:
                print(f"bench_copier_start: {args.against} is not a commit here (name one: HEAD~1, a hash)",
                      file=sys.stderr)
                return 2
        copy_to = os.path.join(folder, "copy.txt")
        for name, tree in trees.items():  # warm-up: .pyc files written, caches filled
            per_start(tree, 3, copy_to)
        results: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(per_start(tree, args.starts, copy_to))
        for name, values in results.items():
            print(f"{name}: {', '.join(f'{v:.1f}' for v in values)} CPU-ms per copier start")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if args.against in trees:
            shutil.rmtree(trees[args.against], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
