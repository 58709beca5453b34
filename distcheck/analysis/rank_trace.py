"""One rank's collective trace as typed events: the records, the JSON lines' parse, the header's state.

    from distcheck.analysis.rank_trace import parse_lines
    from distcheck.contract import trace_reader, trace_slots
    lines = trace_reader.read_lines("report/trace-rank0.jsonl").splitlines()
    trace = parse_lines(lines, 0, trace_slots.read_records("report/trace-rank0.bin"))

The types and the parse of one rank's files, as contract/ read them (analysis/trace_events.py documents the format
and loads a report directory; analysis/trace_summary.py summarizes big jobs' traces). Pure: no process group, no
file opened here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from distcheck.analysis.ops import P2P_OPS
from distcheck.contract import files, trace_lines
from distcheck.contract import trace_slots


@dataclass
class TraceEvent:
    rank: int
    id: int
    seq: int
    pg: tuple[int, ...]  # global ranks of the process group
    op: str
    shapes: list[list[int]]
    dtypes: list[str]
    reduce_op: str | None
    peer: int | None  # the other rank of a point-to-point op
    site: str | None  # "train.py:88", the user's call site
    file: str | None
    line: int | None
    t_start: float
    t_end: float | None  # None: started, never completed
    pg_name: str | None = None
    root: int | None = None  # src/dst of a rooted collective, as a global rank
    error: str | None = None  # the exception the call raised or its Work failed with
    issued_only: bool = False  # end means "issued" (functional collectives), not "completed"
    extra: dict[str, Any] = field(default_factory=dict)  # uneven, p2p, objects, api

    @property
    def completed(self) -> bool:
        return self.t_end is not None

    @property
    def group_key(self) -> str:
        """Events of the same process group share this key on every rank. What the tracer did not see (DDP,
        compiled graphs: analysis/flight_recorder.py) counts in a sequence of its own per group."""
        key = self.pg_name or ",".join(map(str, self.pg))
        return f"untraced:{key}" if self.extra.get("untraced") else key

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    def brief(self) -> str:
        """``all_reduce [1024] float32 SUM`` for messages."""
        parts = [self.op]
        if self.shapes:
            parts.append(" ".join(str(list(s)) for s in self.shapes[:4]) + (" ..." if len(self.shapes) > 4 else ""))
        if self.dtypes:
            parts.append("/".join(sorted(set(self.dtypes))))
        if self.reduce_op:
            parts.append(self.reduce_op)
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "seq": self.seq, **pg_json(self.pg, self.pg_name), "shapes": self.shapes,
                "dtypes": self.dtypes, "reduce_op": self.reduce_op, "root": self.root, "peer": self.peer,
                "site": self.site, "file": self.file, "line": self.line, "completed": self.completed,
                "error": self.error}


PG_INLINE = 64  # a group of more ranks is named, not listed, in every collective's JSON (report.json, stacks.json)


def pg_json(pg: Any, name: str | None = None) -> dict[str, Any]:
    """A collective's group for JSON: ``{"pg": [0, 1]}``; a big one (a 4096-rank world) as ``{"pg": None,
    "pg_name": "0", "pg_size": 4096}``: its ranks are listed once per finding, not once per rank and collective."""
    if pg is None or len(pg) <= PG_INLINE:
        return {"pg": list(pg) if pg is not None else None}
    return {"pg": None, "pg_name": name, "pg_size": len(pg)}


@dataclass
class RankError:
    """An ``{"ev": "error"}`` line: the script raised (or the rank got a signal) in this rank."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    site: str | None
    file: str | None
    line: int | None
    t: float
    context: dict[str, Any] | None = None  # what the rank knew, for analysis/torch_errors.translate


@dataclass
class Incomplete:
    """What a rank could not write into the report directory (a full or failing file system)."""

    from_id: int | None  # the first collective (its slot: the rank's n-th) not recorded; None: the trace is whole
    errno: int | None  # the first write error, when known
    unrecorded: int = 0  # collectives the rank issued after from_id (counted, not recorded)
    lost: list[str] = field(default_factory=list)  # other files that lost writes (trace_slots.LOST_NAMES)

    @property
    def reason(self) -> str:
        return trace_slots.write_failure(self.errno)


