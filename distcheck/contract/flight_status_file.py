"""``flight-rank<R>.status``: how far a rank's process groups have come, rewritten by the rank while it runs.

    python -m distcheck run --nproc 2 -- train.py     # rank/flight_recorder.py writes it, the supervisor reads it

Three lines: the progress token (the sum of every group's last enqueued and last completed collective numbers, which
grows whenever the process group enqueues or completes one, Python-called or not: DDP's buckets, compiled graphs),
then ``{"<ring>:<group>": last enqueued, ...}``, then the rank's recent looks at those counts,
``[[time, {"<ring>:<group>": last enqueued, ...}, since], ...]`` (wall-clock seconds, the last HISTORY_S of them;
``since``: the look before, so a change the look saw happened after ``since`` and by ``time``). The watch loop reads
the first (files.flight_progress); the live straggler look (supervise/live_stragglers.py) reads the third: a rank
whose groups enqueued fewer collectives than its peers' at the same moment has not reached the one they wait in.

Why the looks and their times: the rank reads its counters every POLL_S but rewrites this file at most every
WRITE_S (a small file rewritten ten times a second by every rank of a big job is a load on a shared file system),
and its peers rewrite theirs at their own moments. Counts taken half a second apart, in steps shorter than that,
showed a slow rank level with or ahead of the rank waiting for it at a quarter of the looks; counts taken at the same
moment, from each rank's looks, do not.

Why ``since``: a look sees a change up to POLL_S (more on a loaded machine) after it happened, and the ranks look at
their own moments. A slow rank enters collective k at the moment the rank waiting for it completes k - 1 and enters
k + 1; if the slow rank's look comes a few ms before its peer's, every moment just after the slow rank's look has
the two level, and the moment every file covers is such a moment. Found on a 2-rank run where whole stretches of
looks saw the straggler level with the rank it kept waiting. So a rank's count at a moment is a range
(:meth:`FlightStatus.bounds`: a change seen by the next look may or may not have come by then), and the live look
compares the ranks at the latest moment at which the ranges decide it. A file of one or two lines (an older writer)
has no looks; a look without ``since`` (an older writer) is taken to have followed the one before by POLL_S.

The file is replaced whole (a temporary file and a rename): a reader never sees it half written.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from distcheck.contract import atomic_file

POLL_S = 0.1  # how often a rank reads its counters (a 43 µs call on gloo)
WRITE_S = 0.5  # how often at most it rewrites the file; a change is in it within WRITE_S + POLL_S
HISTORY_S = 1.2  # the looks each rewrite carries: more than WRITE_S + POLL_S, so consecutive files overlap


Look = tuple[float, dict[str, int], float]  # (time, {"<ring>:<group>": last enqueued}, the look before it)


@dataclass
class FlightStatus:
    progress: int = 0
    enqueued: dict[str, int] = field(default_factory=dict)
    looks: list[Look] = field(default_factory=list)  # oldest first
    _times: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    _sinces: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def doubts(self) -> list[tuple[float, float]]:
        """The intervals (``since``, ``time``] in which the rank's counts changed unseen: a look that saw a change,
        from the look before it. Outside them (from the first look on) its counts are known."""
        pairs = zip(self.looks, self.looks[1:])
        return [(since, t) for (_, before, _), (t, counts, since) in pairs if counts != before]

    def bounds(self, moment: float) -> tuple[dict[str, int], dict[str, int]] | None:
        """What the rank's counts were at ``moment``, as ``(at least, at most)``: those of its last look at or
        before it (counts only grow), and those of its last look whose change could have come by then (``since``
        before ``moment``). None before its first look (what came before is not in the file); a file without looks:
        its counts, at every moment. Valid up to the moment the file covers (live_stragglers.counts_at_one_moment).
        Both times grow look by look (``since`` is the look before), so each is a bisection."""
        if not self.looks:
            return self.enqueued, self.enqueued
        if moment < self.looks[0][0]:
            return None
        if self._times is None:
            self._times = [look[0] for look in self.looks]
            self._sinces = [look[2] for look in self.looks[1:]]
        seen = self.looks[bisect.bisect_right(self._times, moment) - 1][1]
        # the first look's counts held at its time, whenever they came (its ``since`` may be that time)
        possible = self.looks[bisect.bisect_left(self._sinces, moment)][1]
        return seen, possible


def text(status: dict[str, tuple[int, int]], looks: list[Look] = ()) -> str:
    """The file's content for ``{group: (last enqueued, last completed)}`` (rank/flight_recorder.read_status) and
    the rank's recent looks at the enqueued counts, oldest first."""
    total = sum(max(0, e) + max(0, c) for e, c in status.values())
    compact = (",", ":")
    rows = [[round(t, 3), counts, round(since, 3)] for t, counts, since in looks]
    return (f"{total}\n{json.dumps({g: e for g, (e, _) in status.items()}, separators=compact)}\n"
            f"{json.dumps(rows, separators=compact)}\n")


def write(path: Path, text: str) -> None:
    """Replace the file whole: the supervisor reads it at its own moments, and an open that truncated it before the
    write (Path.write_text) showed it empty, or half written, to a look that came between (OSError propagates)."""
    atomic_file.write_text(path, text)


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
    looks: list[Look] = []
    try:
        for t, counts, *since in json.loads(third) if third.strip() else []:
            t = float(t)
            looks.append((t, {str(g): int(n) for g, n in counts.items()}, float(since[0]) if since else t - POLL_S))
    except (ValueError, TypeError, AttributeError):
        looks = []
    return FlightStatus(progress, enqueued, looks)
