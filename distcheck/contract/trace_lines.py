"""The JSON half of a rank's collective trace: ``trace-rank<R>.jsonl``. Its one writer (:class:`LineWriter`, which
the tracer, rank/tracer.py, holds) and the framing its one reader (analysis/rank_trace.py) reads it through
(:func:`read_records`); the binary half, one record per collective, is contract/trace_slots.py.

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # ranks write out/trace-rank<R>.{jsonl,bin}

One JSON object per line, each with ``ev``: ``meta`` (first: the format version, rank, pid, host, start time),
``sig`` (one per distinct call: op, group, shapes, dtypes, reduce op, root/peer, the user's site), ``start``/``end``
(collectives written as lines: error ends), ``error`` (the exception a rank's script raised, with its site) and
``exit`` (how the script ended).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from distcheck.contract import files

META, SIG, START, END, ERROR, EXIT = "meta", "sig", "start", "end", "error", "exit"
GRAPH, GRAPH_RUN = "graph", "graph_run"


class LineWriter:
    """``trace-rank<R>.jsonl``: what does not repeat (meta, sig, error, exit lines), one O_APPEND write each, so
    lines from several threads never interleave and a killed rank keeps every line it wrote.

    A write the file system refuses (full, quota, I/O error) is dropped and told to ``on_lost`` (the record file's
    header keeps it): a full disk must not break the user's training. Half a line written when the disk filled is
    taken back, so the next line that fits stays readable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        self.on_lost: Callable[[int], None] | None = None
        self._lock = threading.Lock()  # only around a write: rare lines, graph runs, never a collective

    def write(self, record: dict[str, Any]) -> None:
        fd = self.fd
        if fd < 0:
            return
        self.write_line((json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())

    def write_line(self, data: bytes) -> None:
        """One line already encoded (a JSON object and its newline): a per-run line skips json.dumps."""
        fd = self.fd
        if fd < 0:
            return
        with self._lock:
            try:  # under the lock: no other thread appends while a half line is taken back
                files.append_whole(fd, data)
            except OSError as exc:
                self._lost(exc.errno)

    def _lost(self, err: int | None) -> None:
        on_lost = self.on_lost
        if on_lost is not None:
            on_lost(err or 0)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def read_records(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Each line's record, in order; blank lines, a truncated last line (a rank killed mid-write) and anything but a
    JSON object are skipped."""
    for raw in lines:
        raw = raw.strip()
        if not raw:
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec
