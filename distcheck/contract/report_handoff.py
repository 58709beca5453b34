"""A rank's report, handed to its node's watcher, which publishes it: the one report path for ``consistency``.

    torchrun --nproc-per-node 2 -m distcheck consistency     # rank 0 offers, the watcher publishes

Rank 0 of ``consistency`` composes its report (rank/checks/consistency.py) but does not write it: it offers it
here, and the node watcher (supervise/report_desk.py) claims it and publishes it through supervise/node_report,
beside the watcher's own diagnoses, under one lock. So one process writes report.json, and a watchdog's diagnosis
is never overwritten by the report of the run it ended.

The mailbox is one hidden file (not an artifact: rank/checks/consistency.report_files skips dot files), replaced
whole by each offer: a partial report before each check (what survives a SIGKILL of rank 0), then the final one.
Claiming renames it aside first, so an offer made while the watcher publishes the previous one is never lost, and
removing the claimed file says "published". An offer with no report withdraws the partial one (bad input found
mid-run ends with no report).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from distcheck.contract import atomic_file
from distcheck.contract.files import REPORT_CLAIMED as CLAIMED, REPORT_OFFERED as OFFERED
from distcheck.contract.report import Report


@dataclass
class Handed:
    """What a rank handed over: its report (None: withdraw the partial report), and whether it is the last."""

    report: Report | None
    final: bool
    pid: int


def offer(report_dir: str | os.PathLike, report: Report | None, final: bool) -> None:
    """Hand ``report`` over (rank 0). Replaces an earlier offer the watcher has not claimed yet."""
    body = None if report is None else {"report": report.to_json(), "sections": dict(report.sections)}
    atomic_file.write_text(Path(report_dir) / OFFERED, json.dumps({"final": final, "pid": os.getpid(), **(body or {})}))


def claim(report_dir: str | os.PathLike) -> Handed | None:
    """The offer waiting, now this caller's to publish (then :func:`published`); None when there is none. An offer
    that cannot be read (written by another version) is dropped, and None returned."""
    offered, claimed = Path(report_dir) / OFFERED, Path(report_dir) / CLAIMED
    try:
        os.replace(offered, claimed)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(claimed.read_text())
        report = None
        if "report" in data:
            report = Report.from_json(data["report"])
            report.sections = dict(data.get("sections", {}))
        return Handed(report, bool(data["final"]), int(data.get("pid", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        published(report_dir)
        return None


def published(report_dir: str | os.PathLike) -> None:
    """The claimed offer is published (or deliberately not: a diagnosis supersedes it)."""
    (Path(report_dir) / CLAIMED).unlink(missing_ok=True)


def pending(report_dir: str | os.PathLike) -> bool:
    """An offer not yet claimed, or claimed and not yet published."""
    return (Path(report_dir) / OFFERED).exists() or (Path(report_dir) / CLAIMED).exists()


def wait_published(report_dir: str | os.PathLike, limit: float, claimer_alive: Callable[[], bool],
                   poll: float = 0.02) -> bool:
    """Wait (at most ``limit`` seconds, less once the claimer has ended) until every offer is published. False: it
    was not; the caller publishes its report itself, through the same path."""
    deadline = time.monotonic() + limit
    while pending(report_dir):
        if time.monotonic() >= deadline or not claimer_alive():
            return not pending(report_dir)
        time.sleep(poll)
    return True


def clear(report_dir: str | os.PathLike) -> None:
    """Offers nobody will publish (their claimer ended): the caller publishes its own report instead."""
    for name in (OFFERED, CLAIMED):
        (Path(report_dir) / name).unlink(missing_ok=True)
