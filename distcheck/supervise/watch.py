"""The one watch loop: every supervisor of ranks decides "progressing, done, stuck or hung" here, by one rule.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py     # the launcher's loop
    torchrun --nproc-per-node 2 -m distcheck run -- train.py       # the node watcher's loop

Used by the launcher (``run``/``compare`` with ``--nproc``), the node watcher under torchrun, and the pytest pool
(one loop per test). The callers differ only in how they learn which ranks are still running and which have
finished (process handles, pids from hook files, exit lines in the traces, pipe messages): each answers that one
question as a RankSource (launcher.LauncherRanks, node_watcher.NodeRanks, pool.PoolRanks; RankFunctions wraps two
plain functions, for tests and benches).

The progress rule: a rank made progress when its trace file grew (it came up, started or completed a
collective, raised, or ended: the tracer writes one line for each) or when its outcome became known. A poll reads
only past where the last one found each rank's records ended (contract/progress_token.py), and the stop check's loads of a big job's
traces (analysis/trace_summary.py) read only what was appended since the last: neither grows with the number of
collectives the ranks ran. After
``timeout`` seconds without progress the run is hung; while some rank has not opened its trace yet (it is still
importing torch, seconds on a loaded machine) the limit is ``startup_timeout`` instead, so a short ``--timeout``
does not fire before the script runs. ``should_stop`` ends a run early that provably cannot progress (a rank
waits in a collective that a finished peer never issued), asked once per ``stop_grace`` of idleness.

On a hang the loop dumps every live rank (supervise/hang.py, the one diagnosis path) while the ranks are still
alive, and returns; ending the ranks is the caller's (supervise/procs.terminate), since only it knows whether
they are its children.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from distcheck.contract.site import base_name, file_line
from distcheck.contract import files
from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract.progress_token import ProgressTokens
from distcheck.supervise.live_stragglers import LiveStragglers
from distcheck.supervise.signals import Interrupt, stop_finding

log = logging.getLogger("distcheck")

STOP_GRACE = 2.0  # seconds of idleness before asking whether the ranks can progress at all
ENDING_GRACE = 1.0  # seconds a rank that wrote its exit line gets to end by itself when a stop signal comes
STARTUP_TIMEOUT = 120.0  # the least time a rank gets to import torch and open its trace
DONE, HUNG, STOPPED, INTERRUPTED, CANCELLED = "done", "hung", "stopped", "interrupted", "cancelled"


@dataclass
class HangDump:
    """How to dump the ranks on a hang: native frames, the world size for grouping, where stacks go."""

    native: bool = False
    world_size: int | None = None
    out_dir: str | os.PathLike | None = None


@dataclass
class WatchResult:
    state: str  # DONE | HUNG | STOPPED | INTERRUPTED (a signal from outside) | CANCELLED
    stop_reason: str | None = None
    hang_findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    declared_at: float | None = None  # monotonic time the hang was declared
    diagnosed_at: float | None = None  # monotonic time its diagnosis was written


class RankSource(Protocol):
    """Where are the ranks: the one question every supervisor answers for the watch loop, asked on each poll.
    ``live()``: ``{rank: pid}`` of the ranks still running; ``finished()``: the ranks whose outcome is known (it
    may collect those outcomes, or tell others, as a side effect). Implemented by the launcher
    (launcher.LauncherRanks: its child processes), the node watcher under torchrun (node_watcher.NodeRanks: pids
    from the hook files, exit lines and traces), the pytest pool (pool.PoolRanks: its processes and the outcomes
    they send), and RankFunctions (two plain functions: tests, benches)."""

    def live(self) -> dict[int, int]: ...

    def finished(self) -> set[int]: ...


@dataclass
class RankFunctions:
    """A RankSource from two functions (tests, benches): ``live`` returns ``{rank: pid}``, ``finished`` the ranks
    whose outcome is known (by default none)."""

    live: Callable[[], dict[int, int]]
    finished: Callable[[], set[int]] = set


class WatchLoop:
    """Watch ranks until all have finished, they stop progressing for ``timeout`` s, or they provably cannot
    progress. ``source`` says which ranks are still running and which have finished (RankSource); ``expected``
    is how many ranks finish a run (None: the run is over once some rank was seen and none is live)."""

    def __init__(self, report_dir: str | os.PathLike, timeout: float, *, source: RankSource, expected: int | None,
                 should_stop: Callable[[set[int]], str | None] | None = None, dump: HangDump | None = None,
                 ranks: Iterable[int] | None = None, startup_timeout: float | None = None,
                 stop_grace: float = STOP_GRACE, failure_grace: float | None = None,
                 failed: Callable[[], bool] | None = None, poll: float = 0.1,
                 cancel: threading.Event | None = None, interrupt: Interrupt | None = None,
                 stragglers: LiveStragglers | None = None) -> None:
        self.report_dir = str(report_dir)
        self.timeout = timeout
        self.source = source
        self.expected = expected
        self.should_stop = should_stop
        self.dump = dump
        self.progress = ProgressTokens(report_dir, range(expected) if ranks is None and expected else ranks)
        self.startup_timeout = max(timeout, STARTUP_TIMEOUT) if startup_timeout is None else startup_timeout
        self.stop_grace = min(stop_grace, timeout)
        # After a rank failed, its peers usually wait in a collective that will never complete.
        self.failure_grace = failure_grace
        self.failed = failed
        self.poll = poll
        self.cancel = cancel or threading.Event()
        self.interrupt = interrupt
        if interrupt is not None:
            self.cancel = interrupt.event
        self.stragglers = stragglers  # the live straggler line (supervise/live_stragglers.py), looked at each poll

    def _over(self, done: set[int], seen: set[int], running: dict[int, int]) -> bool:
        if self.expected is not None:
            return len(done) >= self.expected
        return bool(seen) and not running

    def run(self) -> WatchResult:
        started = time.monotonic()
        seen: set[int] = set()
        done = set(self.source.finished())
        token = (self.progress.sizes(), frozenset(done))
        last_progress = last_stop_check = time.monotonic()
        while not self.cancel.wait(self.poll):
            now = time.monotonic()
            done = set(self.source.finished())
            seen.update(done)  # a rank that finished was running once, even if no poll saw it live
            running = self.source.live()
            seen.update(running)
            if self._over(done, seen, running):
                return WatchResult(DONE, seconds=now - started)
            new = (self.progress.sizes(), frozenset(done))
            if new != token:
                token, last_progress = new, now
            idle = now - last_progress
            starting = self.progress.starting(token[0])
            limit = self.startup_timeout if starting else self.timeout
            if self.failure_grace is not None and self.failed is not None and self.failed():
                limit = min(limit, self.failure_grace)
            if idle >= limit:
                return self._hang(idle, started)
            if self.stragglers is not None and not starting:
                self.stragglers.look(now)
            if (self.should_stop is not None and not starting and idle >= self.stop_grace
                    and now - last_stop_check >= self.stop_grace):
                last_stop_check = now
                try:
                    reason = self.should_stop(done)
                except Exception as exc:  # a half-written trace: ask again next time
                    log.debug("stop check failed: %s", exc)
                    reason = None
                if reason:
                    log.warning("stopping the run: %s", reason)
                    return WatchResult(STOPPED, reason, seconds=time.monotonic() - started)
        if self.interrupt is not None and self.interrupt.cause:
            return self._stopped(started, seen)
        return WatchResult(CANCELLED, seconds=time.monotonic() - started)

    def _stopped(self, started: float, seen: set[int]) -> WatchResult:
        """A stop signal from outside (supervise/signals.py has the rule). One that comes after every rank has
        finished stops nothing: DONE, and the report notes the signal. Ranks that already wrote their exit line
        are ending by themselves, so they get a moment (ENDING_GRACE) before anything is dumped or ended."""
        cause = self.interrupt.cause if self.interrupt is not None else None
        deadline = time.monotonic() + ENDING_GRACE
        while True:
            done = set(self.source.finished())
            running = self.source.live()
            seen.update(done, running)
            if self._over(done, seen, running):
                log.warning("%s came after every rank had finished: it stops nothing", cause)
                return WatchResult(DONE, seconds=time.monotonic() - started)
            if time.monotonic() >= deadline or not all(script_ended(self.report_dir, r) for r in running):
                break
            time.sleep(0.02)
        return self._hang(time.monotonic() - started, started, cause=cause)

    def _hang(self, idle: float, started: float, cause: str | None = None) -> WatchResult:
        """Dump every live rank: for a hang (no progress for ``timeout``), or a stop signal (``cause``)."""
        from distcheck.supervise.hang import diagnose_hang

        declared = time.monotonic()
        live = self.source.live()
        if cause:
            log.warning("stopped from outside by %s: dumping %d running ranks", cause, len(live))
        else:
            log.warning("no progress for %.0fs: declaring the run hung (%d ranks still running)", idle, len(live))
        findings: list[Finding] = []
        start_up = cause is not None and self.progress.none_completed()
        if start_up and not any(self.progress.has_trace(r) for r in live):
            # No rank runs the script yet (they import torch and distcheck): nothing of the user's to dump or name.
            findings = [stop_finding(cause, self._after(idle), self._ranks(live), starting_text(self._ranks(live)))]
        elif self.dump is not None:
            findings = diagnose_hang(live, self.report_dir, native=self.dump.native, timeout=self.timeout,
                                     world_size=self.dump.world_size, out_dir=self.dump.out_dir,
                                     stopped_by=cause, after=self._after(idle) if cause else None)
            if start_up:
                findings = [as_start_up(f, cause, self._after(idle), self._ranks(live)) for f in findings]
        elif start_up:
            findings = [stop_finding(cause, self._after(idle), self._ranks(live), "the ranks were starting")]
        for f in findings:
            if cause:
                f.detail.setdefault("phase", "running")
        if cause and live and not self.source.live() and self._over(set(self.source.finished()), set(live), {}):
            # Every rank finished on its own while it was being dumped: the signal stopped nothing after all.
            log.warning("every rank finished while being dumped: %s stops nothing", cause)
            return WatchResult(DONE, seconds=time.monotonic() - started)
        return WatchResult(INTERRUPTED if cause else HUNG, stop_reason=cause, hang_findings=findings,
                           seconds=time.monotonic() - started, declared_at=declared, diagnosed_at=time.monotonic())

    def _after(self, idle: float) -> float:
        """Seconds from the start (the handlers' installation, as early as the process allows) to the signal."""
        return self.interrupt.after if self.interrupt is not None and self.interrupt.at is not None else idle

    def _ranks(self, live: dict[int, int]) -> list[int]:
        if self.progress.ranks is not None:
            return list(self.progress.ranks)
        return sorted(live)


def script_ended(report_dir: str | os.PathLike, rank: int) -> bool:
    """Whether the rank wrote its exit line: its script is over and it is ending by itself (the last line of its
    trace, read from the end of the file)."""
    return _exit_line(report_dir, rank) is not None


def script_passed(report_dir: str | os.PathLike, rank: int) -> bool:
    """Whether the rank's exit line says its script returned (False: it raised, or wrote no exit line)."""
    line = _exit_line(report_dir, rank)
    return line is not None and (b'"ok":true' in line or b'"ok": true' in line)


def _exit_line(report_dir: str | os.PathLike, rank: int) -> bytes | None:
    try:
        with open(files.rank_file(report_dir, "trace", rank), "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - 4096))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.strip():
            line = line.lstrip()
            return line if line.startswith((b'{"ev":"exit"', b'{"ev": "exit"')) else None
    return None


def starting_text(ranks: list[int]) -> str:
    return (f"{format_ranks(ranks) if ranks else 'the ranks'} {'was' if len(ranks) == 1 else 'were'} still "
            f"starting (importing torch and distcheck), so none of the script ran")


def _is_import_frame(frame: dict) -> bool:
    return str(frame.get("file", "")).startswith("<frozen importlib") or frame.get("name") in (
        "_find_and_load", "_handle_fromlist", "_call_with_frames_removed")


def _where_starting(stack: dict | None, progress: dict | None) -> str:
    """Where a rank that has not completed a collective is, without naming the line of an import: "importing
    modules", the first collective it waits in, the innermost line of the script, or still starting."""
    from distcheck.analysis.frame_owner import is_user

    threads = (stack or {}).get("threads") or []
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    frames = (main or {}).get("frames") or []
    if any(_is_import_frame(f) for f in frames):
        return "importing modules"
    waits = (progress or {}).get("first_open")
    if waits:  # it issued its first collective and waits for its peers there
        seq = f" #{waits['seq']}" if waits.get("seq") is not None else ""
        return f"waiting in {waits.get('op', '?')}{seq} ({waits.get('site') or '?'})"
    user = next((f for f in frames if not f.get("native") and is_user(str(f.get("file", "")))), None)
    if user is None:
        return "still starting, before its script ran" if stack else "still starting"
    site = file_line(str(user.get("file", "")), user.get("line")) or base_name(str(user.get("file", "?")))
    name = user.get("name") or "?"
    return f"at {site}" if name == "<module>" else f"in {name} ({site})"


def as_start_up(finding: Finding, cause: str, after: float, ranks: list[int]) -> Finding:
    """A stop signal's hang finding, from before any collective completed, told as a stop during start-up: where
    each rank was (importing modules, or its line where it was not in an import), with no rank singled out and no
    line blamed. The stacks stay in the detail and stacks.txt."""
    stacks = finding.detail.get("stacks") or {}
    progress = finding.detail.get("last_collectives") or {}
    where: dict[str, list[int]] = {}
    for rank in ranks:
        stack, mine = stacks.get(str(rank)), progress.get(str(rank))
        text = (_where_starting(stack, mine) if stack or mine
                else "still starting (importing torch and distcheck)")
        where.setdefault(text, []).append(rank)
    parts = [f"{format_ranks(rs)} {'was' if len(rs) == 1 else 'were'} {text}" for text, rs in where.items()]
    finding.message = (f"the run was stopped from outside by {cause} during start-up, after {after:.1f}s, before "
                       f"any collective completed: {'; '.join(parts)}")
    finding.ranks = list(ranks)
    for key in ("file", "line"):
        finding.detail.pop(key, None)
    finding.detail["odd_ranks"] = []
    finding.detail["phase"] = "start-up"
    finding.detail["stopped_by"] = cause
    return finding
