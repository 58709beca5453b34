"""The records of a run as typed values: each (name, step) a rank recorded, its tensors made from their bytes.

    from distcheck.analysis.record_values import load_run
    run = load_run("report/nproc2")      # {rank: [Record]}, read by contract/records_file.py

    python -m pytest -q tests/unit/test_records.py tests/unit/test_contract_records.py

contract/records_file.py reads a rank's ``records-rank<R>.jsonl/.bin`` (bytes, dtype names, shapes: contract/
imports no torch); this turns each stored record into a :class:`Record` of torch tensors, the one form the
comparison works on (analysis/record_resolve.py, record_compare.py, record_explain.py, compare_to_reference.py).
Plain tensor math, no process group, no file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from distcheck.contract import records_file
from distcheck.contract.files import AUTO_GRADS
from distcheck.contract.site import file_line

# Python numbers usually come from ``loss.item()`` of a float32 tensor: float64 tolerances would flag rounding.
NUMBER_TOL_DTYPE = torch.float32


@dataclass
class Part:
    """One tensor of a record: the whole value of a tensor/number record, or one parameter/buffer/gradient."""

    key: str  # "" for tensor and number records; the parameter name (".grad" for gradients) in a module
    role: str  # "tensor", "number", "parameter", "buffer", "gradient"
    value: torch.Tensor
    tol_dtype: torch.dtype  # the dtype whose default tolerances apply

    @property
    def label(self) -> str:
        return f"{self.role} '{self.key}'" if self.key else self.role


@dataclass
class Record:
    name: str
    step: int
    seq: int
    rank: int
    kind: str  # "tensor", "number", "module"
    parts: list[Part]
    replicated: bool | None = None
    rtol: float | None = None
    atol: float | None = None
    file: str | None = None
    line: int | None = None
    auto: bool = False  # taken by distcheck itself (zero-code compare), not by a distcheck.record call
    # (index, size) of the rank's data-parallel coordinate where the rank knew it (the process groups of its
    # fully_shard/DDP wrapper): ranks with one index saw the same samples (tensor-parallel peers).
    dp: tuple[int, int] | None = None

    @property
    def site(self) -> str:
        return file_line(self.file, self.line) or ""


Key = tuple[str, int, int]  # (name, step, occurrence of that (name, step) on the rank)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _tensor(raw: memoryview, meta: records_file.PartMeta) -> torch.Tensor:
    dt = _dtype(meta.dtype)
    if not len(raw):
        return torch.empty(meta.shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(meta.shape)


def to_record(stored: records_file.StoredRecord) -> Record:
    """The record of one index line, its tensors made from their bytes."""
    entry = stored.entry
    if entry.kind == "number":
        v = entry.value
        if isinstance(v, bool) or isinstance(v, int):
            parts = [Part("", "number", torch.tensor(int(v), dtype=torch.int64), torch.int64)]
        else:
            parts = [Part("", "number", torch.tensor(float(v), dtype=torch.float64), NUMBER_TOL_DTYPE)]
    else:
        parts = []
        # The gradients of the first optimizer step (rank/autocheck/auto_records.py records them under AUTO_GRADS as
        # a list of parameter-named parts, like auto/params): their role is "gradient" here.
        grads = entry.auto and entry.name == AUTO_GRADS
        for meta, raw in zip(entry.parts, stored.data):
            t = _tensor(raw, meta)
            parts.append(Part(meta.key, "gradient" if grads else meta.role, t, t.dtype))
    return Record(entry.name, entry.step, entry.seq, entry.rank, entry.kind, parts, entry.replicated, entry.rtol,
                  entry.atol, entry.file, entry.line, entry.auto, entry.dp)


def load_rank(report_dir: str | os.PathLike, rank: int) -> list[Record]:
    """One rank's records; a truncated last line, data cut short by a crash or a dtype this torch lacks is skipped,
    not fatal."""
    return records_of(records_file.read(report_dir, rank))


def load_run(report_dir: str | os.PathLike) -> dict[int, list[Record]]:
    """Every rank's records of a run directory, by rank."""
    return {rank: records_of(stored) for rank, stored in records_file.read_run(report_dir).items()}


def records_of(stored: list[records_file.StoredRecord]) -> list[Record]:
    """The records of what contract/records_file.py read, a record this torch cannot make skipped."""
    out = []
    for one in stored:
        try:
            out.append(to_record(one))
        except (ValueError, TypeError, RuntimeError):
            continue
    return out


def wide(t: torch.Tensor) -> torch.Tensor:
    """float64, or complex128 for complex values (.double() would drop their imaginary part)."""
    return t.to(torch.complex128) if t.is_complex() else t.double()
