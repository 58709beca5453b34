"""Where findings of API calls made inside a user's script go: the surrounding run's report directory.

``distcheck run``/``compare`` set DISTCHECK_REPORT_DIR for the ranks; each rank appends its findings, one JSON
line each, to ``findings-rank<R>.jsonl`` as they happen, so a rank that dies later keeps them. A write the file
system refuses (full, quota, I/O error) never reaches the user's call: the findings are dropped whole (no half
line), the rank says so on stderr, and its trace header keeps it for the report.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Iterable

from distcheck.contract import env, files
from distcheck.contract.findings import Finding, jsonable

ENV_REPORT_DIR = env.REPORT_DIR
log = logging.getLogger("distcheck")


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
    """Append findings, one versioned JSON line each, to ``findings-rank<R>.jsonl`` in ``report_dir``: one write,
    so a rank killed meanwhile leaves whole lines."""
    data = "".join(json.dumps({files.FORMAT_KEY: files.FORMAT, **jsonable(f.to_json())}) + "\n"
                   for f in findings).encode()
    try:
        fd = os.open(findings_path(report_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        _lost(exc)
        return
    try:
        n = os.write(fd, data)
        if n < len(data):  # the disk filled mid-write: take the half back, so later lines stay readable
            os.ftruncate(fd, os.fstat(fd).st_size - n)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        _lost(exc)
    finally:
        os.close(fd)


def _lost(exc: OSError) -> None:
    from distcheck.contract.trace_records import LOST_FINDINGS, write_failure
    from distcheck.rank.tracer import note_lost

    note_lost(LOST_FINDINGS, exc)
    log.warning("%s (%s): findings of this rank could not be written", write_failure(exc.errno),
                exc.strerror or exc)


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
