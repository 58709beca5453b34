"""A rank's own stack dumps: ``faulthandler-rank<R>.txt`` (the fallback when py-spy cannot attach: the dumper
appends a marker line, signals the rank, and reads what follows) and ``stop-rank<R>-<SIGNAL>.txt`` (what every
thread ran when torchrun passed a stop signal on). CPython's faulthandler writes them, into files the rank opens here
(rank/stack_hooks.py); the supervisor reads them here. Their text is faulthandler's format, which
analysis/stack_groups.parse_faulthandler reads (a crash's dump in stderr has the same).

    torchrun --nproc-per-node 2 -m distcheck run -- train.py   # a stop signal: out/stop-rank<R>-SIGTERM.txt
"""
from __future__ import annotations

import os
from typing import IO

from distcheck.contract import files


def open_fallback(report_dir: str | os.PathLike, rank: int) -> IO[str]:
    """The file the rank's faulthandler fallback dumps into (appended: every dump follows its marker)."""
    return open(files.rank_file(report_dir, "faulthandler", rank), "a", encoding="utf-8")


def open_stop(report_dir: str | os.PathLike, rank: int, signal_name: str) -> IO[str]:
    """Raises OSError (a full or failing report disk): the rank then goes without that dump."""
    return open(files.rank_file(report_dir, f"stop_{signal_name}", rank), "w", encoding="utf-8")


def mark(path: str | os.PathLike, marker: str) -> None:
    """Before a fallback dump: the line after which the dump will be."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(marker)


def after_mark(path: str | os.PathLike, marker: str) -> str:
    """What the fallback file holds from ``marker`` on ("" before the marker is there)."""
    text = open(path, encoding="utf-8", errors="replace").read()
    at = text.rfind(marker)
    return text[at:] if at >= 0 else ""


def stop_dumps(report_dir: str | os.PathLike) -> dict[str, dict[int, str]]:
    """``{signal name: {rank: dump text}}``, the ranks whose stop dump holds anything."""
    out: dict[str, dict[int, str]] = {}
    for name in files.STOP_SIGNAL_NAMES:
        for rank, path in files.rank_files(report_dir, f"stop_{name}").items():
            try:
                text = path.read_text(errors="replace") if path.stat().st_size else ""
            except OSError:
                continue
            if text:
                out.setdefault(name, {})[rank] = text
    return out
