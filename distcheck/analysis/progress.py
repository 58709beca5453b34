"""The one model of a rank's progress through its collectives, computed once per rank from its trace. Pure.

    from distcheck.analysis.progress import rank_progress
    p = rank_progress(0, load_rank_trace("report/trace-rank0.jsonl"))
    p.pending, p.last_started, p.last_completed, p.groups["0,1"].issued

Every question "where is this rank" is answered here and nowhere else: the hang diagnosis (analysis/hang.py),
stacks.txt/stacks.json (supervise/stacks.py), the trace alignment's findings and positions
(analysis/trace_align.py), the translation of torch's errors (analysis/torch_errors.py) and the run report
(supervise/run_report.py). The definitions:

* **Issue order** is the order of the events' record ``id`` within one rank: the tracer takes the id from one
  per-rank counter when the call is made, before the backend sees it. "First" and "last" below always mean issue
  order, never time: an async op (and every NCCL op) returns once queued, later ones are issued, and even
  complete, behind it, so end times say nothing about which collective a rank is stuck on.
* An event **ended** when ``t_end is not None`` (:attr:`TraceEvent.completed`). An ended event *completed*
  (no ``error``), *failed* (``error`` set: the call raised, or its Work failed), or, for a functional collective
  (``issued_only``), was only *issued*: its end says the call returned an AsyncCollectiveTensor, and whether the
  backend ever completed it is not traced. Issued-only events are counted with the completed ones (the host went
  on past them) but are flagged, and every text says "only known issued".
* ``last_started``: the last collective issued (ended or not). ``last_completed``: the last issued that ended
  without an error. ``last_failed``: the last that ended with an error, the collective a rank's exception came
  out of. ``first_open`` (:attr:`RankProgress.pending`): the first issued that has not ended, the collective
  the rank waits on; it differs from ``last_completed``'s successor when an async op is still pending behind a
  later one that completed.
* Counts: ``started`` (every event), ``completed`` (ended without error, issued-only included), ``failed``,
  ``issued_only`` and the open events themselves (``open``, in issue order).
* Per process group (``groups``, keyed by :func:`process_group`): how many collectives the rank issued on it
  (``issued``), of them how many the tracer did not see (``untraced``: DDP's buckets, compiled graphs, merged from
  torch's Flight Recorder by analysis/flight_recorder.py) and how many completed, its last one and the one it
  waits on there. Only collectives that align by position count: point-to-point ops pair per (sender, receiver)
  and batch_isend_irecv per item, so they appear in the rank's totals but in no group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.trace_events import RankTrace, TraceEvent
from distcheck.contract.site import base_name, file_line

PENDING, COMPLETED, FAILED, ISSUED = "pending", "completed", "failed", "issued"
ISSUED_NOTE = "functional: only known issued, its completion is not traced"


def process_group(e: TraceEvent) -> str:
    """The process group a collective ran on, the same key on every rank. Unlike :attr:`TraceEvent.group_key`,
    which keeps a group's untraced collectives in a sequence of their own (torch numbers them, not the tracer),
    traced and untraced collectives of one group share it: a rank's count on a group is all it issued there."""
    return e.pg_name or ",".join(map(str, e.pg))


# A group's ranks as the one list every ref of it shares, by the id of the (interned: rank_trace._pg_tuple)
# tuple, which the entry keeps alive: hashing a 4096-rank tuple per ref would cost more than the list.
_LISTS: dict[int, tuple[tuple[int, ...], list[int]]] = {}


def _ranks_list(pg: tuple[int, ...]) -> list[int]:
    """The ranks of a group as a list shared by every ref (readers never change it): a 4096-rank job's refs hold
    one list per group, not one per rank and ref."""
    hit = _LISTS.get(id(pg))
    if hit is None or hit[0] is not pg:
        if len(_LISTS) >= 4096:
            _LISTS.clear()
        hit = _LISTS[id(pg)] = (pg, list(pg))
    return hit[1]


