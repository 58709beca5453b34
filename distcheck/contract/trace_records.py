"""The binary half of a rank's collective trace: ``trace-rank<R>.bin``, fixed-size event records.

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # ranks write out/trace-rank<R>.{jsonl,bin}

Why binary: the tracer runs on every collective, and on GPUs a small collective costs a few µs of CPU. A JSON line
and a ``write`` system call per event cost ~6 µs; a 32-byte ``struct.pack_into`` into a shared memory map costs
~0.2 µs. The map is ``MAP_SHARED`` on the file, so every store is already in the page cache: a SIGKILLed rank
keeps every event it recorded, as with the O_APPEND lines before.

What does not repeat goes to ``trace-rank<R>.jsonl`` as JSON lines: the meta line, one ``sig`` line per distinct
call (op, group, shapes, dtypes, reduce op, root/peer, the user's site), errors and the exit line. An event
record names its sig by number. Layout (little-endian, 32 bytes; slot 0 is the header):

    kind:u8  pad:3  sig:u32  id:u64  seq:u64  t:f64        kind 1 start, 2 end (completed), 3 end (issued only)

The file is grown a segment at a time and its unused tail is zeros (kind 0), which readers skip; a clean exit
truncates it to what was written.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator

RECORD = struct.Struct("<B3xIQQd")
SIZE = RECORD.size  # 32
MAGIC = b"DCTRACE\0"
HEADER = struct.Struct("<8sI20x")  # magic, format; one record slot
START, END, ISSUED = 1, 2, 3
SEGMENT_RECORDS = 1 << 17  # 4 MiB of records per growth step


def header(format_version: int) -> bytes:
    return HEADER.pack(MAGIC, format_version)


def read_header(data: bytes) -> int | None:
    """The format version in a trace's header, or None when the file is too short or not a distcheck trace."""
    if len(data) < SIZE:
        return None
    magic, version = HEADER.unpack_from(data, 0)
    return version if magic == MAGIC else None


def iter_records(data: bytes) -> Iterator[tuple[int, int, int, int, float]]:
    """(kind, sig, id, seq, t) of every written record after the header; unwritten (zero) slots are skipped."""
    end = len(data.rstrip(b"\0"))
    end = -(-end // SIZE) * SIZE  # a record whose last bytes happen to be zero is still whole
    if end <= SIZE:
        return
    for record in RECORD.iter_unpack(memoryview(data)[SIZE:end]):
        if record[0]:
            yield record


def written(path: str | os.PathLike) -> int:
    """How many record slots are in use: a cheap progress counter for the watch loop (a few 1-byte reads, not the
    whole file). Slots fill in order, so the first zero slot is found by bisection; a slot another thread has
    claimed but not yet written can make this a few short, which only delays progress by a poll. -1: no file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return -1
    try:
        slots = os.fstat(fd).st_size // SIZE
        lo, hi = 1, slots  # the first zero slot is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if os.pread(fd, 1, mid * SIZE) not in (b"", b"\0"):
                lo = mid + 1
            else:
                hi = mid
        return lo - 1
    finally:
        os.close(fd)


def truncate_unused(path: str | os.PathLike) -> None:
    """Cut the zero tail a killed rank leaves (the file grows a segment at a time). Reads the whole file once:
    unlike :func:`written`, this must not stop at a slot a thread claimed and never wrote."""
    path = Path(path)
    try:
        data = path.read_bytes()
        used = max(SIZE, -(-len(data.rstrip(b"\0")) // SIZE) * SIZE)
        if len(data) > used:
            os.truncate(path, used)
    except OSError:
        pass
