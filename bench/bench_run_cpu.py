"""What one `distcheck run --nproc 2` costs in CPU when its launcher and ranks fork from a shared zygote, as in the
test suite (tests/integration/conftest.py): this tree (A) against another commit (B), in turn, in one run.

    .venv/bin/python bench/bench_run_cpu.py --against HEAD~3            # A B A B, 3 runs of each program per turn
    .venv/bin/python bench/bench_run_cpu.py --rounds 1 --runs 5         # this tree alone

For each side: a zygote started from that tree (its own folder first on the path, as `python -m` does), then every
program of fixtures/ok/ named in PROGRAMS run `--runs` times through it. The figure is the CPU the zygote reaped,
i.e. the launcher and its two ranks (user + system time), per run; and the whole machine's busy CPU per run
(/proc/stat: the stderr copies and the store host too, and whatever else runs). B is `git archive` of the commit in
a temporary folder, with its C path built there.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("ddp_unseeded.py", "fsdp2_mp_bf16.py", "tp_sequence_parallel.py")


def _busy_ticks() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _reaped_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[13]) + int(fields[14])  # cutime + cstime: the children it waited for


def measure(tree: Path, runs: int) -> dict[str, tuple[float, float]]:
    """{program: (reaped CPU-s per run, machine CPU-s per run)} for the tree's distcheck."""
    folder = tempfile.mkdtemp(prefix="distcheck-bench-run-")
    socket_path = os.path.join(folder, "socket")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    zygote = subprocess.Popen([sys.executable, "-m", "distcheck.supervise.zygote", socket_path], cwd=tree, env=env,
                              stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        env["DISTCHECK_ZYGOTE"] = socket_path
        launch = [sys.executable, "-c", "import sys; from distcheck.supervise.zygote import start_process; "
                  "p = start_process(sys.argv[1:], dict(__import__('os').environ)); sys.exit(p.wait())",
                  "-m", "distcheck", "run", "--nproc", "2", "--report-dir", os.path.join(folder, "report"), "--"]
        out = {}
        for program in PROGRAMS:
            script = str(ROOT / "fixtures" / "ok" / program)
            subprocess.run([*launch, script], cwd=tree, env=env, capture_output=True, timeout=300)  # warm-up
            reaped, busy = _reaped_ticks(zygote.pid), _busy_ticks()
            for _ in range(runs):
                done = subprocess.run([*launch, script], cwd=tree, env=env, capture_output=True, text=True,
                                      timeout=300)
                if done.returncode != 0:
                    raise SystemExit(f"{program} failed under {tree}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
            hz = os.sysconf("SC_CLK_TCK")
            out[program] = ((_reaped_ticks(zygote.pid) - reaped) / hz / runs, (_busy_ticks() - busy) / hz / runs)
        return out
    finally:
        zygote.kill()
        zygote.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def checkout(rev: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="distcheck-bench-rev-"))
    try:
        archive = subprocess.run(["git", "archive", rev, "distcheck", "setup.py", "pyproject.toml"], cwd=ROOT,
                                 capture_output=True, check=True, timeout=60).stdout
    except subprocess.CalledProcessError:  # not a commit: the caller says so; nothing is left behind
        shutil.rmtree(folder, ignore_errors=True)
        raise
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=60)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=folder, capture_output=True,
                   timeout=300)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a commit to compare this tree with (B)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each program per turn (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each side (default 2)")
    args = parser.parse_args()
    sides = {"A": ROOT}
    if args.against:
        try:
            sides["B"] = checkout(args.against)
        except subprocess.CalledProcessError:
            print(f"bench_run_cpu: {args.against} is not a commit here (name one: HEAD~1, a hash)", file=sys.stderr)
            return 2
    try:
        print(f"CPU-s per `distcheck run --nproc 2` (launcher + ranks reaped by the zygote / whole machine), "
              f"{args.runs} runs each")
        for turn in range(args.rounds):
            for name, tree in sides.items():
                result = measure(tree, args.runs)
                total = sum(r for r, _ in result.values()), sum(m for _, m in result.values())
                cells = "  ".join(f"{p.removesuffix('.py')} {r:.2f}/{m:.2f}" for p, (r, m) in result.items())
                print(f"{name} turn {turn + 1}: {cells}  | sum {total[0]:.2f}/{total[1]:.2f}", flush=True)
    finally:
        if "B" in sides:
            shutil.rmtree(sides["B"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
