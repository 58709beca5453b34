"""The live straggler line: while a run goes on, say once that a rank keeps the others waiting.

    python -m distcheck run --nproc 2 -- train.py     # "distcheck: rank 1 is the straggler: ..." on the console

The report's stragglers part (analysis/stragglers.py) comes at the end, from whole traces. A long job should show
it before that. Every LOOK_S the supervisor reads each rank's ``flight-rank<R>.status`` (contract/
flight_status_file.py: how many collectives each of its process groups enqueued, DDP's buckets and compiled graphs
included, as the rank saw them ten times a second, with the times it saw them) and takes every rank's counts at one
moment. A rank whose count in some group is below a peer's at that moment has not reached the collective that peer
entered: the peer waits for it. A rank's count at a moment is known as a range (a change its next look saw may have
come before that moment or after); the moment is the latest that every rank's file covers at which the ranges
decide who is behind (a moment inside a change a look had not seen yet made a slow rank look level with the rank
waiting for it, in whole runs of looks). When one rank, and only that rank, is behind at 70% of the last LOOKS looks
(10 s by default), and it moved at least twice meanwhile (a rank that does not move is stuck: the watch loop's
hang), the supervisor logs one line naming it. Once per rank per run;
DISTCHECK_STRAGGLER_LOOKS sets LOOKS ("0": no line). Without the Flight Recorder's counters
(DISTCHECK_FLIGHT_RECORDER=0) there is nothing to look at.

A node's supervisor sees its own ranks: a straggler on another node shows on that node's console.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Mapping

from distcheck.contract import env, files, flight_status_file

log = logging.getLogger("distcheck")

LOOK_S = 1.0
LOOKS = 10
MOMENTS = 64  # the latest moments a look tries (counts_at_one_moment)


def behind(enqueued: Mapping[int, Mapping[str, int]],
           at_most: Mapping[int, Mapping[str, int]] | None = None) -> set[int] | None:
    """The ranks that have not reached a collective a peer of theirs has enqueued, in some group both are in.
    ``enqueued``: the counts each rank had at least; ``at_most``: those it had at most (the same when not given).
    A rank is behind when even its most is below a peer's least; None when the ranges leave some rank neither
    surely behind nor surely level with every peer."""
    at_most = enqueued if at_most is None else at_most
    members: dict[str, dict[int, tuple[int, int]]] = {}
    for rank, groups in enqueued.items():
        for group, count in groups.items():
            members.setdefault(group, {})[rank] = (count, at_most.get(rank, {}).get(group, count))
    late: set[int] = set()
    for counts in members.values():
        if len(counts) < 2:
            continue
        top = max(low for low, _ in counts.values())
        for rank, (low, high) in counts.items():
            if high < top:
                late.add(rank)
            elif any(low < peer_high for peer, (_, peer_high) in counts.items() if peer != rank):
                return None  # it may be behind a peer's latest collective, or not
    return late


def counts_at_one_moment(statuses: Mapping[int, flight_status_file.FlightStatus],
                         now: float) -> tuple[dict[int, dict[str, int]], set[int]] | None:
    """Every rank's enqueued counts (at least) and the ranks behind, at the latest moment at which the ranks' counts
    decide who is behind (:func:`behind` with FlightStatus.bounds), up to the latest moment all their files cover;
    None when no moment in the files decides it. A file covers up to its last look; a rank whose counts did not
    move is not rewritten, and its counts hold until at least WRITE_S + POLL_S ago (a change would be in the file
    by then)."""
    settled = now - flight_status_file.WRITE_S - flight_status_file.POLL_S
    covered = [max(s.looks[-1][0], settled) for s in statuses.values() if s.looks]
    until = min(covered) if covered else now
    # A moment's answer changes only where some rank's range does: at a look or at the look before it. The latest
    # MOMENTS of them first (on 8 ranks about the last second); then the latest moment at which no rank's count is
    # in doubt, which always decides. Many ranks whose looks all see changes may leave no moment but that one
    # within the latest MOMENTS, and trying every moment cost seconds a look on 512 ranks.
    moments = {until} | {t for s in statuses.values() for look in s.looks for t in (look[0], look[2]) if t < until}
    latest = sorted(moments, reverse=True)[:MOMENTS]
    for moment in latest:
        ranges = {rank: s.bounds(moment) for rank, s in statuses.items()}
        if any(r is None for r in ranges.values()):
            return None  # before some rank's first look: earlier moments are not in its file either
        low = {rank: r[0] for rank, r in ranges.items() if r[0]}
        late = behind(low, {rank: r[1] for rank, r in ranges.items() if r[0]})
        if late is not None:
            return low, late
    exact = _latest_exact_moment(statuses, until)
    if exact is None or exact >= latest[-1]:  # none, or already tried
        return None
    low = {rank: s.bounds(exact)[0] for rank, s in statuses.items()}
    low = {rank: counts for rank, counts in low.items() if counts}
    return low, behind(low)  # every count known: behind() decides


def _latest_exact_moment(statuses: Mapping[int, flight_status_file.FlightStatus], until: float) -> float | None:
    """The latest moment up to ``until`` that is inside no rank's change interval (``since``, ``time``] and not
    before any rank's first look: every count is known there. None when the files have no such moment."""
    doubt = sorted((since, t) for s in statuses.values() for since, t in s.doubts() if since < until)
    merged: list[list[float]] = []  # the union of the intervals: disjoint, and apart (a shared end is in doubt)
    for since, t in doubt:
        if merged and since <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([since, t])
    moment = until
    if merged and merged[-1][0] < until <= merged[-1][1]:
        moment = merged[-1][0]  # the start of the doubt that holds `until`: known there, in no other interval
    first = max((s.looks[0][0] for s in statuses.values() if s.looks), default=float("-inf"))
    return moment if moment >= first else None


