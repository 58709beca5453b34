"""``autocheck-rank<R>.json``: the zero-code checks' state of one rank, one versioned JSON document rewritten whole
each time it changes: the run-level fields (:data:`RUN_KEYS`) and, under each zero-code check's name, that check's
state. The one writer (a rank: rank/autocheck/core.py) and the one reader (:func:`read_all`, for
analysis/check_table.py behind the report, compare and the pytest pool).

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # each rank keeps out/autocheck-rank<R>.json

The document is replaced atomically (temporary file and rename): a rank killed mid-write leaves the previous one,
never half a document.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from distcheck.contract import files
from distcheck.contract import report as report_files


# The run-level fields at the top of every document, beside FORMAT_KEY; every other key is a check's name (no check
# may take one of these: rank/autocheck/registry.py).
RUN_KEYS = ("rank", "steps", "counter", "backwards")
RESERVED = (files.FORMAT_KEY, *RUN_KEYS)


@dataclass(frozen=True)
class RunFields:
    """What every reader needs of a rank's run, whichever check it reads."""

    rank: int
    steps: int = 0  # steps done, counted by ``counter``
    counter: str = "optimizer.step"  # "optimizer.step", or "backward" for a script without an optimizer
    backwards: int = 0

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> RunFields:
        return cls(int(doc["rank"]), int(doc.get("steps", 0)), str(doc.get("counter", "optimizer.step")),
                   int(doc.get("backwards", 0)))


def document(run: RunFields, parts: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's document: the run-level fields, then each check's part under its name (rank/autocheck/protocol.py:
    plain JSON, which analysis/check_table.py reads and the pytest marker's side channel sends as it is)."""
    return {"rank": run.rank, "steps": run.steps, "counter": run.counter, "backwards": run.backwards, **parts}


def parts_of(docs: Mapping[int, Mapping[str, Any]], name: str) -> dict[int, Any]:
    """``{rank: the part of check name}`` of the ranks whose document has one."""
    return {rank: doc[name] for rank, doc in docs.items() if doc.get(name)}


def runs_of(docs: Mapping[int, Mapping[str, Any]]) -> dict[int, RunFields]:
    """``{rank: RunFields}`` of every document, in the documents' order."""
    return {rank: RunFields.of(doc) for rank, doc in docs.items()}


def path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "autocheck", rank)


def write(report_dir: str | os.PathLike, rank: int, state: dict[str, Any]) -> OSError | None:
    """Replace the rank's document with ``state`` (:func:`document`); a
    refused write (full disk, quota, I/O error) leaves the previous document and is returned, never raised: the
    caller runs inside the user's script."""
    text = json.dumps({files.FORMAT_KEY: files.FORMAT, **state}) + "\n"
    try:
        report_files.atomic_write(path(report_dir, rank), text)
    except OSError as exc:
        return exc
    return None


def read_all(report_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{rank: state}`` of every readable document in ``report_dir`` (an unreadable or foreign one is skipped); a
    document of another format version is a :class:`files.FormatError`."""
    out: dict[int, dict[str, Any]] = {}
    for file in files.rank_files(report_dir, "autocheck").values():
        try:
            data = json.loads(file.read_text())
            files.check_format(data, file)
            out[int(data["rank"])] = data
        except files.FormatError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a state document
            continue
    return out
