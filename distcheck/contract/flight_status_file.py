"""``flight-rank<R>.status``: how far a rank's process groups have come, rewritten by the rank while it runs.

    python -m distcheck run --nproc 2 -- train.py     # rank/flight_recorder.py writes it, the supervisor reads it

Two lines: the progress token (the sum of every group's last enqueued and last completed collective numbers, which
grows whenever the process group enqueues or completes one, Python-called or not: DDP's buckets, compiled graphs),
then ``{"<ring>:<group>": last enqueued, ...}``. The watch loop reads the first (files.flight_progress); the live
straggler look (supervise/live_stragglers.py) reads the second: a rank whose groups enqueued fewer collectives
than its peers' has not reached the one they wait in. A file of one line (an older writer) has no groups.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass
class FlightStatus:
    progress: int = 0
    enqueued: dict[str, int] = field(default_factory=dict)


def text(status: dict[str, tuple[int, int]]) -> str:
    """The file's content for ``{group: (last enqueued, last completed)}`` (rank/flight_recorder.read_status)."""
    total = sum(max(0, e) + max(0, c) for e, c in status.values())
    return f"{total}\n{json.dumps({g: e for g, (e, _) in status.items()}, separators=(',', ':'))}\n"


def read(path: str | os.PathLike) -> FlightStatus:
    """What the file says; zeros when it is missing, being rewritten or unreadable."""
    try:
        with open(path) as fh:
            first, _, rest = fh.read().partition("\n")
        progress = int(first.strip() or 0)
    except (OSError, ValueError):
        return FlightStatus()
    try:
        groups = json.loads(rest) if rest.strip() else {}
        enqueued = {str(g): int(n) for g, n in groups.items()} if isinstance(groups, dict) else {}
    except (ValueError, TypeError, AttributeError):
        enqueued = {}
    return FlightStatus(progress, enqueued)
