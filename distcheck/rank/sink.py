"""Where findings of API calls made inside a user's script go: the surrounding run's report directory.

``distcheck run``/``compare`` set DISTCHECK_REPORT_DIR for the ranks; each rank appends its findings, one JSON
line each, to ``findings-rank<R>.jsonl`` (contract/findings_file.py) as they happen, so a rank that dies later keeps
them. A write the file system refuses (full, quota, I/O error) never reaches the user's call: the findings are
dropped whole (no half line), the rank says so on stderr, and its trace header keeps it for the report.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable

from distcheck.contract import env, findings_file
from distcheck.contract.findings import Finding

ENV_REPORT_DIR = env.REPORT_DIR
log = logging.getLogger("distcheck")


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
    """Append findings to ``findings-rank<R>.jsonl`` (contract/findings_file.py); a refused write is noted in the
    trace header and on stderr, never raised into the user's call."""
    error = findings_file.append(report_dir, rank, findings)
    if error is not None:
        _lost(error)


def _lost(exc: OSError) -> None:
    from distcheck.contract.trace_slots import LOST_FINDINGS, write_failure
    from distcheck.rank.tracer import note_lost

    note_lost(LOST_FINDINGS, exc)
    log.warning("%s (%s): findings of this rank could not be written", write_failure(exc.errno),
                exc.strerror or exc)

