"""Arrivals at a collective: who reached each position of a group's sequence last, and how long the others waited.

    python -m distcheck run --nproc 2 -- fixtures/straggler_data_loading.py   # trace.json's "waiting for rank 1"

The matching that the straggler analysis (analysis/stragglers.py) and the Perfetto trace's wait slices
(supervise/chrome_trace.py) share, so that both name the same late rank at the same collective. A position is a
group's key and sequence number (the same on every member); point-to-point ops and batch_isend_irecv have no group
sequence every member shares and are left out. Where every member's record is here and all of them ran on one host,
the member that started last held the others up: each waited from its own start to the last one's. Members on
several hosts compare clocks that may disagree: :func:`waits_by_start` says nothing about them. Pure.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, NamedTuple


class Arrival(NamedTuple):
    """One position every member reached, on one host's clock."""
    key: tuple  # (group key, sequence number)
    members: tuple  # the group's ranks
    events: dict  # member -> its event at this position
    waits: dict  # member -> seconds from its start to the last member's (0.0 for the last one)
    late: int  # the member the others waited for (on a tie, the higher rank)


def counted(e: Any) -> bool:
    """Whether an event takes part in the matching: a collective with a start (a record without one has no time
    to compare), not point-to-point (its pair is not a group position every member reaches)."""
    return bool(e.t_start) and not e.is_p2p and e.op != "batch_isend_irecv"


def positions(events: Mapping[int, Iterable[Any]]) -> dict[tuple, dict[int, Any]]:
    """Each rank's counted events, keyed by position: (group key, sequence number) -> rank -> event."""
    out: dict[tuple, dict[int, Any]] = {}
    for r, evs in events.items():
        for e in evs:
            if counted(e):
                out.setdefault((e.group_key, e.seq), {})[r] = e
    return out


def members_of(events: Mapping[int, Any]) -> tuple:
    """The group of a position: its events' ranks list, or (a record without one) the ranks that reached it."""
    return next(iter(events.values())).pg or tuple(sorted(events))


def waits_by_start(members: tuple, events: Mapping[int, Any], hosts: Mapping[int, Any]) -> dict[int, float] | None:
    """Each member's wait for the last one, from their starts; None unless every member's record is here, on one
    host's clock."""
    if any(m not in events for m in members) or len({hosts.get(m) for m in members}) > 1:
        return None
    last = max(events[m].t_start for m in members)
    return {m: last - events[m].t_start for m in members}


def late_member(members: tuple, waits: Mapping[int, float]) -> int:
    """The member the others waited for: its wait is exactly 0.0 (last minus its own start); a tie, the higher."""
    return max(m for m in members if waits[m] == 0.0)


def arrivals(events: Mapping[int, Iterable[Any]], hosts: Mapping[int, Any]) -> Iterator[Arrival]:
    """Every position of a group of two or more that all its members reached on one host, in no set order.
    ``events``: each rank's events; ``hosts``: each rank's host (its trace's meta), None where unknown."""
    for key, at in positions(events).items():
        members = members_of(at)
        if len(members) < 2:
            continue
        waits = waits_by_start(members, at, hosts)
        if waits is not None:
            yield Arrival(key, members, at, waits, late_member(members, waits))
