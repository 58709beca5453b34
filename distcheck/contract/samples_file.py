"""``samples-rank<R>.jsonl``: where a rank's main thread was, a few times a second (rank/sampler.py writes it,
analysis/stragglers.py reads it to say where a late rank spent its time).

Two kinds of line, appended whole: a place, once (``{"site": 3, "file": "/w/train.py", "line": 22, "func":
"load_batch", "kind": "its own code"}``), and a batch of samples (``{"t": [t0, t1, ...], "s": [3, 3, ...]}``:
wall times and the place each one found). A line cut short by a killed rank is skipped.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from distcheck.contract import files
from distcheck.contract.site import file_line


@dataclass(frozen=True)
class Place:
    file: str
    line: int
    func: str
    kind: str  # "data loading", "forward", "backward", "optimizer step", "a collective", "its own code"

    @property
    def site(self) -> str:
        return file_line(self.file, self.line) or "?"


def path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "samples", rank)


def place_line(index: int, place: Place) -> dict:
    return {"site": index, "file": place.file, "line": place.line, "func": place.func, "kind": place.kind}


def batch_line(times: list[float], sites: list[int]) -> dict:
    return {"t": [round(t, 4) for t in times], "s": sites}


def read(report_dir: str | os.PathLike, rank: int) -> list[tuple[float, Place]]:
    """The rank's samples in time order: (wall time, place). Empty when it wrote none."""
    places: dict[int, Place] = {}
    out: list[tuple[float, Place]] = []
    try:
        text = path(report_dir, rank).read_text(errors="replace")
    except OSError:
        return out
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if "site" in rec:
            places[int(rec["site"])] = Place(str(rec.get("file")), int(rec.get("line") or 0),
                                             str(rec.get("func") or "?"), str(rec.get("kind") or "its own code"))
        elif "t" in rec:
            for t, s in zip(rec.get("t") or [], rec.get("s") or []):
                place = places.get(int(s))
                if place is not None:
                    out.append((float(t), place))
    out.sort(key=lambda x: x[0])
    return out


def read_all(report_dir: str | os.PathLike) -> dict[int, list[tuple[float, Place]]]:
    return {r: read(report_dir, r) for r in files.rank_files(report_dir, "samples")}
