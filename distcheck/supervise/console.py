"""The console of distcheck's own processes outside the ranks, which must do their work when nobody reads it.

    python -m distcheck.supervise.node_watcher ...   # main() calls survive_lost_console() first
    distcheck run --nproc 2 -- train.py | head       # so does cli.main, outside torchrun (not in a rank)

The node watcher writes the report's text and the "report is on node 0" line to the job's console (its stderr, which is
local rank 0's, which torchrun shows). When that console goes away (the terminal closed, `torchrun ... | head`,
the CI step's log reader or a test harness killed), a write raises BrokenPipeError (or EIO for a hung-up
terminal). Raised in the middle of a hang's report, it ended the watcher before it ended the hung ranks: the job
then hung for good, which is what the watcher is there to prevent. The launcher (``run --nproc``, ``compare``) and
``report``/``stacks`` print the report last: there the error turned a PASSED run's exit code into 1, with a
traceback. So their stdout and stderr drop what cannot be written, say once that the console is gone (on the
other stream if it still works, in the watcher's log file), and never raise. A rank's streams are the user's and
stay as they are.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

log = logging.getLogger("distcheck")


class LostConsoleTolerant:
    """A text stream that drops writes once its console is gone, instead of raising."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream, self._name = stream, name
        self.lost = False

    def _lose(self, exc: OSError) -> None:
        if not self.lost:
            self.lost = True
            log.warning("the console is gone (%s on %s): what distcheck prints to it is dropped; the report files "
                        "are still written", type(exc).__name__, self._name)

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lose(exc)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: as the stream's
        return getattr(self._stream, name)


def survive_lost_console() -> None:
    """Wrap sys.stdout and sys.stderr (once). Call before logging is set up, so a handler on stderr gets the wrap."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, LostConsoleTolerant):
            setattr(sys, name, LostConsoleTolerant(stream, name))
