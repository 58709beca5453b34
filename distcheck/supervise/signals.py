"""SIGTERM, SIGINT and SIGHUP to a launcher: end the run in bounded time, and still write the report.

    timeout 600 python -m distcheck run --nproc 2 -- train.py    # a CI limit, scancel, Ctrl-C: a report, not exit 143

The first signal interrupts the watch loop: every live rank's stack is dumped (as for a hang), the ranks are
ended, and the report says the run was stopped from outside and by which signal (a ``hang`` finding: it holds
every rank's stack and last collective), exit code 1. A second signal stops at once: the ranks are killed, what
was already written stays, and the command exits 1 without building the report.
"""
from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("distcheck")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopNow(BaseException):
    """A second stop signal: end now, keep what is written (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it)."""

    def __init__(self, signame: str) -> None:
        super().__init__(f"stopped at once by a second {signame}")
        self.signame = signame


class Interrupt:
    """Set from outside (a signal handler); the watch loop polls it. ``cause``: e.g. "SIGTERM"."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.cause: str | None = None

    def set(self, cause: str) -> None:
        self.cause = cause
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


class StopSignals:
    """``with StopSignals() as interrupt:`` installs the handlers (main thread only) and restores the old ones."""

    def __init__(self) -> None:
        self.interrupt = Interrupt()
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.interrupt.is_set():
            log.warning("distcheck: %s received: dumping every rank's stack and writing the report "
                        "(send it again to stop at once)", name)
            self.interrupt.set(name)
            return
        raise StopNow(name)

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self.interrupt

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