@dataclass
class CollectiveRef:
    """One traced collective as progress reports it (JSON round-trips through stacks.json and report.json).

    ``event`` is the trace event it was made from, for callers that need all of it (shapes, the JSON of the
    trace); it is None for a ref read back from JSON."""

    op: str
    seq: int | None
    pg: list[int] | None  # ranks of the process group; None: not known (the default group's trace of old)
    site: str  # "train.py:88"
    file: str
    line: int
    id: int | None = None
    completed: bool = False  # ended: t_end is not None (completed, failed or issued)
    error: str | None = None
    issued_only: bool = False
    group: str | None = None  # process_group(event)
    event: TraceEvent | None = field(default=None, compare=False, repr=False)
    via: str | None = None  # who issued one Python never called (analysis/flight_recorder.py), or the library call

    @classmethod
    def from_event(cls, e: TraceEvent) -> CollectiveRef:
        file = e.file or ""
        line = e.line or 0
        site = e.site or file_line(file, line) or (base_name(file) if file else "")
        # The group's ranks are shared with the event (a 4096-rank group is one tuple, not one list per ref).
        return cls(e.op, e.seq, _ranks_list(e.pg) if e.pg else None, site, file, line, e.id, e.t_end is not None,
                   e.error, e.issued_only, process_group(e), e, e.extra.get("via"))

    @property
    def state(self) -> str:
        """pending | completed | failed | issued (see the module docstring)."""
        if not self.completed:
            return PENDING
        if self.error is not None:
            return FAILED
        return ISSUED if self.issued_only else COMPLETED

    def text(self) -> str:
        """``all_reduce #57 (train.py:88)``, plus what is known of its end when that is not plain completion."""
        seq = f" #{self.seq}" if self.seq is not None else ""
        where = f" ({self.via} at {self.site})" if self.via and self.site else f" ({self.site})" if self.site else ""
        note = {PENDING: " PENDING", FAILED: " FAILED", ISSUED: f" ({ISSUED_NOTE})"}.get(self.state, "")
        return f"{self.op}{seq}{where}{note}"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "seq": self.seq, "pg": self.pg, "site": self.site, "file": self.file,
                "line": self.line, "id": self.id, "completed": self.completed, "state": self.state,
                "error": self.error, "issued_only": self.issued_only, "group": self.group, "via": self.via}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CollectiveRef:
        return cls(d.get("op", "?"), d.get("seq"), d.get("pg"), d.get("site", ""), d.get("file", ""),
                   int(d.get("line") or 0), d.get("id"), bool(d.get("completed", False)), d.get("error"),
                   bool(d.get("issued_only", False)), d.get("group"), via=d.get("via"))


@dataclass
class GroupProgress:
    """A rank's position in one process group's sequence of collectives."""

    key: str  # process_group()
    pg: list[int] | None
    issued: int = 0  # collectives this rank issued on the group, traced or not
    completed: int = 0  # of those, ended without an error (issued-only included)
    untraced: int = 0  # of those, merged from the Flight Recorder (extra["untraced"])
    last: CollectiveRef | None = None
    first_open: CollectiveRef | None = None

    def to_json(self) -> dict[str, Any]:
        # Counts and positions only: this goes into report.json once per rank and group (thousands of ranks on a
        # big job); the rank's own refs (last started, first open) carry the full description.
        return {"pg": self.pg, "issued": self.issued, "completed": self.completed, "untraced": self.untraced,
                "last_seq": self.last.seq if self.last else None,
                "first_open_seq": self.first_open.seq if self.first_open else None}

    @classmethod
    def from_json(cls, key: str, d: dict[str, Any]) -> GroupProgress:
        """Counts back from :meth:`to_json` (its refs are not kept there, so ``last`` and ``first_open`` are None)."""
        return cls(key, d.get("pg"), int(d.get("issued", 0)), int(d.get("completed", 0)), int(d.get("untraced", 0)))


