"""Typed records shared by every check: findings and check results (the report.json contract)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, TypeVar

T = TypeVar("T")

# The finding kinds of the public contract (DESIGN.md). A kind outside this set is a bug in distcheck.
KINDS = (
    "env_mismatch",
    "collective_mismatch",
    "tensor_divergence",
    "uncovered_param",
    "mesh_mismatch",
    "reference_mismatch",
    "bad_values",
    "hang",
    "rank_failure",
)


@dataclass
class Finding:
    kind: str
    ranks: list[int]
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")
        self.ranks = sorted({int(r) for r in self.ranks})

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "message": self.message, "detail": self.detail}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        return cls(data["kind"], list(data.get("ranks", [])), data["message"], dict(data.get("detail", {})))


@dataclass
class Note:
    """A report.json "warnings" entry: same shape as a Finding, but what it reports is not a bug in the user's
    code (torch's own teardown abort after the script finished, a trace cut short by a full report file system, ...).
    Notes never change ``ok`` or the exit code."""

    kind: str  # "teardown_abort", "trace_incomplete", "files_incomplete" (supervise/run_report.py)
    ranks: list[int]
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ranks = sorted({int(r) for r in self.ranks})

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "message": self.message, "detail": self.detail}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Note:
        return cls(str(data["kind"]), list(data.get("ranks", [])), str(data["message"]), dict(data.get("detail", {})))


@dataclass
class CheckResult:
    """One entry of report.json's "checks". ``note`` says why a check means little (e.g. world size 1)."""

    name: str
    ok: bool
    seconds: float
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        data = {"name": self.name, "ok": self.ok, "seconds": round(self.seconds, 4)}
        if self.note:
            data["note"] = self.note
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckResult:
        return cls(data["name"], bool(data["ok"]), float(data["seconds"]), data.get("note", ""))


def format_names(names: list[str], shown: int) -> str:
    """``['a', 'b', 'c', 'd']``, 2 -> ``"'a', 'b' (+2 more)"``: a finding's message names a few, its detail all."""
    text = ", ".join(f"'{n}'" for n in names[:shown])
    return text + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the compact form a big job's rank lists take in texts and JSON keys."""
    parts: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def parse_rank_ranges(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the inverse of :func:`rank_ranges`; a plain ``"3"`` is one rank)."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        out.extend(range(int(first), int(last) + 1) if sep else (int(first),))
    return out


def format_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; one rank -> ``"rank 3"``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + rank_ranges(ranks)


def headline(item: Any) -> str:
    """``[hang] ranks 0-1: <message>``: a finding or a warning on one line, as report.txt, the pytest marker and
    the automatic checks' test failures show it."""
    return f"[{item.kind}] {format_ranks(item.ranks) if item.ranks else 'all ranks'}: {item.message}"


# Up to this many ranks, per-rank maps in report.json and stacks.json keep one key per rank ("0", "1", ...); above,
# ranks with the same value share one key, their rank ranges ("0-4093,4095"), so a 4096-rank job's files grow with
# its distinct stacks and progress, not with W (or W squared: each rank's progress names its group's W ranks).
SMALL_WORLD = 64


def ranks_keyed(values: Mapping[int, T], to_json: Callable[[T], Any],
                key: Callable[[T], Hashable] | None = None, small: int = SMALL_WORLD) -> dict[str, Any]:
    """A per-rank map for JSON: ``{"0": ..., "1": ...}`` for at most ``small`` ranks, else one entry per distinct
    value (``key``, default the JSON itself), keyed by its ranks' :func:`rank_ranges` and holding the first rank's
    JSON. Read it back with :func:`per_rank`."""
    if len(values) <= small:
        return {str(r): to_json(v) for r, v in sorted(values.items())}
    groups: dict[Hashable, list[int]] = {}
    firsts: dict[Hashable, Any] = {}
    for r, v in sorted(values.items()):
        if key is not None:
            k = key(v)
            if k not in firsts:
                firsts[k] = to_json(v)
        else:
            j = to_json(v)
            k = json.dumps(j, sort_keys=True, default=str)
            firsts.setdefault(k, j)
        groups.setdefault(k, []).append(r)
    return {rank_ranges(rs): firsts[k] for k, rs in sorted(groups.items(), key=lambda item: item[1][0])}


def per_rank(mapping: Mapping[str, T] | None) -> dict[int, T]:
    """``{"0-2,5": v}`` -> ``{0: v, 1: v, 2: v, 5: v}``: a :func:`ranks_keyed` map (or a plain per-rank one) by
    rank; ranks that share a key share the value object."""
    out: dict[int, T] = {}
    for k, v in (mapping or {}).items():
        for r in parse_rank_ranges(k):
            out[r] = v
    return out


def jsonable(value: Any) -> Any:
    """Best-effort conversion of detail values (tuples, dataclasses, numpy/torch scalars) to JSON types."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        # JSON has no NaN/Inf: keep them readable instead of producing invalid JSON.
        if value != value or value in (float("inf"), float("-inf")):
            return repr(value)
        return value
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if hasattr(value, "item"):
        try:
            return jsonable(value.item())
        except Exception:  # multi-element tensors and arrays fall through to str()
            pass
    return str(value)
