"""Errors that end a command with a one-line message instead of a traceback."""
from __future__ import annotations


class UsageError(Exception):
    """Bad invocation or bad input: the CLI prints the message on one line and exits 2.

    The message names the problem and the fix, e.g.
    ``--model mypkg.model:build: no module named 'mypkg' (check PYTHONPATH or pass path/to/file.py:build)``.
    """


class ChannelTimeout(Exception):
    """A side-channel exchange did not complete: some ranks never published their part."""

    def __init__(self, tag: str, missing_ranks: list[int], seconds: float):
        self.tag = tag
        self.missing_ranks = missing_ranks
        self.seconds = seconds
        ranks = ",".join(map(str, missing_ranks))
        super().__init__(f"ranks {ranks} did not reach '{tag}' within {seconds:g}s")


class StopNow(BaseException):
    """A second stop signal: end now, keep what is written (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it). Raised by the launcher's handlers (supervise/signals.py); here so
    that the CLI catches it without importing supervisor code into a rank."""

    def __init__(self, signame: str) -> None:
        super().__init__(f"stopped at once by a second {signame}")
        self.signame = signame