@dataclass
class RankTrace:
    rank: int
    events: list[TraceEvent]
    errors: list[RankError]
    meta: dict[str, Any]
    finished: dict[str, Any] | None  # the {"ev": "exit"} line, when the script returned or raised
    incomplete: Incomplete | None = None  # what the rank could not write (None: nothing lost)
    # The record file has its header, which holds the exit even when the exit line was lost: a trace without
    # either ended before its script did. False: no record file, or not even its first page could be written.
    exit_recordable: bool = False
    # Whether its Flight Recorder ring was dumped (analysis/flight_recorder.py): without one, what Python never
    # called is unknown for this rank, not absent, and its untraced sequences are not compared. Also True for a
    # rank without one whose compiled graphs' run lines name all it can have issued untraced (no DDP model).
    flight_dumped: bool = False
    # A big job's trace is summarized (load_traces; analysis/trace_summary.py): ``events`` then holds only the
    # collectives every question needs (the last ones, each group's last and first open, the first open, the last
    # completed, failed ones, point-to-point ops), and the counts and per-group sequences are here (None: ``events``
    # is every collective).
    summary: Any = None  # analysis/trace_summary.TraceSummary
    # Compiled graphs' ``graph`` lines by graph id, and each ``graph_run`` line (GraphRun: graph id, time, a dynamic
    # graph's size symbols' values, a DDP rank's group counters): what the rank's compiled collectives are known by
    # when its ring was not dumped (analysis/flight_recorder.graph_run_events).
    graphs: dict[int, dict[str, Any]] = field(default_factory=dict)
    graph_runs: list[GraphRun] = field(default_factory=list)
    # From its Flight Recorder dump: how many backward(), DDP forwards and optimizer.step() it ran, and the lines of
    # its last backward() (analysis/step_counts.py); empty without a dump
    step_counts: dict[str, Any] = field(default_factory=dict)


_GROUPS: dict[str, tuple[int, ...]] = {}  # "0,1,...": its ranks, parsed once per process (a group's string is long)
_GROUPS_LIMIT = 4096
_PG_STRINGS: dict[str, str] = {}


def _pg_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(int(r) for r in value)
    if isinstance(value, str) and value:
        hit = _GROUPS.get(value)
        if hit is None:
            if len(_GROUPS) >= _GROUPS_LIMIT:
                _GROUPS.clear()
            hit = _GROUPS[value] = tuple(int(r) for r in value.split(",") if r.strip())
        return hit
    return ()


def _opt_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


_NO_SIZES: dict[str, int] = {}  # a static graph's runs share it (a long compiled loop writes a line per step)


class GraphRun(NamedTuple):
    """One ``graph_run`` line: a run of a compiled graph (rank/flight_recorder.GraphLines), before it issued
    anything."""

    graph: int  # the graph's id (its ``graph`` line)
    t: float
    sizes: dict[str, int] = _NO_SIZES  # a dynamic graph's size symbols' values in this run
    # {group name: collectives the group had enqueued before the run}, on a rank with a DDP model (whose bucket
    # all-reduces no line names): what numbers the run's collectives as the ring does (collective_seq_id)
    seq: dict[str, int] = _NO_SIZES
_KNOWN = frozenset({"ev", "id", "seq", "pg", "pg_name", "op", "shapes", "dtypes", "reduce_op", "peer", "root",
                    "site", "file", "line", "t", "sig"})


def sequence_key(desc: dict[str, Any], rank: int) -> Any:
    """What a collective's position (``seq``) counts in: collectives count per process group, point-to-point ops
    per (sender, receiver), batch_isend_irecv per group on its own (it is paired per send/receive, not by position).
    ``desc`` is the call's sig line."""
    op = desc["op"]
    if op in P2P_OPS:
        peer = desc.get("peer")
        sending = op.startswith(("send", "isend"))
        return ("p2p", desc.get("pg"), rank if sending else peer, peer if sending else rank)
    if op == "batch_isend_irecv":
        return ("p2p-batch", desc.get("pg"))
    return desc.get("pg_name") or desc.get("pg")