# Of the last LOOKS looks, at least this share must find the same rank alone behind: the counts are the ranks' own
# looks, a tenth of a second apart, so on a loaded machine a look now and then sees both level.
SHARE = 0.7


class LiveStragglers:
    """Call :meth:`look` as often as convenient; it reads the files every LOOK_S at most."""

    def __init__(self, report_dir: str | os.PathLike, looks: int | None = None, every: float = LOOK_S) -> None:
        import collections

        self.report_dir = Path(report_dir)
        self.looks = looks if looks is not None else _looks_from_env()
        self.every = every
        self.last_look: float | None = None
        self.previous: dict[int, dict[str, int]] = {}
        # the last LOOKS looks: (the one rank alone behind or None, whether that rank moved since the look before)
        self.window: collections.deque[tuple[int | None, bool]] = collections.deque(maxlen=max(self.looks, 1))
        self.announced: set[int] = set()

    def look(self, now: float) -> str | None:
        """The line logged at this look, if any. Never raises: the run's watch loop calls it, and a line that
        cannot be had is no reason to lose the run (the look is then off for the run)."""
        if self.looks <= 0 or (self.last_look is not None and now - self.last_look < self.every):
            return None
        self.last_look = now
        try:
            return self._look()
        except Exception as exc:
            log.warning("distcheck: the live straggler look failed (%s: %s); no live straggler line in this run",
                        type(exc).__name__, exc)
            self.looks = 0
            return None

    def _look(self) -> str | None:
        moment = counts_at_one_moment({rank: flight_status_file.read(path)
                                       for rank, path in files.rank_files(self.report_dir, "flight_status").items()},
                                      time.time())
        if moment is None:  # no moment in the files decides who is behind: a look that finds no one
            self.window.append((None, False))
            return None
        current, late = moment
        moved = {r for r, g in current.items() if self.previous.get(r) not in (None, g)}
        self.previous = current
        rank = next(iter(late)) if len(late) == 1 else None
        self.window.append((rank, rank is not None and rank in moved))
        if rank is None or len(self.window) < self.looks or rank in self.announced:
            return None
        count = sum(1 for r, _ in self.window if r == rank)
        moves = sum(1 for r, m in self.window if r == rank and m)
        # A rank that never moved while the others waited is stuck, not slow: the watch loop's hang, not this line.
        if count < SHARE * self.looks or moves < 2:
            return None
        self.announced.add(rank)
        others = ", ".join(str(r) for r in sorted(current) if r != rank)
        line = (f"rank {rank} is the straggler: at {count} of the last {len(self.window)} looks ({self.every:g} s "
                f"apart) it alone had not reached the collective rank{'s' if len(current) > 2 else ''} {others} "
                f"waited in, and it kept going; the report's stragglers part will say where it spends the time")
        log.warning("distcheck: %s", line)  # unprompted, amid the ranks' output: say whose line it is
        return line


def _looks_from_env() -> int:
    try:
        return int(os.environ.get(env.STRAGGLER_LOOKS, LOOKS))
    except ValueError:
        return LOOKS
