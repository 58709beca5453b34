"""``autocheck-rank<R>.json``: the zero-code checks' state of one rank, one versioned JSON document rewritten whole
each time it changes. The one writer (a rank: rank/autocheck/__init__.py) and the one reader (the report:
supervise/run_report.py, and compare's module diff: supervise/compare_runs.py).

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # each rank keeps out/autocheck-rank<R>.json

The document is replaced atomically (temporary file and rename): a rank killed mid-write leaves the previous one,
never half a document.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcheck.contract import files
from distcheck.contract import report as report_files


@dataclass
class AutocheckState:
    """The document's top-level keys. Its parts stay plain JSON (dicts and lists): analysis/bad_values.py,
    replica_drift.py and module_diff.py read them, and the pytest marker's side channel sends them as they are."""

    rank: int
    model_checks: list[dict[str, Any]] = field(default_factory=list)  # one per model checked at its first forward
    steps: int = 0  # steps done, counted by ``counter``
    counter: str = "backward"  # "optimizer.step", or "backward" for a script without an optimizer
    backwards: int = 0
    first_bad: dict[str, Any] | None = None  # the first NaN/Inf this rank saw (nan_watch.py)
    step_check_seconds: float = 0.0  # what the per-step NaN check cost
    auto_records: int = 0  # records taken by zero-code compare
    replica_drift: dict[str, Any] = field(default_factory=dict)  # {"steps", "checked": fingerprints, "seconds"}
    modules: list[dict[str, Any]] = field(default_factory=list)  # the first step's per-module summaries
    prewrap: dict[str, Any] = field(default_factory=dict)  # {"points", "seconds"}
    frozen: list[dict[str, Any]] = field(default_factory=list)  # the checked steps that had nothing to update
    warnings: list[dict[str, Any]] = field(default_factory=list)  # Notes for the report
    precision: list[dict[str, Any]] = field(default_factory=list)  # 16-bit computation: {source, dtype, file, line}
    # The pipeline schedules this rank built (rank/autocheck/pipeline_schedule.py): class, n_microbatches, stages,
    # the pipeline's ranks, what its first step split; written before torch runs the step.
    pipeline: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {files.FORMAT_KEY: files.FORMAT, "rank": self.rank, "model_checks": self.model_checks,
                "steps": self.steps, "counter": self.counter, "backwards": self.backwards,
                "first_bad": self.first_bad, "step_check_seconds": self.step_check_seconds,
                "auto_records": self.auto_records, "replica_drift": self.replica_drift, "modules": self.modules,
                "prewrap": self.prewrap, "frozen": self.frozen, "warnings": self.warnings,
                "precision": self.precision, "pipeline": self.pipeline}


def path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "autocheck", rank)


def write(report_dir: str | os.PathLike, rank: int, state: dict[str, Any]) -> OSError | None:
    """Replace the rank's document with ``state`` (``AutocheckState.to_json()``, or a dict of the same keys); a
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
