"""The trace log: ``trace-rank<R>.bin``, one fixed-size record per collective in a shared memory map (the writer).

    python -m distcheck run --nproc 2 -- train.py      # every rank's tracer (rank/tracer.py) writes one
    python -m pytest -q tests/unit/test_full_disk.py   # what it does when the report file system fills up

The record layout is contract/trace_slots.py's; the tracer's hot path (rank/tracer.py, rank/_tracefast.c) stores
into ``TraceLog.mm`` itself, with no call of this module, so nothing here is on the per-collective path but the
rare ``grow``. This module owns what keeps that map safe: every page it maps is allocated first (a full disk is an
OSError here, never a SIGBUS in the hot path's store), the space it leaves to the rest of the report, and how
recording stops for good, said once and kept in the header.
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any, Callable

from distcheck.contract import files
from distcheck.contract import trace_slots

log = logging.getLogger("distcheck")

# What the trace leaves free of its file system (TraceLog._allocate): a tenth of it, at most 64 MiB.
RESERVE_FRACTION = 0.1
RESERVE_MAX = 64 << 20


class NotRecorded(Exception):
    """Recording stopped (the file system refused more blocks): the wrapper calls the op untraced."""


class TraceLog:
    """``trace-rank<R>.bin``: one fixed-size record per collective, stored into a shared memory map (the hot path
    stores into ``mm`` itself; these methods are for the rest).

    The map never covers a page the file system has not allocated: every segment is ``posix_fallocate``d first, so
    a full disk is an ``OSError`` here, never a SIGBUS on the hot path's store. When no more blocks can be had (down
    to one page), recording stops for good: the header says from which collective on (``cut``) and why, the C path
    is told to skip recording (``stop``), and collectives issued from then on only bump the header's ``unrecorded``
    counter, which keeps the watch loop's progress moving (contract/trace_slots.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        # The next free slot; atomic under the GIL, so threads never share one. The C path swaps in its own
        # counter (attach), which both paths then claim from.
        self.claim: Callable[[], int] = itertools.count(1).__next__
        self._lock = threading.Lock()
        self._closed = False
        self.stopped = False  # the file system refused more blocks: nothing is recorded any more
        self._stop_fast: Callable[[], None] | None = None  # the C path's Log.stop
        self.cap = self._allocate(0, trace_slots.SEGMENT_SLOTS * trace_slots.SIZE)  # bytes allocated and mapped
        if self.cap:
            self.mm = mmap.mmap(self._fd, self.cap)
        else:  # not even a page: the hot path still needs a map; nothing of it reaches the file
            self.mm = mmap.mmap(-1, trace_slots.SIZE)
        self.mm[:trace_slots.SIZE] = trace_slots.header(files.FORMAT)
        if not self.cap:
            self._stop(1, self._error)

    def attach(self, fast: Any) -> None:
        """Share the slot counter with the C path's Log and let it know when recording stops."""
        self.claim = fast.claim
        self._stop_fast = fast.stop
        if self.stopped:
            fast.stop()

    def _allocate(self, offset: int, want: int) -> int:
        """Allocate up to ``want`` bytes of the file from ``offset``: a whole segment, else the most a nearly full
        file system still gives (halving down to one page of records). The bytes allocated; 0 with ``_error``.

        The trace never takes the file system's last bytes: it leaves RESERVE_FRACTION of it (at most
        RESERVE_MAX) to everything else (the other ranks' start-up files, the automatic-check state, stack dumps,
        the report itself), and takes at most half of what is left above that at a time, so ranks share it."""
        least = trace_slots.MIN_SEGMENT_SLOTS * trace_slots.SIZE
        self._error: OSError | None = None
        room = want  # unknown (no statvfs, or a file system that reports no size): fallocate's answer decides
        try:
            fs = os.fstatvfs(self._fd)
            if fs.f_blocks:
                room = fs.f_bavail * fs.f_frsize - min(RESERVE_MAX,
                                                       int(fs.f_blocks * fs.f_frsize * RESERVE_FRACTION))
        except OSError:
            pass
        if room < least:
            self._error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return 0
        size = want if room >= 2 * want else max(least, room // 2 // trace_slots.SIZE * trace_slots.SIZE)
        while True:
            try:
                _fallocate(self._fd, offset, size)
                return size
            except OSError as exc:
                self._error = exc
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or size <= least:
                    return 0
                size = max(least, size // 2 // trace_slots.SIZE * trace_slots.SIZE)

    def grow(self, offset: int) -> None:
        """Make room for a record at ``offset`` (the map is grown a segment at a time, so this is rare); raise
        NotRecorded when recording has stopped (then the collective is only counted)."""
        with self._lock:
            while offset + trace_slots.SIZE > self.cap and not self._closed and not self.stopped:
                got = self._allocate(self.cap, trace_slots.SEGMENT_SLOTS * trace_slots.SIZE)
                if got:
                    try:
                        self.mm.resize(self.cap + got)
                    except (OSError, ValueError, BufferError, SystemError) as exc:
                        self._error = exc if isinstance(exc, OSError) else None
                        got = 0
                if not got:
                    self._stop(offset // trace_slots.SIZE, self._error)
                    break
                self.cap += got
            if offset + trace_slots.SIZE > self.cap:
                if self.stopped:
                    self._count_unrecorded()
                raise NotRecorded()

    def _stop(self, slot: int, exc: BaseException | None) -> None:
        """Recording stops at ``slot`` (under the lock, or before anyone else has the log): said once, kept in
        the header."""
        self.stopped = True
        if self._stop_fast is not None:
            self._stop_fast()
        err = getattr(exc, "errno", None) or 0
        try:
            trace_slots.CUT.pack_into(self.mm, trace_slots.CUT_OFFSET, slot)
            if not self.mm[trace_slots.ERRNO_OFFSET]:
                trace_slots.BYTE.pack_into(self.mm, trace_slots.ERRNO_OFFSET, err & 0xFF)
        except (ValueError, struct.error):
            pass
        log.warning("%s (%s): collectives from #%d on are not recorded; the script goes on untraced",
                    trace_slots.write_failure(err), getattr(exc, "strerror", None) or exc or "no space", slot)

    def _count_unrecorded(self) -> None:
        try:
            n = trace_slots.UNRECORDED.unpack_from(self.mm, trace_slots.UNRECORDED_OFFSET)[0]
            trace_slots.UNRECORDED.pack_into(self.mm, trace_slots.UNRECORDED_OFFSET, (n + 1) & 0xFFFFFFFF)
        except (ValueError, struct.error):
            pass

    def lost(self, bit: int, err: int) -> None:
        """Another per-rank file lost a write (trace_slots.LOST_* ``bit``): kept in the header for the report."""
        try:
            if not self.mm[trace_slots.LOST_OFFSET] & bit:
                trace_slots.BYTE.pack_into(self.mm, trace_slots.LOST_OFFSET, self.mm[trace_slots.LOST_OFFSET] | bit)
            if not self.mm[trace_slots.ERRNO_OFFSET]:
                trace_slots.BYTE.pack_into(self.mm, trace_slots.ERRNO_OFFSET, err & 0xFF)
        except (ValueError, struct.error):
            pass

    def exited(self, ok: bool, code: int) -> None:
        """How the script ended, also where a full disk cannot lose it (the exit line may be lost)."""
        try:
            trace_slots.EXIT.pack_into(self.mm, trace_slots.EXIT_OFFSET,
                                   trace_slots.EXIT_RETURNED if ok else trace_slots.EXIT_FAILED, int(code) & 0xFF)
        except (ValueError, struct.error, TypeError):
            pass

    def end(self, eid: int, t: float, issued: bool = False) -> None:
        """Mark collective ``eid`` (its slot) completed at ``t``, or only issued then."""
        offset = eid * trace_slots.SIZE
        try:
            if issued:  # before the time: a reader takes the flag only once the time is there
                trace_slots.FLAG.pack_into(self.mm, offset + trace_slots.FLAGS_OFFSET, trace_slots.ISSUED)
            trace_slots.END_TIME.pack_into(self.mm, offset + trace_slots.END_OFFSET, t)
        except (ValueError, OSError, struct.error):  # closed under a late completion: tracing must not break training
            pass

    def close(self) -> None:
        """Unmap and cut the unused tail, so the file holds exactly what was recorded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            used = self.claim() * trace_slots.SIZE
            try:
                self.mm.close()
            except BufferError:  # a record being written on another thread right now: leave the map to exit
                pass
            try:
                os.ftruncate(self._fd, min(used, self.cap))
            except OSError:
                pass
            os.close(self._fd)


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Allocate the file's blocks (a file system without fallocate gets them written as zeros instead)."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        zeros = bytes(min(length, 1 << 20))
        done = 0
        while done < length:
            done += os.pwrite(fd, zeros[:length - done], offset + done)

