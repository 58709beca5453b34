"""Reading a rank's trace files for the analysis: its lines whole or as appended since, its records by slot.

    from distcheck.contract import trace_reader
    text = trace_reader.read_lines("report/trace-rank0.jsonl")          # None: no such file
    with trace_reader.RecordFile("report/trace-rank0.bin") as records:  # OSError as open raises it
        head = records.read(0, 1)                                       # the header slot

    python -m pytest -q tests/unit/test_scale_traces.py tests/unit/test_trace_align.py tests/unit/test_full_disk.py

A rank writes ``trace-rank<R>.jsonl`` (contract/trace_lines.py) and ``trace-rank<R>.bin`` (contract/trace_slots.py)
while it runs; analysis/trace_events.py parses them whole and analysis/trace_summary.py follows them, reading only
what was appended since its last read. Both read through here, so analysis/ itself opens no file
(tests/unit/test_layout.py). These functions return bytes and text as they are on disk: what they mean is the
analysis's (analysis/rank_trace.py).
"""
from __future__ import annotations

import os
from pathlib import Path

from distcheck.contract import trace_slots


def read_lines(path: str | os.PathLike) -> str | None:
    """A trace's JSON lines file whole (undecodable bytes replaced: a line cut mid-character stays readable);
    None when it does not exist."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None


class Replaced(Exception):
    """The file is not the one read before (another inode, or shorter than what was read of it): a new run in a
    reused report directory."""


def read_appended(path: str | os.PathLike, pos: int,
                  identity: tuple[int, int] | None) -> tuple[bytes, tuple[int, int]] | None:
    """The bytes of ``path`` from offset ``pos`` on, and the file's identity (device, inode) to pass next time;
    None when there is no such file. Raises Replaced when ``identity`` names another file or the file is shorter
    than ``pos``."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            now = (st.st_dev, st.st_ino)
            if identity is not None and (now != identity or st.st_size < pos):
                raise Replaced()
            fh.seek(pos)
            return fh.read(), now
    except FileNotFoundError:
        return None


class RecordFile:
    """A rank's record file opened for reading by slot (slot 0 is the header); a context manager. Opening raises
    OSError as ``open`` does."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._fh = open(path, "rb")

    def read(self, first: int, count: int | None = None) -> bytes:
        """The bytes of ``count`` slots from slot ``first`` (None: to the end of the file); short at its end."""
        self._fh.seek(first * trace_slots.SIZE)
        return self._fh.read(-1 if count is None else count * trace_slots.SIZE)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_slots(path: str | os.PathLike, first: int, count: int | None = None) -> bytes:
    """``count`` slots of a record file from slot ``first`` (None: to its end); raises OSError."""
    with RecordFile(path) as records:
        return records.read(first, count)


def directory_key(report_dir: str | os.PathLike) -> str:
    """One name for a report directory however it is spelled (symlinks resolved): the key of what is kept per
    directory between reads of it."""
    return os.path.realpath(report_dir)
