"""The binary half of a rank's collective trace: ``trace-rank<R>.bin``, one fixed-size slot per collective.

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # ranks write out/trace-rank<R>.{jsonl,bin}

Why binary: the tracer runs on every collective, and on GPUs a small collective costs a few µs of CPU. A JSON line
and a ``write`` system call per event cost ~6 µs; storing a slot into a shared memory map costs ~0.1 µs. The map
is ``MAP_SHARED`` on the file, so every store is already in the page cache: a SIGKILLed rank keeps every slot it
stored. (Slots, not records: in distcheck a record is a value ``distcheck.record`` keeps for ``compare``.)

What does not repeat goes to ``trace-rank<R>.jsonl`` as JSON lines: the meta line, one ``sig`` line per distinct
call (op, group, shapes, dtypes, reduce op, root/peer, the user's site), errors and the exit line. A slot names
its sig by number. Layout (little-endian, 24 bytes; slot 0 is the header; a collective's id is its slot number):

    kind:u8  flags:u8  pad:2  sig:u32  t:f64  t_end:f64

``kind`` is 1 once the collective started (``t``); ``t_end`` stays 0 until it completed, and is then stored in place
(one 8-byte store, from whichever thread saw the completion): a second slot per collective cost another ~0.1 µs.
``flags`` bit 0 (ISSUED): the end is when the op was issued, not when it completed (functional collectives, whose
completion only ``wait_tensor`` sees). A collective's position in its group's sequence is not stored: readers count
it, in slot order, from the sigs (analysis/trace_events.py), which saves the hot path a counter. The file is grown a
segment at a time and its unused tail is zeros (kind 0), which readers skip; a clean exit truncates it to what was
written.

Every segment's blocks are allocated (``posix_fallocate``) before the map covers them: a store into a page of a
sparse file whose file system is full is a SIGBUS that kills the rank, while a failed allocation is an ``OSError``
the tracer can take. When the file system refuses more blocks, recording stops there for good, so the trace stays
a clean prefix, and the header slot (allocated with the first segment) keeps what the rank could not write
elsewhere, stored in place:

    magic:8s  format:u32  cut:u32  unrecorded:u32  errno:u8  lost:u8  exit:u8  code:u8

``cut``: the first collective (slot) not recorded, 0 while the trace is whole; ``unrecorded``: collectives issued
since (the watch loop's progress once records stop growing); ``errno``: the first write error; ``lost``: which other
per-rank files lost writes (LOST_* bits); ``exit``/``code``: how the script ended (EXIT_*), stored with the exit line,
which may itself be lost on a full disk. Zeros in all of these (older files too) mean "nothing lost, not exited yet".
"""
from __future__ import annotations

import errno
import os
import struct
from typing import Iterator, NamedTuple

SIZE = 24
# What the tracer stores when a collective starts: the first 8 bytes as one integer (see start_word) and t.
START_SLOT = struct.Struct("<Qd")
START_TIME_OFFSET = 8  # t, after the start word (rank/_tracefast.c stores both itself)
END_TIME = struct.Struct("<d")  # t_end, at END_OFFSET in the slot
END_OFFSET = START_SLOT.size
FLAGS_OFFSET = 1
FLAG = struct.Struct("<B")
SLOT = struct.Struct("<BB2xIdd")  # a whole slot, for readers
assert SLOT.size == SIZE
MAGIC = b"DCTRACE\0"
HEADER = struct.Struct("<8sIIIBBBB")  # magic, format, then the state below; one record slot
assert HEADER.size == SIZE
STATE = struct.Struct("<IIBBBB")  # cut, unrecorded, errno, lost, exit, code: at STATE_OFFSET
STATE_OFFSET = 12
CUT = struct.Struct("<I")
CUT_OFFSET = 12
UNRECORDED = struct.Struct("<I")  # the counter a stopped tracer bumps per collective (rank/_tracefast.c too)
UNRECORDED_OFFSET = 16  # its end, SIZE - 4, is as far as the watch loop reads the header
BYTE = struct.Struct("<B")
ERRNO_OFFSET, LOST_OFFSET = 20, 21
EXIT = struct.Struct("<BB")  # exit, code
EXIT_OFFSET = 22
START = 1
ISSUED = 1  # flags bit
SEGMENT_SLOTS = 1 << 17  # 3 MiB of records per growth step
# The least the tracer tries to allocate when a full file system refuses a whole segment: one page of records.
MIN_SEGMENT_SLOTS = 4096 // SIZE
# How far past the first unused slot _records_end looks for slots written after one claimed and never written:
# further than the threads of one rank ever record at once.
TAIL_WINDOW = 4096
# Which other per-rank files lost writes (the header's ``lost`` bits), and how a report names them.
LOST_LINES, LOST_RECORDS, LOST_FINDINGS, LOST_AUTOCHECK = 1, 2, 4, 8
LOST_NAMES = {LOST_LINES: "trace lines (call descriptions, errors, the exit line)",
              LOST_RECORDS: "records (distcheck.record)", LOST_FINDINGS: "findings of API calls",
              LOST_AUTOCHECK: "automatic-check state"}
