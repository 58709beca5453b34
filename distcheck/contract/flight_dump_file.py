"""``flight-rank<R>.json``: a rank's Flight Recorder ring, its phases and its group names, written whole at its end.

    python -m distcheck run --nproc 2 -- train.py     # rank/flight_recorder.py writes it, the supervisor reads it

The writer is the rank (rank/flight_recorder.dump: when the script ends, when it raises, on a stop signal, when
the supervisor asks before a hang's diagnosis); the reader is the analysis (analysis/flight_recorder.load_dump:
what DDP's buckets and compiled graphs issued, which the tracer does not see). The document is torch's ring entries
(the fields the analysis uses), ``pg_status`` per group, the group names, the phase marks and the compiled graphs
(rank/flight_recorder.document), with the format version every per-rank file carries (contract/files.py). It is
written to a temporary name and renamed, so a reader sees the whole document or none.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distcheck.contract import atomic_file, files


def write(report_dir: str | os.PathLike, rank: int, doc: dict[str, Any]) -> OSError | None:
    """Write the document whole (temporary file, then rename); the error of a full disk, which must not break the
    user's training, or None."""
    try:
        atomic_file.write_text(files.rank_file(report_dir, "flight", rank),
                               json.dumps({files.FORMAT_KEY: files.FORMAT, **doc}, separators=(",", ":"), default=str))
    except OSError as exc:
        return exc
    return None


def read(report_dir: str | os.PathLike, rank: int) -> dict[str, Any] | None:
    """The rank's document, or None (no dump: the rank was killed, or the recorder was off). A document of
    another format version raises files.FormatError."""
    path = files.rank_file(report_dir, "flight", rank)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    files.check_format(data, f"the Flight Recorder dump of rank {rank}")
    return data
