"""Where findings of API calls made inside a user's script go: the surrounding run's report directory.

``distcheck run``/``compare`` set DISTCHECK_REPORT_DIR for the ranks; each rank appends its findings, one JSON
line each, to ``findings-rank<R>.jsonl`` as they happen, so a rank that dies later keeps them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from distcheck.contract import files
from distcheck.contract.findings import Finding, jsonable

ENV_REPORT_DIR = "DISTCHECK_REPORT_DIR"


def findings_path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "findings", rank)


def emit(findings: Iterable[Finding], rank: int | None = None) -> None:
    """Append findings to this rank's findings file when running under distcheck; otherwise do nothing."""
    report_dir = os.environ.get(ENV_REPORT_DIR)
    findings = list(findings)
    if not report_dir or not findings:
        return
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    append(report_dir, rank, findings)


def append(report_dir: str | os.PathLike, rank: int, findings: Iterable[Finding]) -> None:
    """Append findings, one versioned JSON line each, to ``findings-rank<R>.jsonl`` in ``report_dir``."""
    with open(findings_path(report_dir, rank), "a", encoding="utf-8") as fh:
        for f in findings:
            fh.write(json.dumps({files.FORMAT_KEY: files.FORMAT, **jsonable(f.to_json())}) + "\n")
        fh.flush()


def collect(report_dir: str | os.PathLike) -> list[Finding]:
    """Every finding any rank emitted into report_dir, in rank order; truncated last lines are skipped."""
    out: list[Finding] = []
    for path in files.rank_files(report_dir, "findings").values():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                data = json.loads(line)
                files.check_format(data, path)
                out.append(Finding.from_json(data))
            except files.FormatError:
                raise
            except (ValueError, KeyError):
                continue
    return out