EXIT_RETURNED, EXIT_FAILED = 1, 2  # the header's ``exit``: the script returned / raised (or exited non-zero)


def start_word(sig: int, flags: int = 0) -> int:
    """kind, flags and sig of a started collective as the little-endian u64 that START_SLOT stores first."""
    return START | flags << 8 | sig << 32


class Slot(NamedTuple):
    id: int  # the slot number
    sig: int
    t: float
    t_end: float | None  # None: not completed (or not yet when the file was read)
    issued: bool  # t_end is when the op was issued, not when it completed


def slot_dtype():
    """The record layout as a numpy structured dtype, for readers of whole files (analysis/trace_events.py) and
    writers of synthetic ones (bench/bench_scale.py). numpy is imported here only, never on the tracer's path."""
    import numpy as np

    dtype = np.dtype([("kind", "u1"), ("flags", "u1"), ("pad", "V2"), ("sig", "<u4"), ("t", "<f8"),
                      ("t_end", "<f8")])
    assert dtype.itemsize == SIZE
    return dtype


def header(format_version: int) -> bytes:
    return HEADER.pack(MAGIC, format_version, 0, 0, 0, 0, 0, 0)


def read_header(data: bytes) -> int | None:
    """The format version in a trace's header, or None when the file is too short or not a distcheck trace."""
    if len(data) < SIZE:
        return None
    magic, version = HEADER.unpack_from(data, 0)[:2]
    return version if magic == MAGIC else None


class HeaderState(NamedTuple):
    """What the header slot says beyond the format (see the module's docstring)."""

    cut: int  # the first collective (slot) not recorded; 0: the trace is whole
    unrecorded: int  # collectives issued after the cut
    errno: int  # the first write error (0: none)
    lost: int  # LOST_* bits
    exit: int  # 0, EXIT_RETURNED or EXIT_FAILED
    code: int  # the exit code, modulo 256

    @property
    def lost_names(self) -> list[str]:
        return [name for bit, name in LOST_NAMES.items() if self.lost & bit]


def read_state(data: bytes) -> HeaderState | None:
    """The header's state, or None when ``data`` has no distcheck header."""
    if read_header(data) is None:
        return None
    return HeaderState(*STATE.unpack_from(data, STATE_OFFSET))


def write_failure(errno_value: int | None) -> str:
    """Why a rank's file could not be written, for a report: ``the report directory's file system was full``."""
    if errno_value in (errno.ENOSPC, None, 0):
        return "the report directory's file system was full" if errno_value else \
            "the report directory's file system refused the write"
    if errno_value == errno.EDQUOT:
        return "the report directory's disk quota was exceeded"
    if errno_value == errno.EIO:
        return "the report directory's file system failed (I/O error)"
    return f"writing into the report directory failed ({os.strerror(errno_value)})"