def _event(rank: int, desc: dict[str, Any], eid: int, seq: int, t: float) -> TraceEvent:
    """A started collective from its description (a sig or start line) and its id, sequence number and time."""
    return TraceEvent(
        rank=rank, id=eid, seq=seq, pg=_pg_tuple(desc.get("pg")), op=str(desc["op"]),
        shapes=[list(s) for s in desc.get("shapes") or []], dtypes=[str(d) for d in desc.get("dtypes") or []],
        reduce_op=desc.get("reduce_op"), peer=_opt_int(desc.get("peer")), site=desc.get("site"),
        file=desc.get("file"), line=_opt_int(desc.get("line")), t_start=t, t_end=None, pg_name=desc.get("pg_name"),
        root=_opt_int(desc.get("root")), extra={k: v for k, v in desc.items() if k not in _KNOWN})


@dataclass
class _Lines:
    """What a rank's JSON lines say."""

    starts: dict[int, TraceEvent]
    order: list[TraceEvent]
    errors: list[RankError]
    meta: dict[str, Any]
    sigs: dict[int, dict[str, Any]]
    ends: list[dict[str, Any]]
    finished: dict[str, Any] | None
    graphs: dict[int, dict[str, Any]] = field(default_factory=dict)
    graph_runs: list[GraphRun] = field(default_factory=list)


def _read_lines(lines: Iterable[str | bytes], rank: int, out: _Lines | None = None) -> _Lines:
    """The JSON lines' records, added to ``out`` (a follower's, which reads a file's new lines at each poll)."""
    out = out if out is not None else _Lines({}, [], [], {}, {}, [], None)
    for rec in trace_lines.read_records(lines):
        ev = rec.get("ev")
        try:
            if ev == trace_lines.SIG:
                pg = rec.get("pg")
                if isinstance(pg, str):  # one copy of a group's (long) rank string for every rank and sig
                    rec["pg"] = _PG_STRINGS.setdefault(pg, pg) if len(_PG_STRINGS) < _GROUPS_LIMIT else pg
                out.sigs[int(rec["sig"])] = rec
            elif ev == trace_lines.START:
                event = _event(rank, rec, int(rec["id"]), int(rec.get("seq", 0)), float(rec.get("t", 0.0)))
                out.starts[event.id] = event
                out.order.append(event)
            elif ev == trace_lines.END:
                out.ends.append(rec)
            elif ev == trace_lines.GRAPH_RUN:
                sizes, seq = rec.get("sizes"), rec.get("seq")
                out.graph_runs.append(GraphRun(
                    int(rec["graph"]), float(rec["t"]),
                    {str(k): int(v) for k, v in sizes.items()} if isinstance(sizes, dict) else _NO_SIZES,
                    {str(k): int(v) for k, v in seq.items()} if isinstance(seq, dict) else _NO_SIZES))
            elif ev == trace_lines.GRAPH:
                out.graphs[int(rec["graph"])] = rec
            elif ev == trace_lines.ERROR:
                context = rec.get("context")
                out.errors.append(RankError(rank, str(rec.get("exc_type", "Error")), str(rec.get("message", "")),
                                            str(rec.get("traceback", "")), rec.get("site"), rec.get("file"),
                                            _opt_int(rec.get("line")), float(rec.get("t", 0.0)),
                                            context if isinstance(context, dict) else None))
            elif ev == trace_lines.META:
                files.check_format(rec, f"the trace of rank {rank}")
                out.meta = rec
            elif ev == trace_lines.EXIT:
                out.finished = rec
        except files.FormatError:
            raise
        except (KeyError, TypeError, ValueError):
            continue
    return out


