"""``records-rank<R>.jsonl`` + ``records-rank<R>.bin``: what a rank recorded for ``distcheck compare``. The one
writer (a rank: rank/records.py, behind ``distcheck.record`` and zero-code compare's automatic records) and the one
reader (:func:`read`, :func:`read_run`: bytes, dtype names and shapes, which analysis/record_values.py makes into
tensors for the comparison).

    python -m distcheck compare --nproc 2 -- train.py     # each run's ranks write <run dir>/records-rank<R>.{jsonl,bin}

The ``.bin`` holds the raw bytes of the recorded tensors, back to back; the ``.jsonl`` one versioned index line per
record (:class:`IndexEntry`), naming each tensor's dtype, shape and byte range in the ``.bin``. Both are appended to
with unbuffered ``os.write`` on O_APPEND descriptors, data first and the index line last: a rank that crashes or is
killed keeps every record whose index line was written and never indexes half-written data (the reader skips a
truncated last line, and a record whose bytes were cut short). A write the file system refuses (full, quota, I/O
error) takes the record's half-written bytes back and ends the writing for good: the records stay a prefix.

This module knows bytes, not tensors (contract/ imports no torch): the rank turns each tensor into its bytes, dtype
name and shape, and the analysis turns them back.
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from distcheck.contract import files


def index_path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "records_index", rank)


def data_path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "records_data", rank)


def paths(report_dir: str | os.PathLike) -> list[Path]:
    """Every record file in ``report_dir``, index and data (compare removes them from a reused directory)."""
    return [*files.rank_files(report_dir, "records_index").values(),
            *files.rank_files(report_dir, "records_data").values()]


@dataclass
class PartMeta:
    """One tensor of a record in the ``.bin``: the whole value of a tensor record, or one parameter, buffer or
    gradient of a module record."""

    key: str  # "" for a tensor record; the parameter name (".grad" for gradients) in a module
    role: str  # "tensor", "parameter", "buffer", "gradient"
    dtype: str  # torch's name without "torch.": "float32", "bfloat16", ...
    shape: list[int]
    offset: int = 0  # where its bytes start in the .bin (the writer sets it)
    nbytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "role": self.role, "dtype": self.dtype, "shape": self.shape, "offset": self.offset,
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartMeta:
        return cls(str(data.get("key", "")), str(data.get("role", "tensor")), str(data["dtype"]),
                   [int(n) for n in data["shape"]], _whole(data["offset"]), _whole(data["nbytes"]))


@dataclass
class IndexEntry:
    """One index line: a record's name and step, where it was taken, how to compare it, and its tensors' places."""

    name: str
    step: int
    kind: str  # "tensor", "number", "module"
    seq: int = 0  # its place among the rank's records (the writer sets it)
    rank: int = 0
    parts: list[PartMeta] = field(default_factory=list)  # empty for a number
    value: bool | int | float | None = None  # a number record's value
    # True: every rank must hold the same value; None: "auto" (agreeing ranks are compared as one, otherwise the
    # mean); False: always the mean.
    replicated: bool | None = None
    rtol: float | None = None
    atol: float | None = None
    file: str | None = None  # the user's line that took it
    line: int | None = None
    auto: bool = False  # taken by distcheck itself (zero-code compare), not by a distcheck.record call
    # (index, size) of the rank's data-parallel coordinate, where the rank knew it
    dp: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {files.FORMAT_KEY: files.FORMAT, "name": self.name, "step": self.step, "seq": self.seq,
                               "rank": self.rank}
        if self.auto:
            out["auto"] = True  # only on automatic records: explicit ones keep their old index lines
        if self.dp is not None:
            out["dp"] = [int(self.dp[0]), int(self.dp[1])]
        out["kind"] = self.kind
        if self.kind == "number":
            out["value"] = self.value
        else:
            out["parts"] = [p.to_json() for p in self.parts]
        out.update(replicated=self.replicated, rtol=self.rtol, atol=self.atol, file=self.file, line=self.line)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexEntry:
        kind = str(data["kind"])
        value = data["value"] if kind == "number" else None
        if kind == "number" and not isinstance(value, (bool, int, float)):
            raise ValueError(f"a number record holds {value!r}")
        parts = [] if kind == "number" else [PartMeta.from_json(p) for p in data["parts"]]
        return cls(str(data["name"]), int(data["step"]), kind, int(data.get("seq", 0)), int(data.get("rank", 0)),
                   parts, value, data.get("replicated"), data.get("rtol"), data.get("atol"), data.get("file"),
                   data.get("line"), bool(data.get("auto", False)), _dp(data.get("dp")))


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a byte count: {value!r}")
    return value


def _dp(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value) \
            and 0 <= value[0] < value[1]:
        return value[0], value[1]
    return None


# -- the writer (a rank) ------------------------------------------------------------------------------------------

class Writer:
    """Appends records to one rank's two files; opening them raises OSError, everything after returns it."""

    def __init__(self, report_dir: str | os.PathLike, rank: int) -> None:
        os.makedirs(report_dir, exist_ok=True)
        self.rank = rank
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self._data_fd = os.open(data_path(report_dir, rank), flags, 0o644)
        self._index_fd = os.open(index_path(report_dir, rank), flags, 0o644)
        # Appending to a reused file: offsets continue from its current end.
        self._offset = os.fstat(self._data_fd).st_size
        self._seq = 0
        self.error: OSError | None = None  # the write that failed: nothing more is written

    @property
    def failed(self) -> bool:
        return self.error is not None

    def close(self) -> None:
        for fd in (self._data_fd, self._index_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def append(self, entry: IndexEntry, parts: Iterable[tuple[PartMeta, bytes | memoryview]] = ()) -> OSError | None:
        """Write ``parts`` (each tensor's place-less meta and bytes, in order) to the ``.bin``, then ``entry`` with
        its parts, sequence number and rank filled in as one index line. ``parts`` may be a generator: each tensor's
        bytes are written before the next is made, so a module record never holds all its tensors' bytes at once.

        A refused write gives back what this record wrote, stops this writer for good (later calls write nothing and
        return the same error: a prefix, not a sieve) and is returned, never raised: the caller runs inside the
        user's script. Any other exception (from ``parts``) gives back the record's bytes and propagates."""
        if self.error is not None:
            return self.error
        start = self._offset
        try:
            metas = [self._write_data(meta, raw) for meta, raw in parts]
            if entry.kind != "number":
                entry.parts = metas
            entry.seq, entry.rank = self._seq, self.rank
            self._write_index((json.dumps(entry.to_json()) + "\n").encode())
        except OSError as exc:
            self.error = exc
            self._give_back(start)
            return exc
        except BaseException:
            self._give_back(start)
            raise
        self._seq += 1
        return None

    def _write_data(self, meta: PartMeta, raw: bytes | memoryview) -> PartMeta:
        view = memoryview(raw).cast("B")
        meta.offset, meta.nbytes = self._offset, len(view)
        while view:  # os.write may write less than asked for large buffers
            n = os.write(self._data_fd, view)
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[n:]
            self._offset += n
        return meta

    def _write_index(self, line: bytes) -> None:
        files.append_whole(self._index_fd, line)

    def _give_back(self, start: int) -> None:
        try:
            os.ftruncate(self._data_fd, start)
        except OSError:
            pass
        self._offset = start


# -- the reader (the analysis) ------------------------------------------------------------------------------------

@dataclass
class StoredRecord:
    entry: IndexEntry
    data: list[memoryview]  # each part's bytes, in ``entry.parts`` order


def read(report_dir: str | os.PathLike, rank: int) -> list[StoredRecord]:
    """One rank's records in the order written. A truncated or unreadable line, and a record whose bytes were cut
    short by a crash, are skipped; a file of another format version is a :class:`files.FormatError`."""
    index = index_path(report_dir, rank)
    try:
        lines = index.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    try:
        data = memoryview(data_path(report_dir, rank).read_bytes())
    except FileNotFoundError:
        data = memoryview(b"")
    out = []
    for line in lines:
        try:
            raw = json.loads(line)
            files.check_format(raw, index)
            entry = IndexEntry.from_json(raw)
        except files.FormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        chunks = [data[p.offset:p.offset + p.nbytes] for p in entry.parts]
        if any(len(c) != p.nbytes for c, p in zip(chunks, entry.parts)):
            continue  # data cut short
        out.append(StoredRecord(entry, chunks))
    return out


def read_run(report_dir: str | os.PathLike) -> dict[int, list[StoredRecord]]:
    """Every rank's records of a run directory (each rank with an index file), by rank."""
    return {rank: read(report_dir, rank) for rank in ranks(report_dir)}


def ranks(report_dir: str | os.PathLike) -> list[int]:
    """The ranks that have an index file in ``report_dir``."""
    return list(files.rank_files(report_dir, "records_index"))
