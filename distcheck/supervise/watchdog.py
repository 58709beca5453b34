"""Hang watchdog: when no rank makes progress for --timeout seconds, dump every rank's stack and name the odd one.

    python -m distcheck run --nproc 4 --timeout 60 -- train.py        # the supervisor calls diagnose_hang
    python -m distcheck.supervise.watchdog watch --report-dir DIR --timeout 60  # the per-node watcher (started by local rank 0)

Three ways in, one diagnosis (:func:`diagnose_hang`: py-spy on all ranks in parallel, last collectives from the
traces, stacks.txt + stacks.json, one ``hang`` finding):

* a supervisor that launched the ranks (``distcheck run/compare --nproc``) calls ``diagnose_hang`` as the
  launcher's ``on_hang(rank_pids, report_dir)`` callback;
* a :class:`Watchdog` thread watches the trace files from any process that is *not* a rank (the pytest plugin's
  parent, a test) and calls ``diagnose_hang`` itself;
* under plain torchrun (``consistency``, the pytest marker) there is no supervisor, and a thread inside a rank
  would starve when that rank holds the GIL in native code. So each rank calls :func:`rank_bootstrap`, and local
  rank 0 starts :func:`start_node_watcher`: a separate small process per node that finds the node's ranks from the
  ``stackhook-pid*.json`` files they write, watches their traces, and on a hang dumps them, writes the report and
  ends them (torchrun then ends the other nodes). The ranks name their parent (torchrun's agent) as ptracer, and
  the watcher is a descendant of it, so the dump works under Yama ptrace_scope=1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from distcheck.analysis.hang import RankProgress, diagnose, progress_from_events
from distcheck.contract.findings import Finding
from distcheck.supervise.stacks import (
    DEFAULT_DUMP_TIMEOUT, Target, _alive, _read_environ, dump_all, rank_descendants, write_stack_artifacts,
)

log = logging.getLogger("distcheck")

# Any new complete trace line means some rank moved: it came up ("meta"), reached a new collective ("start"),
# finished one ("end"), or ended. In a hang no rank writes anything. This matches the launcher's own rule.


def load_progress(report_dir: str | os.PathLike) -> dict[int, RankProgress]:
    """Each traced rank's last started and last completed collective, from ``trace-rank<R>.jsonl``."""
    from distcheck.analysis.trace_events import load_traces

    return {rank: progress_from_events(rank, rt.events) for rank, rt in load_traces(report_dir).items()}


def diagnose_hang(rank_pids: dict[int, int], report_dir: str | os.PathLike, native: bool = False,
                  timeout: float | None = None, world_size: int | None = None,
                  dump_timeout: float = DEFAULT_DUMP_TIMEOUT, stem: str = "stacks",
                  out_dir: str | os.PathLike | None = None) -> list[Finding]:
    """Dump all ranks in parallel, read their traces, write ``<stem>.txt``/``<stem>.json``; return the hang finding.

    Traces and faulthandler hooks are read from ``report_dir``; stacks are written to ``out_dir`` (default: the
    same). Plugs into the launcher as ``on_hang=lambda pids, d: diagnose_hang(pids, d, native, timeout)``.
    """
    t0 = time.monotonic()
    targets = [Target(pid, rank, "launcher", world_size, str(report_dir)) for rank, pid in sorted(rank_pids.items())]
    result = dump_all(targets, native=native, timeout=dump_timeout, report_dirs=[report_dir])
    try:
        progress = load_progress(report_dir)
    except Exception as exc:  # a broken trace must not cost us the stacks
        log.warning("could not read traces in %s: %s", report_dir, exc)
        progress = {}
    errors_by_rank = {e.rank: e.message for e in result.errors if e.rank is not None}
    diag = diagnose(result.stacks, progress, world_size or len(rank_pids) or None, timeout, errors_by_rank)
    finding = diag.to_finding(result.stacks, progress, [e.message for e in result.errors])
    title = f"distcheck watchdog: no progress for {timeout:g}s" if timeout else "distcheck watchdog"
    artifacts = write_stack_artifacts(out_dir or report_dir, result.stacks, result.errors, native, progress, title,
                                      stem, diag.groups, diag.message)
    finding.detail["artifacts"] = artifacts
    finding.detail["dump_seconds"] = round(result.seconds, 3)
    finding.detail["diagnose_seconds"] = round(time.monotonic() - t0, 3)
    return [finding]


