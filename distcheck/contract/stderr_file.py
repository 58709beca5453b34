"""``stderr-rank<R>.txt``: the bounded copy of a rank's stderr. The one writer (:class:`BoundedCopy`, which the
rank's stderr copier, rank/stderr_tee.py, runs) and the one reader (:func:`tail`, for the failure reports).

    python -m distcheck run --nproc 2 -- train.py     # every rank: stderr-rank<R>.txt next to its trace

The copy keeps the first and the last KEEP bytes (DISTCHECK_STDERR_KEEP, default 2 MiB each), with a line between
them saying how much was cut. While the rank writes, the end of the file grows up to twice KEEP past the cut and is
then moved back to its last KEEP bytes, so the file always ends with the rank's latest output and never holds more
than about 3 x KEEP. Standard library only, nothing of distcheck imported: the copier loads this file by its path.
"""
from __future__ import annotations

import os

TAIL_LINES = 40
KEEP_ENV = "DISTCHECK_STDERR_KEEP"  # contract/env.py's STDERR_KEEP (this file imports nothing of distcheck)
KEEP = 2 * 1024 * 1024


class BoundedCopy:
    """The file part of the copier: the first ``keep`` bytes, then a cut line, then the last ``keep`` to
    ``2 × keep`` bytes (see the module)."""

    def __init__(self, path: str, keep: int = KEEP) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # read back when the end is cut
        self.keep = max(keep, 1024)
        self.base = os.lseek(self.fd, 0, os.SEEK_END)  # appended: what an earlier writer left stays first
        self.pos = self.base
        self.head_end: int | None = None  # where the head stopped (at a line end), once it is full
        self.head_ends_line = True
        self.cut_bytes = self.cut_lines = 0
        self.marker = b""
        self.tail_lines = 0  # newlines in the part after the marker
        self.failed = False  # a full or failing disk: the console still gets everything

    def write(self, data: bytes) -> None:
        if self.failed:
            return
        try:
            self._write(data)
        except OSError:
            self.failed = True

    def _write(self, data: bytes) -> None:
        if self.head_end is None:
            room = self.base + self.keep - self.pos
            if len(data) <= room:
                self._append(data)
                return
            newline = data.rfind(b"\n", 0, room)
            if newline < 0:  # the head is full mid-line: it ends with that line
                newline = data.find(b"\n")
            split = newline + 1 if newline >= 0 else len(data)
            self._append(data[:split])
            self.head_end = self.pos
            self.head_ends_line = data[split - 1:split] == b"\n"
            data = data[split:]
        self._append(data)
        self.tail_lines += data.count(b"\n")
        if self.pos - self.head_end - len(self.marker) > 2 * self.keep:
            self._compact()

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, self.pos)
            self.pos += written
            view = view[written:]

    def _compact(self) -> None:
        """Keep the last ``keep`` bytes after the cut, from a line start; the marker counts what was dropped."""
        start = self.head_end + len(self.marker)
        size = self.pos - start
        kept = os.pread(self.fd, self.keep, self.pos - self.keep)
        newline = kept.find(b"\n")
        if 0 <= newline < len(kept) - 1:
            kept = kept[newline + 1:]
        kept_lines = kept.count(b"\n")
        self.cut_bytes += size - len(kept)
        self.cut_lines += self.tail_lines - kept_lines
        self.tail_lines = kept_lines
        self.marker = (("" if self.head_ends_line else "\n")
                       + f"[distcheck] {self.cut_lines:,} lines ({self.cut_bytes:,} bytes) of this rank's stderr cut "
                       f"here: the copy keeps the first and the last {self.keep:,} bytes ({KEEP_ENV})\n").encode()
        self.pos = self.head_end
        self._append(self.marker + kept)
        os.ftruncate(self.fd, self.pos)

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def tail(path: str | os.PathLike, lines: int = TAIL_LINES, since: int = 0) -> list[str]:
    """The last ``lines`` lines of a stderr copy, read from byte offset ``since`` (bounded: the last 256 KiB). A
    copy shorter than ``since`` was cut since (see the module): its end is read."""
    from collections import deque

    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since if since <= size else 0, size - 256 * 1024)
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return list(deque((line for line in text.splitlines() if line.strip()), maxlen=lines))
