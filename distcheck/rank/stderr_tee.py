"""Keep a copy of this rank's stderr in the report directory, so a failure report can quote its last lines.

    python -m distcheck run --nproc 2 -- train.py     # every rank: stderr-rank<R>.txt next to its trace

The copy is taken at the file-descriptor level, so it holds what torch's C++ side prints too ("terminate called
without an active exception", NCCL and gloo errors), not only Python's. A ``tee`` process reads a pipe that
replaces fd 2 and writes both to the original stderr (the console, or the launcher's log) and to the file: a
separate process, so what the rank wrote just before it was killed or aborted is still drained into the file.
Where ``tee`` cannot be started the rank keeps its plain stderr and reports simply carry no stderr tail.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections import deque
from pathlib import Path

from distcheck.contract import files

TAIL_LINES = 40

_tee: subprocess.Popen | None = None


def tee_stderr(report_dir: str | os.PathLike, rank: int) -> Path | None:
    """Copy fd 2 of this process into ``stderr-rank<R>.txt`` (appended) from now on; returns the path."""
    global _tee
    if _tee is not None:
        return None
    tee = shutil.which("tee")
    if tee is None:
        return None
    path = files.rank_file(report_dir, "stderr", rank)
    try:
        import sys

        sys.stderr.flush()
        console = os.dup(2)
        try:
            # Its own session: a Ctrl-C or a group kill aimed at the rank must not end the copy before it drains.
            _tee = subprocess.Popen([tee, "-a", str(path)], stdin=subprocess.PIPE, stdout=console,
                                    stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        finally:
            os.close(console)
    except OSError:
        return None
    os.dup2(_tee.stdin.fileno(), 2)
    _tee.stdin.close()  # fd 2 is now the only write end: tee ends when this process (and its children) end
    return path


def tail(path: str | os.PathLike, lines: int = TAIL_LINES, since: int = 0) -> list[str]:
    """The last ``lines`` lines of a stderr copy, read from byte offset ``since`` (bounded: the last 256 KiB)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since, size - 256 * 1024)
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return list(deque((line for line in text.splitlines() if line.strip()), maxlen=lines))
