"""The per-node watcher for jobs that distcheck did not launch (``consistency``, ``run`` under torchrun).

    torchrun --nproc-per-node 2 -m distcheck consistency --timeout 60     # local rank 0 starts one per node
    python -m distcheck.supervise.node_watcher --report-dir DIR --timeout 60 --parent PID   (internal)

Under plain torchrun there is no distcheck supervisor, and a thread inside a rank would starve when that rank
holds the GIL in native code. So local rank 0 starts this small process (distcheck/rank/bootstrap.py). It finds
the node's ranks from the ``stackhook-pid*.json`` files they write, runs the one watch loop over their traces,
and on a hang dumps them, writes the report and ends them (torchrun then ends the other nodes). The ranks name
their parent (torchrun's agent) as ptracer, and the watcher is a descendant of it, so the dump works under Yama
ptrace_scope=1. It ends by itself once the node's ranks have ended, and ends what they left on this node first:
the processes they started that still run (a helper in a session of its own, a stuck DataLoader worker), found
by the ranks' process trees as it watched them and by the run's id in their environment (supervise/procs.RunTree),
so that nothing of the job holds its console open after torchrun exits.
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
from distcheck.contract.findings import format_ranks
from distcheck.supervise.procs import NODE_WATCHER, ROLE_ENV, RUN_ID_ENV, RunTree, alive, read_environ, terminate
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
    cmd += ["--log", str(Path(report_dir) / f"watcher-{socket.gethostname()}.log")]
    # stdout/stderr: the rank's, i.e. the job's console, where the report is printed; the log goes to a file.
    # Its role keeps the ranks' own sweeps (runtime.end_processes) from ending it with the script's processes.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                            env={**os.environ, ROLE_ENV: NODE_WATCHER})


def watch(report_dir: str, timeout: float, native: bool = False, parent: int = 0, world_size: int | None = None,
          local_world_size: int | None = None) -> int:
    tree = RunTree(os.environ.get(RUN_ID_ENV))
    try:
        return _watch(report_dir, timeout, native, parent, world_size, local_world_size, tree)
    finally:
        ended = tree.end()  # whatever the ranks left on this node, then their stderr copies once drained
        if ended:
            log.info("ended %d processes the ranks left running: %s", len(ended), ended)


def _watch(report_dir: str, timeout: float, native: bool, parent: int, world_size: int | None,
           local_world_size: int | None, tree: RunTree) -> int:
    host = socket.gethostname()
    multi_node = bool(world_size and local_world_size and world_size > local_world_size)
    out_dir = Path(report_dir) / f"node-{host}" if multi_node else Path(report_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()

    last: list[dict[int, int]] = [{}]

    def live() -> dict[int, int]:
        ranks = local_ranks(report_dir, host)
        tree.observe(ranks)
        seen.update(ranks)
        if ranks != last[0]:
            log.info("ranks running on this node: %s", ranks)
            last[0] = ranks
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
    started = time.monotonic()
    started_wall = time.time()
    # Traces and hooks are read from the (possibly shared) report dir; this node's stacks and report go to out_dir.
    loop = WatchLoop(report_dir, timeout, live=live, finished=finished, expected=None, ranks=None,
                     startup_timeout=timeout, dump=HangDump(native, world_size, out_dir), poll=0.2, cancel=cancel)
    result = loop.run()
    cancel.set()
    if result.state == HUNG:
        pids = local_ranks(report_dir, host)
        write_node_report(report_dir, out_dir, result.hang_findings, world_size or len(pids), timeout,
                          time.monotonic() - started, "watchdog", f"no progress for {timeout:g}s",
                          (result.diagnosed_at or 0) - (result.declared_at or 0))
        terminate(list(pids.values()), grace=2.0)
        files.tidy(report_dir)
        return 1
    stopped = stop_finding(report_dir, out_dir, native, world_size)
    if stopped is not None:  # torchrun passed a stop signal on to the ranks: they dumped their stacks and died
        dead = stopped.detail["died_first"]
        note = (f"{format_ranks(dead)} ended first; torchrun stopped the others" if dead
                else f"stopped from outside by {stopped.detail['stopped_by']}")
        write_node_report(report_dir, out_dir, [stopped], world_size or len(seen), timeout,
                          time.monotonic() - started, "stopped", note, running=set(stopped.detail["stopped_ranks"]))
        files.tidy(report_dir)
        return 1
    if 0 in seen and not _written_since(out_dir, started_wall):
        # Rank 0 died before it could write the report (SIGKILLed, or stopped by torchrun after another rank
        # died): the run's report, from the ranks' files, so that the death is still named.
        write_node_report(report_dir, out_dir, [], world_size or len(seen), timeout, time.monotonic() - started,
                          "report", "rank 0 ended before writing the report", running=set())
        files.tidy(report_dir)
        return 1
    return 0


def _written_since(out_dir: Path, since: float) -> bool:
    try:
        return (out_dir / files.REPORT_JSON).stat().st_mtime >= since - 1.0
    except OSError:
        return False


def stop_finding(report_dir: str, out_dir: Path, native: bool, world_size: int | None):
    """The ``hang`` finding for ranks that dumped their stacks on a stop signal (rank/stack_hooks.py), or None
    when no rank of this node got one (or every rank had finished its script anyway)."""
    from distcheck.analysis.hang import diagnose
    from distcheck.analysis.stack_groups import RankStack, parse_faulthandler
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise.hang import load_progress
    from distcheck.supervise.stacks import write_stack_artifacts

    host = socket.gethostname()
    traces = load_traces(report_dir)
    stacks, signals = [], set()
    for name in files.STOP_SIGNAL_NAMES:
        for rank, path in files.rank_files(report_dir, f"stop_{name}").items():
            text = path.read_text(errors="replace") if path.stat().st_size else ""
            trace = traces.get(rank)
            if not text or (trace is not None and trace.finished is not None):
                continue
            threads = parse_faulthandler(text)
            if threads:
                pid = trace.meta.get("pid", 0) if trace is not None else 0
                stacks.append(RankStack(rank, int(pid or 0), host, f"faulthandler ({name})", threads, "RANK",
                                        world_size))
                signals.add(name)
    if not stacks:
        return None
    cause = "/".join(sorted(signals))
    progress = load_progress(report_dir)
    dumped = sorted(s.rank for s in stacks)
    # A rank that ended unfinished without dumping got no stop signal: it died first (SIGKILL, the OOM killer),
    # and torchrun then stopped the others. That death is the cause, and this finding says it is the consequence.
    dead = sorted(r for r, t in traces.items() if t.finished is None and r not in dumped)
    if dead:
        prefix = (f"torchrun stopped {format_ranks(dumped)} ({cause}) after {format_ranks(dead)} ended without "
                  f"finishing its script: ")
    else:
        prefix = f"the run was stopped from outside by {cause} (torchrun passed it on to the ranks): "
    diag = diagnose(stacks, progress, world_size, None, {}, prefix)
    finding = diag.to_finding(stacks, progress)
    finding.detail["stopped_by"] = cause
    finding.detail["stopped_ranks"] = dumped
    finding.detail["died_first"] = dead
    finding.detail["artifacts"] = write_stack_artifacts(out_dir, stacks, [], native, progress,
                                                        f"distcheck: stopped by {cause}", files.STACKS_STEM,
                                                        diag.groups, diag.message)
    return finding


def write_node_report(report_dir: str, out_dir: Path, findings: list, world_size: int, timeout: float,
                      seconds: float, check_name: str, note: str, check_seconds: float = 0.0,
                      running: set[int] | None = None) -> None:
    """This node's report on a hang or a stop signal, printed to the console (stderr) too.

    A command that wrote a partial report (consistency: what completed before) keeps it, with the diagnosis added;
    for ``run`` the whole run report is built from the ranks' files, as rank 0 would have built it.
    """
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, render_text, write_report
    from distcheck.supervise import run_report

    check = CheckResult(check_name, False, check_seconds, note=note)
    report = _report_so_far(out_dir)
    traces = load_traces(report_dir)
    if report is not None:
        report.findings = [f for f in report.findings if not f.detail.get("partial")] + findings
        report.checks.append(check)
    elif traces:
        if running is None:  # a hang: every rank without an exit line was still running
            running = {r for r, t in traces.items() if t.finished is None}
        outcomes = run_report.outcomes_from_traces(traces, world_size, True, running)
        report = run_report.build_report(Path(report_dir), command_of(traces), world_size, traces, outcomes,
                                         timeout, seconds, hang_findings=findings, stop_reason=note)
    else:
        report = Report(command="distcheck (under torchrun)", world_size=world_size, findings=findings,
                        checks=[check])
    report.artifacts.update({files.STACKS_TXT: files.STACKS_TXT, files.STACKS_JSON: files.STACKS_JSON})
    write_report(report, out_dir)
    for f in findings:
        log.warning("[%s] %s", f.kind, f.message)
    sys.stderr.write(render_text(report, out_dir))  # the console of the job, through rank 0's stderr
    sys.stderr.flush()


def command_of(traces: dict) -> str:
    """The user's distcheck command, from a rank's argv in its trace."""
    for trace in traces.values():
        argv = trace.meta.get("argv") or []
        if len(argv) > 1 and str(argv[0]).endswith("__main__.py"):
            return "distcheck " + " ".join(map(str, argv[1:]))
    return "distcheck (under torchrun)"


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
    parser.add_argument("--log", default=None, help="log file (default: stderr)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[distcheck watcher {socket.gethostname()}] %(message)s",
                        filename=args.log)
    return watch(args.report_dir, args.timeout, args.native, args.parent, args.world_size, args.local_world_size)


if __name__ == "__main__":
    sys.exit(main())
