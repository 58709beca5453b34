"""``flight-rank<R>.status``: how far a rank's process groups have come, rewritten by the rank while it runs.

    python -m distcheck run --nproc 2 -- train.py     # rank/flight_recorder.py writes it, the supervisor reads it

Three lines: the progress token (the sum of every group's last enqueued and last completed collective numbers, which
grows whenever the process group enqueues or completes one, Python-called or not: DDP's buckets, compiled graphs),
then ``{"<ring>:<group>": last enqueued, ...}``, then the rank's recent looks at those counts,
``[[time, {"<ring>:<group>": last enqueued, ...}], ...]`` (wall-clock seconds, the last HISTORY_S of them). The
watch loop reads the first (files.flight_progress); the live straggler look (supervise/live_stragglers.py) reads the
third: a rank whose groups enqueued fewer collectives than its peers' at the same moment has not reached the one
they wait in.

Why the looks and their times: the rank reads its counters every POLL_S but rewrites this file at most every
WRITE_S (a small file rewritten ten times a second by every rank of a big job is a load on a shared file system),
and its peers rewrite theirs at their own moments. Counts taken half a second apart, in steps shorter than that,
showed a slow rank level with or ahead of the rank waiting for it at a quarter of the looks; counts taken at the same
moment, from each rank's looks, do not. A file of one or two lines (an older writer) has no looks.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

POLL_S = 0.1  # how often a rank reads its counters (a 43 µs call on gloo)
WRITE_S = 0.5  # how often at most it rewrites the file; a change is in it within WRITE_S + POLL_S
HISTORY_S = 1.2  # the looks each rewrite carries: more than WRITE_S + POLL_S, so consecutive files overlap


@dataclass
class FlightStatus:
    progress: int = 0
    enqueued: dict[str, int] = field(default_factory=dict)
    looks: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # oldest first

    def at(self, moment: float) -> dict[str, int]:
        """The counts the rank had at ``moment``: its last look at or before it (the counts stay as they were
        between two looks); its first look when it has none that early; the latest counts without looks."""
        if not self.looks:
            return self.enqueued
        earlier = [counts for t, counts in self.looks if t <= moment]
        return earlier[-1] if earlier else self.looks[0][1]


def text(status: dict[str, tuple[int, int]], looks: list[tuple[float, dict[str, int]]] = ()) -> str:
    """The file's content for ``{group: (last enqueued, last completed)}`` (rank/flight_recorder.read_status) and
    the rank's recent looks at the enqueued counts, oldest first."""
    total = sum(max(0, e) + max(0, c) for e, c in status.values())
    compact = (",", ":")
    return (f"{total}\n{json.dumps({g: e for g, (e, _) in status.items()}, separators=compact)}\n"
            f"{json.dumps([[round(t, 3), counts] for t, counts in looks], separators=compact)}\n")


def read(path: str | os.PathLike) -> FlightStatus:
    """What the file says; zeros when it is missing, being rewritten or unreadable."""
    try:
        with open(path) as fh:
            first, _, rest = fh.read().partition("\n")
        progress = int(first.strip() or 0)
    except (OSError, ValueError):
        return FlightStatus()
    second, _, third = rest.partition("\n")
    try:
        groups = json.loads(second) if second.strip() else {}
        enqueued = {str(g): int(n) for g, n in groups.items()} if isinstance(groups, dict) else {}
    except (ValueError, TypeError, AttributeError):
        enqueued = {}
    looks: list[tuple[float, dict[str, int]]] = []
    try:
        for t, counts in json.loads(third) if third.strip() else []:
            looks.append((float(t), {str(g): int(n) for g, n in counts.items()}))
    except (ValueError, TypeError, AttributeError):
        looks = []
    return FlightStatus(progress, enqueued, looks)