def iter_slots(data: bytes) -> Iterator[Slot]:
    """Every started collective's record after the header; unwritten (zero) slots are skipped."""
    end = len(data.rstrip(b"\0"))
    end = -(-end // SIZE) * SIZE  # a record whose last bytes happen to be zero is still whole
    if end <= SIZE:
        return
    for slot, (kind, flags, sig, t, t_end) in enumerate(SLOT.iter_unpack(memoryview(data)[SIZE:end]), 1):
        if kind:
            yield Slot(slot, sig, t, t_end or None, bool(flags & ISSUED))


def written(path: str | os.PathLike) -> int:
    """How many record slots are in use (a few 1-byte reads, not the whole file). Slots fill in order, so the first
    zero slot is found by bisection; a slot another thread has claimed but not yet written can make this a few
    short. -1: no file."""
    return _scan(path)[0]


def progress(path: str | os.PathLike, hint: dict[str, int] | None = None) -> int:
    """A counter that grows whenever a collective starts or the latest one completes: the watch loop's progress
    token (a rank that finished a long collective and now computes has progressed). Once a full file system stopped
    the records, the header's count of unrecorded collectives keeps it growing. -1: no file.

    ``hint``: the caller's memo for this file, kept between calls (the watch loop polls every rank ten times a
    second): the search for the first unused slot starts where the last one found it, so a poll costs a read or
    two per rank when nothing was appended, and a few more per doubling of what was."""
    used, last_ended, unrecorded = _scan(path, hint.get("used", 0) if hint is not None else 0)
    if hint is not None:
        hint["used"] = max(used, 0)
    return -1 if used < 0 else 2 * used + last_ended + unrecorded


def _used(fd: int, slot: int) -> bool:
    return os.pread(fd, 1, slot * SIZE) not in (b"", b"\0")


def _scan(path: str | os.PathLike, known: int = 0) -> tuple[int, int, int]:
    """(slots in use, 1 when the last one's t_end is set, collectives issued after records stopped). ``known``:
    slots in use at an earlier scan (0: none known); taken only when its last slot is still in use (a file
    rewritten since starts over)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return -1, 0, 0
    try:
        return _scan_fd(fd, os.fstat(fd).st_size, known)
    finally:
        os.close(fd)


def _scan_fd(fd: int, size: int, known: int = 0) -> tuple[int, int, int]:
    """:func:`_scan` of an open file of ``size`` bytes."""
    head = os.pread(fd, UNRECORDED_OFFSET + UNRECORDED.size, 0)
    unrecorded = UNRECORDED.unpack_from(head, UNRECORDED_OFFSET)[0] if len(head) == SIZE - 4 else 0
    slots = size // SIZE
    lo, hi = 1, slots  # the first zero slot is in [lo, hi]
    if 0 < known < slots and _used(fd, known):
        # Slots 1..known are in use (they fill in order): gallop from there, known+1, known+2, known+4, ...
        # to a zero slot, so the search costs the log of what was appended since, not of the file.
        lo, step, probe = known + 1, 1, known + 1
        while probe < slots and _used(fd, probe):
            lo = probe + 1
            step *= 2
            probe = known + step
        hi = min(probe, slots)
    while lo < hi:
        mid = (lo + hi) // 2
        if os.pread(fd, 1, mid * SIZE) not in (b"", b"\0"):
            lo = mid + 1
        else:
            hi = mid
    used = lo - 1
    ended = used > 0 and os.pread(fd, END_TIME.size, used * SIZE + END_OFFSET).strip(b"\0") != b""
    return used, int(ended), unrecorded


def _records_end(fd: int, size: int) -> int:
    """How many bytes of the open record file hold its header and records: up to its last written slot, what
    stripping the whole file's zero tail would keep. Slots fill in order, so the first unused one is found by
    bisection, as :func:`written` finds it; but a thread can claim a slot and be killed before writing it while
    later slots were written, so the search reads on from there a window at a time (TAIL_WINDOW slots) until a
    whole window is zeros. A few reads instead of the whole segment (3 MiB)."""
    end = _scan_fd(fd, size)[0] + 1  # the first zero slot (slot 0 is the header)
    while end * SIZE < size:
        window = os.pread(fd, TAIL_WINDOW * SIZE, end * SIZE)
        written_to = len(window.rstrip(b"\0"))
        if not written_to:
            break
        end += -(-written_to // SIZE)  # a record whose last bytes happen to be zero is still whole
    return max(SIZE, min(end * SIZE, size))


def read_records(path: str | os.PathLike) -> bytes:
    """The record file's header and records, without the zero tail of its segment (OSError as for any read): what
    the analysis reads of each rank, in a few reads where reading the whole file cost 5 ms per rank and read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        end = _records_end(fd, size) if size >= SIZE else size
        parts, offset = [], 0
        while offset < end:
            chunk = os.pread(fd, end - offset, offset)
            if not chunk:
                break
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def truncate_unused(path: str | os.PathLike) -> None:
    """Cut the zero tail a rank leaves (the file grows a segment at a time, and a rank ends without closing it), as
    :func:`_records_end` finds it: 25 ms of the launcher's CPU per rank when the whole file was read and stripped."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if size > SIZE:
            used = _records_end(fd, size)
            if size > used:
                os.ftruncate(fd, used)
    except OSError:
        pass
    finally:
        os.close(fd)
