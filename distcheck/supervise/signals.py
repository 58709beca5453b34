"""SIGTERM, SIGINT and SIGHUP to a launcher: end the run in bounded time, and still write the report.

    timeout 600 python -m distcheck run --nproc 2 -- train.py    # a CI limit, scancel, Ctrl-C: a report, not exit 143

The handlers are the first thing ``python -m distcheck run/compare`` installs (``install_early``, from
``distcheck/__main__.py``, before anything heavy is imported), and they stay until the process exits, so there is
no moment at which a stop signal kills the launcher without a report. The handler only records the signal
(``Interrupt``); what it means depends on when it came, by one rule:

* while some rank still runs, or before every rank has started: the run is stopped. The watch loop dumps every
  rank's stack (as for a hang), the ranks are ended, and the report holds a ``hang`` finding saying the run was
  stopped from outside and by which signal (``detail.stopped_by``): verdict FAILED, exit code 1. Before any
  collective completed, that is a stop "during start-up" (``detail.phase``): where ranks were importing modules,
  no line of the script is named, since nothing there was at fault.
* after every rank has finished (while the report is built or written): the signal stops nothing. The verdict is
  the run's own, and report.json's ``warnings`` holds a ``stop_signal`` entry saying when the signal came
  (:func:`settle`).

A signal to the whole process group (Ctrl-C in a terminal) reaches the ranks too, which end by it: the report shows
where each was, and the ``stop_signal`` warning says the signal reached them. A second signal stops at once: the ranks are killed, what was already written stays, and the command exits 1
without building the report.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Sequence

from distcheck.errors import StopNow
from distcheck.options import is_launcher

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_NAMES = tuple(s.name for s in STOP_SIGNALS)
STOP_NOTE = "stop_signal"  # the warnings kind of a signal that stopped nothing


class Interrupt:
    """Set from outside (a signal handler); the watch loop polls it. ``cause``: e.g. "SIGTERM"; ``after``: seconds
    from the handlers' installation (the start of the process, when installed early) to the signal."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.cause: str | None = None
        self.installed = time.monotonic()
        self.at: float | None = None  # monotonic time of the first signal

    def set(self, cause: str) -> None:
        self.cause = cause
        self.at = time.monotonic()
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    @property
    def after(self) -> float:
        return (self.at if self.at is not None else time.monotonic()) - self.installed


def _say(text: str) -> None:
    """To stderr from a signal handler: a raw write, never through a buffered stream the interrupted code may be in
    the middle of writing (a reentrant write raises)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


class StopSignals:
    """``with StopSignals() as interrupt:`` installs the handlers (main thread only) and restores the old ones.

    Where ``install_early`` already installed them for the whole process, it hands out that interrupt and leaves the
    handlers in place on exit: a signal while the report is printed must not kill the process either."""

    def __init__(self) -> None:
        self.interrupt = Interrupt()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.interrupt.is_set():
            _say(f"distcheck: {name} received: stopping the run and writing the report "
                 "(send it again to stop at once)\n")
            self.interrupt.set(name)
            return
        raise StopNow(name)

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Interrupt:
        if _early is not None:
            return _early.interrupt
        self.install()
        return self.interrupt

    def __exit__(self, *exc: object) -> None:
        self.restore()


_early: StopSignals | None = None


def install_early(argv: Sequence[str]) -> Interrupt | None:
    """The stop-signal handlers of a launcher, for the rest of the process; the first thing ``__main__`` does.
    None (nothing installed) for a rank or a command that launches no ranks."""
    global _early
    if _early is not None:
        return _early.interrupt
    if not is_launcher(argv):
        return None
    handlers = StopSignals()
    if not handlers.install():
        return None
    _early = handlers
    return handlers.interrupt


def early_interrupt() -> Interrupt | None:
    return _early.interrupt if _early is not None else None


def _stopped(report: Any) -> bool:
    return any(f.detail.get("stopped_by") for f in report.findings)


def settle(report: Any, interrupt: Interrupt | None, what: str = "rank") -> bool:
    """The one rule for a signal that stopped nothing: when ``interrupt`` caught a signal but the report holds no
    finding of a stop (every rank had finished, on its own, before distcheck could end it), the verdict stays the
    run's own and a ``stop_signal`` warning says when the signal came; the ranks_completed check loses the
    "stopped from outside" note the launcher gave it. Returns whether the report changed (to be written again)."""
    from distcheck.contract.findings import Note

    if interrupt is None or interrupt.cause is None or _stopped(report):
        return False
    if any(w.kind == STOP_NOTE for w in report.warnings):
        return False
    reached = sorted({r for f in report.findings if f.kind == "rank_failure" and (
        f.detail.get("exception") == "KeyboardInterrupt" or f.detail.get("signal") in STOP_NAMES) for r in f.ranks})
    if reached:
        # Sent to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`): the ranks got it too and ended
        # themselves before distcheck could stop them, so the report shows their own ends. FAILED either way.
        from distcheck.contract.findings import format_ranks

        report.warnings.append(Note(STOP_NOTE, reached, (
            f"{interrupt.cause} arrived {interrupt.after:.1f}s after the start and reached the ranks too (a signal "
            f"to the whole process group, as Ctrl-C in a terminal sends): {format_ranks(reached)} ended by it, so "
            f"the findings show where each was interrupted"), {"signal": interrupt.cause,
                                                                "after": round(interrupt.after, 3)}))
        return True
    report.warnings.append(Note(STOP_NOTE, [], (
        f"{interrupt.cause} arrived {interrupt.after:.1f}s after the start, after every {what} had finished: it "
        f"stopped nothing, so the verdict is the run's own"), {"signal": interrupt.cause,
                                                              "after": round(interrupt.after, 3)}))
    for check in report.checks:
        if check.name == "ranks_completed" and check.note.startswith("stopped from outside"):
            check.note = ""
    return True


def stop_finding(cause: str, after: float, ranks: Sequence[int], where: str, **detail: Any):
    """The ``hang`` finding of a stop during start-up that dumped no rank (none had started its script)."""
    from distcheck.analysis.hang import hang_finding

    finding = hang_finding(list(ranks), f"the run was stopped from outside by {cause} during start-up, after "
                           f"{after:.1f}s: {where}", stopped_by=cause, phase="start-up", **detail)
    return finding
