"""``findings-rank<R>.jsonl``: the findings a rank's API calls and zero-code checks made, one versioned JSON line
each. The one writer (a rank: rank/sink.py) and the one reader (the report: supervise/run_report.py).

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # a rank's distcheck.check_model() -> out/findings-rank<R>.jsonl

Lines are appended as the findings happen, each batch in one ``write``, so a rank that dies later keeps them and a
rank killed mid-write leaves whole lines (the reader skips a truncated last line).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from distcheck.contract import files
from distcheck.contract.findings import Finding, jsonable


def path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "findings", rank)


def append(report_dir: str | os.PathLike, rank: int, findings: Iterable[Finding]) -> OSError | None:
    """Append ``findings`` in one write; on a refused write (full disk, quota, I/O error) nothing of them stays in
    the file (no half line, so later lines stay readable) and the error is returned, never raised: the caller runs
    inside the user's script."""
    data = "".join(json.dumps({files.FORMAT_KEY: files.FORMAT, **jsonable(f.to_json())}) + "\n"
                   for f in findings).encode()
    try:
        fd = os.open(path(report_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        return exc
    try:
        files.append_whole(fd, data)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    return None


def collect(report_dir: str | os.PathLike) -> list[Finding]:
    """Every finding any rank wrote into ``report_dir``, in rank order; truncated last lines are skipped, a file of
    another format version is a :class:`files.FormatError`."""
    out: list[Finding] = []
    for file in files.rank_files(report_dir, "findings").values():
        for line in file.read_text(encoding="utf-8").splitlines():
            try:
                data = json.loads(line)
                files.check_format(data, file)
                out.append(Finding.from_json(data))
            except files.FormatError:
                raise
            except (ValueError, KeyError):
                continue
    return out
