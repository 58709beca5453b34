"""One rank's collectives per sequence (a process group's traced or untraced ones), by position; how messages name
a group, a line and a trace cut short.

    from distcheck.analysis.group_sequences import collectives_by_group
    groups = collectives_by_group(load_traces("report"))    # {TraceEvent.group_key: GroupSequence}

    python -m pytest -q tests/unit/test_trace_align.py tests/unit/test_scale_traces.py

The alignment (analysis/trace_align.py) and the stop rule (analysis/stop_rule.py) walk the same sequences: a list of
every event of a rank, or a summarized trace's count with the events it kept, read back on demand
(analysis/trace_summary.py). Pure: no process group, no file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.progress import process_group
from distcheck.analysis.trace_events import RankTrace, TraceEvent
from distcheck.contract.findings import SMALL_WORLD, rank_ranges

WINDOW = 4  # positions read back at once from a summarized trace (trace_summary.TraceSummary.events_at)


class RankSequence:
    """One rank's collectives in one sequence, by position (0-based): a list of every event, or a summarized
    trace's count with the events it kept and reads back on demand."""

    def __init__(self, key: str, events: list[TraceEvent], trace: RankTrace | None = None) -> None:
        self.key = key
        self.trace = trace
        self.summary = trace.summary if trace is not None and not key.startswith("untraced:") else None
        seq = self.summary.sequences.get(key) if self.summary is not None else None
        if self.summary is None or seq is None:
            self.summary = None
            self.events = {i: e for i, e in enumerate(events)}
            self.count = len(events)
            self.start = 0  # nothing known: compare from the first position
        else:
            self.events = {e.seq - 1: e for e in events}
            self.count = seq.count
            self.start = seq.count if seq.first_difference is None else seq.first_difference

    def __len__(self) -> int:
        return self.count

    def at(self, i: int) -> TraceEvent:
        e = self.events.get(i)
        if e is None:
            if self.summary is None or not 0 <= i < self.count:
                raise IndexError(i)
            self.events.update(self.summary.events_at(self.key, i, i + WINDOW))
            e = self.events[i]
        return e

    def last(self) -> TraceEvent | None:
        return self.at(self.count - 1) if self.count else None


@dataclass
class GroupSequence:
    """One sequence of positions: a process group's traced collectives, or its untraced ones (TraceEvent.group_key
    keeps those apart: they are numbered by torch, the traced ones by the tracer)."""

    members: tuple[int, ...]
    group: str  # the process group (analysis/progress.process_group), traced and untraced alike
    per_rank: dict[int, RankSequence]

    def start(self, members: Sequence[int]) -> int:
        """The first position where members may disagree or one has ended: before it every member issued the same
        (summarized traces say so, trace_summary.Aligner); 0 when a member's trace is not summarized."""
        empty = RankSequence(self.group, [])
        return min((min(s.start, s.count) for s in (self.per_rank.get(r, empty) for r in members)), default=0)


def collectives_by_group(traces: dict[int, RankTrace]) -> dict[str, GroupSequence]:
    lists: dict[str, dict[int, list[TraceEvent]]] = {}
    groups: dict[str, GroupSequence] = {}
    for rank, trace in traces.items():
        for e in trace.events:
            if e.op in PEER_OPS:
                continue
            seq = groups.get(e.group_key)
            if seq is None:
                seq = groups[e.group_key] = GroupSequence(e.pg, process_group(e), {})
            lists.setdefault(e.group_key, {}).setdefault(rank, []).append(e)
    for key, per_rank in lists.items():
        for rank, events in per_rank.items():
            events.sort(key=lambda e: (e.seq, e.id))
            groups[key].per_rank[rank] = RankSequence(key, events, traces[rank])
    return groups


def trace_cut(trace: RankTrace | None) -> bool:
    """The trace stops before the rank's last collective (a full report file system)."""
    return trace is not None and trace.incomplete is not None and trace.incomplete.from_id is not None


def cut_note(trace: RankTrace | None) -> str:
    """What a position taken from a cut trace needs said: it may be far behind where the rank really got."""
    if not trace_cut(trace):
        return ""
    return f" (its trace stops before its collective #{trace.incomplete.from_id}: {trace.incomplete.reason})"


def at_site(e: TraceEvent) -> str:
    return f" at {e.site}" if e.site else ""


def group_label(group: Sequence[int] | None) -> str:
    """``[0,1]``; a big group as its rank ranges, ``[0-4095]`` (a 4096-rank list in every sentence otherwise)."""
    if group is not None and len(group) > SMALL_WORLD:
        return "[" + rank_ranges(group) + "]"
    return "[" + ",".join(map(str, group or ())) + "]"