class ProgressMonitor:
    """Reads only the new bytes of every trace file and says whether a progress event appeared since last time."""

    def __init__(self, report_dir: str | os.PathLike):
        self.report_dir = Path(report_dir)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}

    def poll(self) -> bool:
        moved = False
        for path in self.report_dir.glob("trace-rank*.jsonl"):
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    chunk = fh.read()
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[path] = start + len(chunk)
            text = self._partial.pop(path, "") + chunk.decode("utf-8", errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]  # a line still being written
            for line in lines[:-1]:
                try:
                    if json.loads(line).get("ev"):
                        moved = True
                except (ValueError, AttributeError):
                    continue
        return moved


RankPids = Callable[[], dict[int, int]]


class Watchdog:
    """A thread (in a process that is not a rank) that declares a hang after ``timeout`` s without progress.

    ``rank_pids`` is a dict or a callable returning ``{rank: pid}`` of the live ranks (asked again at every poll,
    since ranks appear after launch). On a hang it calls :func:`diagnose_hang`, keeps the findings, then calls
    ``on_hang(findings)`` (which typically ends the job). It stops by itself once every known rank has exited.
    """

    def __init__(self, report_dir: str | os.PathLike, timeout: float, rank_pids: dict[int, int] | RankPids,
                 on_hang: Callable[[list[Finding]], None] | None = None, native: bool = False,
                 world_size: int | None = None, poll: float = 0.2, stem: str = "stacks",
                 out_dir: str | os.PathLike | None = None):
        self.report_dir = str(report_dir)
        self.out_dir = str(out_dir or report_dir)
        self.timeout = timeout
        self._rank_pids = rank_pids if callable(rank_pids) else (lambda: dict(rank_pids))
        self.on_hang = on_hang
        self.native = native
        self.world_size = world_size
        self.poll_interval = poll
        self.stem = stem
        self.findings: list[Finding] = []
        self.fired = threading.Event()
        self.hang_declared_at: float | None = None  # monotonic time the timeout expired
        self.diagnosed_at: float | None = None  # monotonic time the stacks and finding were written
        self._progress = ProgressMonitor(report_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distcheck-watchdog", daemon=True)
        self._last_progress = time.monotonic()
        self._seen: dict[int, int] = {}

    def start(self) -> Watchdog:
        self._last_progress = time.monotonic()
        self._thread.start()
        return self

    def notify_progress(self) -> None:
        """For callers with other progress signals (a rank printed, a step finished)."""
        self._last_progress = time.monotonic()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _live(self) -> dict[int, int]:
        try:
            pids = self._rank_pids()
        except Exception as exc:  # e.g. /proc races while ranks start
            log.debug("rank pid lookup failed: %s", exc)
            pids = {}
        self._seen.update(pids)
        return {r: p for r, p in pids.items() if _alive(p)}

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if self._progress.poll():
                self._last_progress = time.monotonic()
            live = self._live()
            if self._seen and not live:
                return  # the job ended by itself
            if time.monotonic() - self._last_progress < self.timeout:
                continue
            self.hang_declared_at = time.monotonic()
            log.warning("no progress for %.0fs: dumping %d ranks", self.timeout, len(live))
            try:
                self.findings = diagnose_hang(live, self.report_dir, self.native, self.timeout,
                                              self.world_size, stem=self.stem, out_dir=self.out_dir)
            except Exception as exc:  # never lose the chance to end the job
                log.warning("hang diagnosis failed: %s", exc)
                self.findings = [Finding("hang", list(live), f"no progress for {self.timeout:g}s "
                                         f"(stack dump failed: {exc})", {"timeout": self.timeout})]
            self.diagnosed_at = time.monotonic()
            self.fired.set()
            if self.on_hang is not None:
                self.on_hang(self.findings)
            return


def ranks_of_agent(agent_pid: int) -> Callable[[], dict[int, int]]:
    """``rank_pids`` source for a torchrun agent: its worker children, rank read from their environment."""
    def lookup() -> dict[int, int]:
        out = {}
        for pid in rank_descendants(agent_pid):
            try:
                out[int(_read_environ(pid)["RANK"])] = pid
            except (OSError, KeyError, ValueError):
                continue
        return out
    return lookup


def terminate(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM the given rank pids, then SIGKILL whatever is left after ``grace`` seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# --- the per-node watcher for jobs without a distcheck supervisor ----------------------------------------------


def local_ranks(report_dir: str | os.PathLike, host: str | None = None) -> dict[int, int]:
    """``{rank: pid}`` of this node's live ranks, from the hook files written by :func:`rank_bootstrap`.

    A stale hook file from an earlier job in the same directory is ignored: its pid is dead, or now belongs to a
    process whose RANK differs.
    """
    host = host or socket.gethostname()
    out: dict[int, int] = {}
    for path in Path(report_dir).glob("stackhook-pid*.json"):
        try:
            data = json.loads(path.read_text())
            pid, rank = int(data["pid"]), int(data["rank"])
        except (OSError, ValueError, KeyError):
            continue
        if data.get("host", host) != host or not _alive(pid):
            continue
        try:
            if int(_read_environ(pid).get("RANK", rank)) != rank:
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
    cmd = [sys.executable, "-m", "distcheck.supervise.watchdog", "watch", "--report-dir", str(report_dir),
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


def rank_bootstrap(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                   trace: bool = True, watcher: bool = True) -> subprocess.Popen | None:
    """Call at the start of every rank under torchrun (consistency, the pytest marker, ``torchrun -m distcheck run``).

    Installs the stack hooks (ptracer + faulthandler), the collective tracer (progress and last collectives), and
    on local rank 0 starts the node watcher; returns the watcher's Popen there, None elsewhere. ``watcher=False``
    when a supervisor outside the ranks already watches them.
    """
    from distcheck.supervise.stacks import install_rank_hooks

    Path(report_dir).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    install_rank_hooks(report_dir, rank)
    if trace:
        from distcheck.rank import tracer as tracing

        if tracing.current() is None:
            tracing.install(report_dir, rank)
    if not watcher or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    ws = os.environ.get("WORLD_SIZE")
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    return start_node_watcher(report_dir, timeout, native, int(ws) if ws else None, int(lws) if lws else None)


def _watch(args: argparse.Namespace) -> int:
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, write_report

    host = socket.gethostname()
    logging.basicConfig(level=logging.INFO, format=f"[distcheck watcher {host}] %(message)s")
    multi_node = bool(args.world_size and args.local_world_size and args.world_size > args.local_world_size)
    out_dir = Path(args.report_dir) / f"node-{host}" if multi_node else Path(args.report_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parent = args.parent

    def source() -> dict[int, int]:
        return local_ranks(args.report_dir, host)

    # Traces and hooks are read from the (possibly shared) report dir; this node's stacks and report go to out_dir.
    dog = Watchdog(args.report_dir, args.timeout, source, native=args.native, world_size=args.world_size,
                   out_dir=out_dir).start()
    started = time.monotonic()
    while not dog.fired.wait(0.2):
        if not dog._thread.is_alive():
            return 0  # every rank ended
        if parent and not _alive(parent) and not source() and time.monotonic() - started > 2.0:
            dog.stop()
            return 0
    pids = source()
    check = CheckResult("watchdog", False, (dog.diagnosed_at or 0) - (dog.hang_declared_at or 0),
                        note=f"no progress for {args.timeout:g}s")
    report = _report_so_far(out_dir)
    if report is not None:
        # The command wrote a partial report (what completed before the hang): keep it, add the diagnosis.
        report.findings = [f for f in report.findings if not f.detail.get("partial")] + dog.findings
        report.checks.append(check)
    else:
        report = Report(command=f"distcheck watchdog --timeout {args.timeout:g} (node {host})",
                        world_size=args.world_size or len(pids), findings=dog.findings, checks=[check])
    report.artifacts.update({"stacks.txt": "stacks.txt", "stacks.json": "stacks.json"})
    write_report(report, out_dir)
    for f in dog.findings:
        log.warning("[%s] %s", f.kind, f.message)
    terminate(list(pids.values()))
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
    parser = argparse.ArgumentParser(prog="python -m distcheck.supervise.watchdog")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="watch this node's ranks; on a hang dump them, write the report, end them")
    w.add_argument("--report-dir", required=True)
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--native", action="store_true")
    w.add_argument("--parent", type=int, default=0, help="pid of the rank that started this watcher")
    w.add_argument("--world-size", type=int, default=None)
    w.add_argument("--local-world-size", type=int, default=None)
    args = parser.parse_args(argv)
    return _watch(args)


if __name__ == "__main__":
    sys.exit(main())
