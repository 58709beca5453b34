"""The per-node watcher for jobs that distcheck did not launch (``consistency``, ``run`` under torchrun).

    torchrun --nproc-per-node 2 -m distcheck consistency --timeout 60     # local rank 0 starts one per node
    python -m distcheck.supervise.node_watcher --report-dir DIR --timeout 60 --parent PID   (internal)

Under plain torchrun there is no distcheck supervisor, and a thread inside a rank would starve when that rank
holds the GIL in native code. So local rank 0 starts this small process (distcheck/rank/bootstrap.py). It finds
the node's ranks from the ``stackhook-pid*.json`` files they write, runs the one watch loop over their traces,
and on a hang dumps them, writes the report and ends them (torchrun then ends the other nodes). The ranks name
their parent (torchrun's agent) as ptracer, and the watcher is a descendant of it, so the dump works under Yama
ptrace_scope=1. It ends by itself once the node's ranks have ended.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from distcheck.contract import files
from distcheck.supervise.procs import alive, read_environ, terminate
from distcheck.supervise.watch import HUNG, HangDump, WatchLoop

log = logging.getLogger("distcheck")


def local_ranks(report_dir: str | os.PathLike, host: str | None = None) -> dict[int, int]:
    """``{rank: pid}`` of this node's live ranks, from the hook files written by distcheck/rank/bootstrap.py.

    A stale hook file from an earlier job in the same directory is ignored: its pid is dead, or now belongs to a
    process whose RANK differs.
    """
    host = host or socket.gethostname()
    out: dict[int, int] = {}
    for path in files.hook_files(report_dir):
        try:
            data = json.loads(path.read_text())
            pid, rank = int(data["pid"]), int(data["rank"])
        except (OSError, ValueError, KeyError):
            continue
        if data.get("host", host) != host or not alive(pid):
            continue
        try:
            if int(read_environ(pid).get("RANK", rank)) != rank:
                continue
        except (OSError, ValueError):
            continue
        out[rank] = pid
    return out


def start_node_watcher(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                       world_size: int | None = None, local_world_size: int | None = None) -> subprocess.Popen:
    """Start the node's watcher process (call from local rank 0 only). It ends by itself when the ranks end.

    Its own session keeps torchrun's teardown signals from killing it halfway through writing the report.
    """
    cmd = [sys.executable, "-m", "distcheck.supervise.node_watcher", "--report-dir", str(report_dir),
           "--timeout", str(timeout), "--parent", str(os.getpid())]
    if native:
        cmd.append("--native")
    if world_size:
        cmd += ["--world-size", str(world_size)]
    if local_world_size:
        cmd += ["--local-world-size", str(local_world_size)]
    log_path = Path(report_dir) / f"watcher-{socket.gethostname()}.log"
    with open(log_path, "a") as logf:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def watch(report_dir: str, timeout: float, native: bool = False, parent: int = 0, world_size: int | None = None,
          local_world_size: int | None = None) -> int:
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, write_report

    host = socket.gethostname()
    multi_node = bool(world_size and local_world_size and world_size > local_world_size)
    out_dir = Path(report_dir) / f"node-{host}" if multi_node else Path(report_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()

    def live() -> dict[int, int]:
        ranks = local_ranks(report_dir, host)
        seen.update(ranks)
        return ranks

    def finished() -> set[int]:
        return seen - set(live())

    cancel = threading.Event()

    def orphaned() -> None:  # the rank that started us died before any rank registered: nothing to watch
        started = time.monotonic()
        while not cancel.wait(0.5):
            if parent and not alive(parent) and not seen and time.monotonic() - started > 2.0:
                cancel.set()

    threading.Thread(target=orphaned, daemon=True).start()
    # Traces and hooks are read from the (possibly shared) report dir; this node's stacks and report go to out_dir.
    loop = WatchLoop(report_dir, timeout, live=live, finished=finished, expected=None, ranks=None,
                     startup_timeout=timeout, dump=HangDump(native, world_size, out_dir), poll=0.2, cancel=cancel)
    result = loop.run()
    cancel.set()
    if result.state != HUNG:
        return 0
    pids = local_ranks(report_dir, host)
    check = CheckResult("watchdog", False, (result.diagnosed_at or 0) - (result.declared_at or 0),
                        note=f"no progress for {timeout:g}s")
    report = _report_so_far(out_dir)
    if report is not None:
        # The command wrote a partial report (what completed before the hang): keep it, add the diagnosis.
        report.findings = [f for f in report.findings if not f.detail.get("partial")] + result.hang_findings
        report.checks.append(check)
    else:
        report = Report(command=f"distcheck watchdog --timeout {timeout:g} (node {host})",
                        world_size=world_size or len(pids), findings=result.hang_findings, checks=[check])
    report.artifacts.update({files.STACKS_TXT: files.STACKS_TXT, files.STACKS_JSON: files.STACKS_JSON})
    write_report(report, out_dir)
    for f in result.hang_findings:
        log.warning("[%s] %s", f.kind, f.message)
    terminate(list(pids.values()), grace=2.0)
    return 1


def _report_so_far(out_dir: Path):
    from distcheck.contract.report import load_report

    if not (out_dir / "report.json").exists():
        return None
    try:
        return load_report(out_dir)
    except Exception:  # a report being rewritten right now, or not ours: start a fresh one
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcheck.supervise.node_watcher")
    parser.add_argument("--report-dir", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--parent", type=int, default=0, help="pid of the rank that started this watcher")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--local-world-size", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[distcheck watcher {socket.gethostname()}] %(message)s")
    return watch(args.report_dir, args.timeout, args.native, args.parent, args.world_size, args.local_world_size)


if __name__ == "__main__":
    sys.exit(main())