@dataclass
class RankProgress:
    """Where one rank is in its collectives (the definitions are the module docstring's)."""

    rank: int
    last_started: CollectiveRef | None = None
    last_completed: CollectiveRef | None = None
    started: int = 0
    completed: int = 0
    first_open: CollectiveRef | None = None  # the first issued that has not ended: what the rank waits on
    last_failed: CollectiveRef | None = None
    failed: int = 0
    issued_only: int = 0
    open: list[CollectiveRef] = field(default_factory=list)  # every event not ended, in issue order
    groups: dict[str, GroupProgress] = field(default_factory=dict)
    # How many have not ended, where ``open`` holds only some of them (a summarized trace: its first open one and
    # each group's); None: len(open).
    open_count: int | None = None

    @property
    def pending(self) -> CollectiveRef | None:
        """The collective this rank waits on, if any: the first one it issued that has not ended.

        A progress read back from an older stacks.json, or made by hand, may lack ``first_open``: then a last
        collective that has not ended is the one."""
        if self.first_open is not None:
            return self.first_open
        if self.last_started is not None and not self.last_started.completed:
            return self.last_started
        return None

    def issued_on(self, group: str) -> int:
        """How many collectives this rank issued on a process group (:func:`process_group`; 0 for one it never
        used)."""
        g = self.groups.get(group)
        return g.issued if g is not None else 0

    def to_json(self) -> dict[str, Any]:
        def ref(r: CollectiveRef | None) -> dict[str, Any] | None:
            return r.to_json() if r is not None else None

        return {"last_started": ref(self.last_started), "last_completed": ref(self.last_completed),
                "first_open": ref(self.first_open), "last_failed": ref(self.last_failed),
                "started": self.started, "completed": self.completed, "failed": self.failed,
                "issued_only": self.issued_only,
                "open": len(self.open) if self.open_count is None else self.open_count,
                "groups": {k: g.to_json() for k, g in self.groups.items()}}

    @classmethod
    def from_json(cls, rank: int, d: dict[str, Any]) -> RankProgress:
        def ref(key: str) -> CollectiveRef | None:
            return CollectiveRef.from_json(d[key]) if d.get(key) else None

        groups = d.get("groups") if isinstance(d.get("groups"), dict) else {}
        # Only the count of open events travels; the first of them is the one every reader needs.
        first = ref("first_open")
        return cls(rank, ref("last_started"), ref("last_completed"), int(d.get("started", 0)),
                   int(d.get("completed", 0)), first, ref("last_failed"), int(d.get("failed", 0)),
                   int(d.get("issued_only", 0)), [first] if first is not None else [],
                   {str(k): GroupProgress.from_json(str(k), g) for k, g in groups.items()},
                open_count=int(d.get("open", 0)) if isinstance(d.get("open"), int) else None)


def rank_progress(rank: int, events: Iterable[TraceEvent]) -> RankProgress:
    """A rank's progress from its trace events (any order: issue order is re-established from the ids)."""
    ordered = sorted(events, key=lambda e: e.id)
    p = RankProgress(rank, started=len(ordered))
    for e in ordered:
        ref = CollectiveRef.from_event(e)
        p.last_started = ref
        group = None
        if e.op not in PEER_OPS:
            key = process_group(e)
            group = p.groups.get(key)
            if group is None:
                group = p.groups[key] = GroupProgress(key, _ranks_list(e.pg) if e.pg else None)
            group.issued += 1
            group.untraced += bool(e.extra.get("untraced"))
            group.last = ref
        state = ref.state
        if state == PENDING:
            p.open.append(ref)
            if p.first_open is None:
                p.first_open = ref
            if group is not None and group.first_open is None:
                group.first_open = ref
        elif state == FAILED:
            p.failed += 1
            p.last_failed = ref
        else:
            p.completed += 1
            p.issued_only += state == ISSUED
            p.last_completed = ref
            if group is not None:
                group.completed += 1
    return p


def progress_of(rank: int, trace: RankTrace) -> RankProgress:
    """A rank's progress from its trace. A summarized trace (RankTrace.summary) keeps every event a reference here
    needs (its last, last completed, first open, each group's last and first open, its failed ones), so those come
    from its events as for any trace, and the counts from the summary."""
    p = rank_progress(rank, trace.events)
    s = trace.summary
    if s is None:
        return p
    p.started, p.completed, p.failed, p.issued_only, p.open_count = (s.started, s.completed, s.failed,
                                                                     s.issued_only, s.open)
    for key, g in p.groups.items():
        seq = s.sequences.get(key)
        if seq is not None:
            g.issued, g.completed = seq.count, seq.completed
    return p


def progress_by_rank(traces: Mapping[int, RankTrace]) -> dict[int, RankProgress]:
    """Every traced rank's progress, by rank."""
    return {rank: progress_of(rank, trace) for rank, trace in traces.items()}


def group_counts(progress: Mapping[int, RankProgress], group: str, ranks: Sequence[int]) -> dict[int, int]:
    """How many collectives each of ``ranks`` issued on a process group (:func:`process_group`)."""
    return {r: (progress[r].issued_on(group) if r in progress else 0) for r in ranks}
