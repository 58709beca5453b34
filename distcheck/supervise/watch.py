"""The one watch loop: every supervisor of ranks decides "progressing, done, stuck or hung" here, by one rule.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py     # the launcher's loop
    torchrun --nproc-per-node 2 -m distcheck run -- train.py       # the node watcher's and rank 0's monitor's loop

Used by the launcher (``run``/``compare`` with ``--nproc``), the node watcher and rank 0's report monitor under
torchrun, and the pytest pool (one loop per test). The callers differ only in how they learn which ranks are
still running and which have finished (process handles, pids from hook files, exit lines in the traces, pipe
messages), which they pass in as two callables.

The progress rule: a rank made progress when its trace file grew (it came up, started or completed a
collective, raised, or ended: the tracer writes one line for each) or when its outcome became known. After
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
from pathlib import Path
from typing import Callable, Iterable

from distcheck.contract import files
from distcheck.contract.findings import Finding
from distcheck.supervise.signals import Interrupt

log = logging.getLogger("distcheck")

STOP_GRACE = 2.0  # seconds of idleness before asking whether the ranks can progress at all
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


class Progress:
    """The progress token: each expected rank's trace progress (files.trace_progress; -1 before the trace exists)
    and the finished ranks."""

    def __init__(self, report_dir: str | os.PathLike, ranks: Iterable[int] | None = None) -> None:
        self.report_dir = Path(report_dir)
        self.ranks = sorted(ranks) if ranks is not None else None
        self._up: set[int] = set()  # positions whose trace existed once: those ranks are past their start

    def sizes(self) -> tuple[int, ...]:
        if self.ranks is None:  # whoever has a trace (the node watcher does not know the global ranks)
            sizes = (files.trace_progress(self.report_dir, r) for r in files.rank_files(self.report_dir, "trace"))
            return tuple(s for s in sizes if s >= 0)  # a trace removed since the listing does not count
        if not self.report_dir.is_dir():
            # The report directory was removed or replaced under the run: no trace will appear, so no rank is
            # "still starting" any more and the normal no-progress limit applies.
            self._up.update(range(len(self.ranks)))
        out = []
        for i, r in enumerate(self.ranks):
            out.append(files.trace_progress(self.report_dir, r))
            if out[-1] >= 0:
                self._up.add(i)
        return tuple(out)

    def starting(self, sizes: tuple[int, ...]) -> bool:
        """Some rank has not opened its trace yet (a trace that vanished later does not count: the report
        directory was removed under the run, and the normal limit applies)."""
        return any(s < 0 and i not in self._up for i, s in enumerate(sizes))


class WatchLoop:
    """Watch ranks until all have finished, they stop progressing for ``timeout`` s, or they provably cannot
    progress. ``live()`` returns ``{rank: pid}`` of the ranks still running; ``finished()`` the ranks whose
    outcome is known (it may collect those outcomes as a side effect); ``expected`` is how many ranks finish
    a run (None: the run is over once some rank was seen and none is live)."""

    def __init__(self, report_dir: str | os.PathLike, timeout: float, *, live: Callable[[], dict[int, int]],
                 finished: Callable[[], set[int]], expected: int | None,
                 should_stop: Callable[[set[int]], str | None] | None = None, dump: HangDump | None = None,
                 ranks: Iterable[int] | None = None, startup_timeout: float | None = None,
                 stop_grace: float = STOP_GRACE, failure_grace: float | None = None,
                 failed: Callable[[], bool] | None = None, poll: float = 0.1,
                 cancel: threading.Event | None = None, interrupt: Interrupt | None = None) -> None:
        self.report_dir = str(report_dir)
        self.timeout = timeout
        self.live = live
        self.finished = finished
        self.expected = expected
        self.should_stop = should_stop
        self.dump = dump
        self.progress = Progress(report_dir, range(expected) if ranks is None and expected else ranks)
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

    def _over(self, done: set[int], seen: set[int], running: dict[int, int]) -> bool:
        if self.expected is not None:
            return len(done) >= self.expected
        return bool(seen) and not running

    def run(self) -> WatchResult:
        started = time.monotonic()
        seen: set[int] = set()
        done = set(self.finished())
        token = (self.progress.sizes(), frozenset(done))
        last_progress = last_stop_check = time.monotonic()
        while not self.cancel.wait(self.poll):
            now = time.monotonic()
            done = set(self.finished())
            seen.update(done)  # a rank that finished was running once, even if no poll saw it live
            running = self.live()
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
            return self._hang(time.monotonic() - started, started, cause=self.interrupt.cause)
        return WatchResult(CANCELLED, seconds=time.monotonic() - started)

    def _hang(self, idle: float, started: float, cause: str | None = None) -> WatchResult:
        """Dump every live rank: for a hang (no progress for ``timeout``), or a stop signal (``cause``)."""
        from distcheck.supervise.hang import diagnose_hang

        declared = time.monotonic()
        live = self.live()
        if cause:
            log.warning("stopped from outside by %s: dumping %d running ranks", cause, len(live))
        else:
            log.warning("no progress for %.0fs: declaring the run hung (%d ranks still running)", idle, len(live))
        findings: list[Finding] = []
        if self.dump is not None:
            findings = diagnose_hang(live, self.report_dir, native=self.dump.native, timeout=self.timeout,
                                     world_size=self.dump.world_size, out_dir=self.dump.out_dir,
                                     stopped_by=cause, after=idle if cause else None)
        return WatchResult(INTERRUPTED if cause else HUNG, stop_reason=cause, hang_findings=findings,
                           seconds=time.monotonic() - started, declared_at=declared, diagnosed_at=time.monotonic())
