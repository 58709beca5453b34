"""Benchmark the hang path: timeout -> report written, and parallel stack dumps vs sequential py-spy calls.

    .venv/bin/python bench/bench_stacks.py [--repeats 5] [--timeout 3]

1. For 2 and 4 gloo ranks of fixtures/hang_python.py (rank 1 stuck in load_shard), supervised by a Watchdog:
   seconds from the moment the no-progress timeout expires to (a) stacks.txt/stacks.json + report.json written,
   (b) every rank ended.
2. With 4 hung ranks alive: ``dump_all`` (what ``distcheck stacks`` does: one py-spy per rank, in parallel) versus
   4 sequential ``py-spy dump --pid`` calls, median of --repeats runs each, plus the full ``python -m distcheck
   stacks`` command (which also pays the interpreter start and the CLI's imports).
All figures of one run are measured on the same machine in the same invocation; ratios are what to compare.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distcheck.contract.findings import CheckResult  # noqa: E402
from distcheck.contract.report import Report, publish  # noqa: E402
from distcheck.supervise.stacks import Target, dump_all, find_pyspy  # noqa: E402
from distcheck.processes import terminate  # noqa: E402
from distcheck.supervise.watch import HUNG, HangDump, RankFunctions, WatchLoop  # noqa: E402

FIXTURE = ROOT / "fixtures" / "hang_python.py"
BOOT = """import os, runpy, sys
from distcheck.rank.bootstrap import rank_bootstrap
rank_bootstrap(os.environ["DISTCHECK_REPORT_DIR"], 1e9, watcher=False)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launch(nproc: int, report_dir: Path) -> list[subprocess.Popen]:
    boot = report_dir / "boot.py"
    boot.write_text(BOOT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DISTCHECK_REPORT_DIR=str(report_dir),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(boot), str(FIXTURE)], env=env, start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def wait_until_stuck(report_dir: Path, nproc: int, limit: float = 120) -> None:
    """Until rank 1 sits in load_shard and the others started the all_reduce it never joins."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        lines = 0
        for r in range(nproc):
            p = report_dir / f"trace-rank{r}.jsonl"
            lines += p.read_text().count('"ev": "start"') + p.read_text().count('"ev":"start"') if p.exists() else 0
        if lines >= 2 * nproc - 1:  # step 0 on every rank, step 1 started on all but rank 1
            time.sleep(0.5)
            return
        time.sleep(0.1)
    raise SystemExit("ranks never reached the hang")


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def timeout_to_report(nproc: int, timeout: float) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report_dir = Path(tmp)
        procs = launch(nproc, report_dir)
        try:
            wait_until_stuck(report_dir, nproc)
            pids = {r: p.pid for r, p in enumerate(procs)}
            source = RankFunctions(lambda: {r: p.pid for r, p in enumerate(procs) if p.poll() is None},
                                   lambda: {r for r, p in enumerate(procs) if p.poll() is not None})
            loop = WatchLoop(report_dir, timeout, source=source,
                             expected=nproc, dump=HangDump(world_size=nproc), poll=0.1)
            result = loop.run()
            if result.state != HUNG:
                raise SystemExit("the watch loop did not declare the hang")
            publish(Report("bench", nproc, result.hang_findings, [CheckResult("watchdog", False, 0.0)]), report_dir)
            reported = time.monotonic()
            terminate(list(pids.values()))
            ended = time.monotonic()
            return reported - result.declared_at, ended - result.declared_at, result.hang_findings[0].message
        finally:
            kill_all(procs)


def dumps(nproc: int, repeats: int) -> dict[str, float]:
    pyspy = find_pyspy()
    with tempfile.TemporaryDirectory() as tmp:
        report_dir = Path(tmp)
        procs = launch(nproc, report_dir)
        try:
            wait_until_stuck(report_dir, nproc)
            targets = [Target(p.pid, r) for r, p in enumerate(procs)]
            par, seq, cli = [], [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = dump_all(targets)
                par.append(time.perf_counter() - t0)
                assert len(res.stacks) == nproc, res.errors
                t0 = time.perf_counter()
                for t in targets:
                    subprocess.run([pyspy, "dump", "--pid", str(t.pid), "--json"], capture_output=True, check=True,
                                   timeout=30)
                seq.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "distcheck", "stacks", *[str(t.pid) for t in targets]],
                               capture_output=True, timeout=60, cwd=ROOT)
                cli.append(time.perf_counter() - t0)
            return {"parallel": statistics.median(par), "sequential": statistics.median(seq),
                    "cli": statistics.median(cli)}
        finally:
            kill_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores; py-spy {find_pyspy()}")
    for n in (2, 4):
        report_s, ended_s, msg = timeout_to_report(n, args.timeout)
        print(f"{n} ranks: timeout -> report written {report_s:.2f}s, -> all ranks ended {ended_s:.2f}s  [{msg}]")
    d = dumps(4, args.repeats)
    print(f"4 ranks, median of {args.repeats}: parallel dump_all {d['parallel'] * 1000:.0f} ms, "
          f"sequential py-spy x4 {d['sequential'] * 1000:.0f} ms (ratio {d['sequential'] / d['parallel']:.2f}x), "
          f"full 'python -m distcheck stacks' command {d['cli'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
