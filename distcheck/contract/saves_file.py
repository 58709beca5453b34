"""``saves-rank<R>.jsonl``: each ``torch.save`` a rank made to a named file (rank/save_watch.py writes it,
analysis/shared_files.py reads every rank's: several ranks writing one path with different contents).

    python -m distcheck run --nproc 2 -- train.py   # every rank appends a line per torch.save(obj, "ckpt/model.pt")

One line per save, appended whole: ``{"path": "/w/ckpt/model.pt", "host": "node-a", "n": 1, "digest":
"9f3c...", "file": "/w/train.py", "line": 40}``: the file's absolute path, the host it was written on (the same
path on two hosts is two files, unless they share a file system: not knowable here), which save to that path on
this rank it was, a digest of what was saved (every tensor's fingerprint, every other value's text) and the
user's line. A line cut short by a killed rank is skipped.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from distcheck.contract import files


@dataclass(frozen=True)
class Save:
    path: str
    host: str
    n: int  # the n-th save to this path on this rank (1-based)
    digest: str
    file: str | None = None
    line: int | None = None


def append(report_dir: str | os.PathLike, rank: int, save: Save) -> OSError | None:
    """Append one line; a full report disk returns its error (the user's save already happened)."""
    try:
        with open(files.rank_file(report_dir, "saves", rank), "a") as fh:
            fh.write(json.dumps(asdict(save), separators=(",", ":")) + "\n")
    except OSError as exc:
        return exc
    return None


def read_all(report_dir: str | os.PathLike) -> dict[int, list[Save]]:
    """Every rank's saves, in the order it made them."""
    out: dict[int, list[Save]] = {}
    for rank, path in files.rank_files(report_dir, "saves").items():
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for raw in text.splitlines():
            try:
                d = json.loads(raw)
                save = Save(str(d["path"]), str(d.get("host", "")), int(d.get("n", 1)), str(d["digest"]),
                            d.get("file"), int(d["line"]) if d.get("line") is not None else None)
            except (ValueError, KeyError, TypeError):
                continue
            out.setdefault(rank, []).append(save)
    return out