def parse_lines(lines: Iterable[str], rank: int, binary: bytes | None = None) -> RankTrace:
    """A rank's trace from its JSON lines and the bytes of its record file (``binary``; None: there is none, b"":
    there is one, but not even its header was written)."""
    parsed = _read_lines(lines, rank)
    starts, order = parsed.starts, parsed.order
    incomplete, finished, state = header_state(binary, rank, parsed)
    if binary and trace_slots.read_header(binary) is not None:
        incomplete = _read_all(rank, binary, parsed.sigs, incomplete, starts, order)
    for rec in parsed.ends:  # JSON ends carry errors: they win over a record of the same id
        try:
            event = starts.get(int(rec["id"]))
            if event is not None:
                event.t_end = float(rec.get("t", 0.0))
                event.error = rec.get("error")
                event.issued_only = bool(rec.get("issued", False))
        except (KeyError, TypeError, ValueError):
            continue
    if binary and len(order) > 1:
        order.sort(key=lambda e: e.id)  # JSON start lines (if any) and records share one id counter
    return RankTrace(rank, order, parsed.errors, parsed.meta, finished, incomplete,
                     exit_recordable=state is not None, graphs=parsed.graphs, graph_runs=parsed.graph_runs)


def header_state(binary: bytes | None, rank: int, parsed: _Lines
                 ) -> tuple[Incomplete | None, dict[str, Any] | None, trace_slots.HeaderState | None]:
    """What the record file's header says (``binary``: the file's bytes, its first slot at least): what the rank
    could not write, its exit line (from the header when the line was lost) and the header's state."""
    incomplete: Incomplete | None = None
    finished = parsed.finished
    state = None
    if binary is not None and parsed.meta and trace_slots.read_header(binary) is None:
        incomplete = Incomplete(1, None)  # the rank ran, but not even the header could be written
    if binary:
        version = trace_slots.read_header(binary)
        if version is not None and version != files.FORMAT:
            raise files.FormatError(f"the trace records of rank {rank} have distcheck file format {version}, this "
                                    f"distcheck reads format {files.FORMAT}: read it with the distcheck version "
                                    "that wrote it")
        state = trace_slots.read_state(binary)
        if state is not None and (state.cut or state.lost):
            incomplete = Incomplete(state.cut or None, state.errno or None, state.unrecorded, state.lost_names)
        if state is not None and finished is None and state.exit:  # the exit line was lost, not the exit
            finished = {"ev": "exit", "ok": state.exit == trace_slots.EXIT_RETURNED, "code": state.code,
                        "from": "records"}
    return incomplete, finished, state


def _lost_sig(incomplete: Incomplete | None, slot: int) -> Incomplete:
    """A record whose sig line was lost (a full disk): nothing to say about it, nor which group it counts in, so
    no later position can be counted either. The trace ends before it."""
    if incomplete is None:
        incomplete = Incomplete(slot, None)
    incomplete.from_id = slot
    incomplete.lost = sorted(set(incomplete.lost) | {trace_slots.LOST_NAMES[trace_slots.LOST_LINES]})
    return incomplete


def _read_all(rank: int, binary: bytes, sigs: dict[int, dict[str, Any]], incomplete: Incomplete | None,
              starts: dict[int, TraceEvent], order: list[TraceEvent]) -> Incomplete | None:
    """Every record as an event (a short trace)."""
    positions: dict[Any, int] = {}  # sequence key -> events counted so far (records are in start order)
    for rec in trace_slots.iter_slots(binary):
        if incomplete is not None and incomplete.from_id is not None and rec.id >= incomplete.from_id:
            break
        desc = sigs.get(rec.sig)
        if desc is None:
            incomplete = _lost_sig(incomplete, rec.id)
            break
        try:
            key = sequence_key(desc, rank)
            seq = positions[key] = positions.get(key, 0) + 1
            event = _event(rank, desc, rec.id, seq, rec.t)
        except (KeyError, TypeError, ValueError):
            continue
        event.t_end = rec.t_end
        event.issued_only = rec.issued and rec.t_end is not None
        starts[rec.id] = event
        order.append(event)
    return incomplete


def rank_of_path(path: str | os.PathLike) -> int:
    try:
        return files.rank_of(path, "trace")
    except ValueError:
        return 0
