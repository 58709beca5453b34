"""Reading per-rank collective traces (written by distcheck.rank.tracer) into typed events.

    from distcheck.analysis.trace_events import load_rank_trace
    events = load_rank_trace("report/trace-rank0.jsonl")   # reads trace-rank0.bin next to it too

A rank's trace is two files: ``trace-rank<R>.jsonl`` (meta, one ``sig`` line per distinct call, errors, exit) and
``trace-rank<R>.bin`` (a record per collective naming a sig; contract/trace_records.py), whose positions in their
groups' sequences are counted here (:func:`sequence_key`). ``start``/``end`` JSON lines
are read too (error ends are written that way). Pure: no process group. Tolerant of a truncated last line (a rank
killed mid-write), unwritten record slots and unknown line kinds. Where a rank is in its collectives (last started,
last completed, the one it waits on) is analysis/progress.py's, computed from these events.

A trace cut short by a full (or failing) report file system is read as the clean prefix it is, and says so in
:attr:`RankTrace.incomplete`: from the record file's header (the first collective not recorded, why, what other
files lost writes) or from the first record whose sig line was lost, where positions could no longer be counted.
The header also holds how the script ended when the exit line itself could not be written.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from distcheck.analysis import flight_recorder
from distcheck.analysis.ops import P2P_OPS
from distcheck.contract import files
from distcheck.contract import trace_records as records



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
        return {"op": self.op, "seq": self.seq, "pg": list(self.pg), "shapes": self.shapes, "dtypes": self.dtypes,
                "reduce_op": self.reduce_op, "root": self.root, "peer": self.peer, "site": self.site,
                "file": self.file, "line": self.line, "completed": self.completed, "error": self.error}


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
    lost: list[str] = field(default_factory=list)  # other files that lost writes (trace_records.LOST_NAMES)

    @property
    def reason(self) -> str:
        return records.write_failure(self.errno)


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
    # called is unknown for this rank, not absent, and its untraced sequences are not compared.
    flight_dumped: bool = False


def _pg_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(int(r) for r in value)
    if isinstance(value, str) and value:
        return tuple(int(r) for r in value.split(",") if r.strip())
    return ()


def _opt_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


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


def parse_lines(lines: Iterable[str], rank: int, binary: bytes | None = None) -> RankTrace:
    """A rank's trace from its JSON lines and the bytes of its record file (``binary``; None: there is none, b"":
    there is one, but not even its header was written)."""
    starts: dict[int, TraceEvent] = {}
    order: list[TraceEvent] = []
    errors: list[RankError] = []
    meta: dict[str, Any] = {}
    sigs: dict[int, dict[str, Any]] = {}
    ends: list[dict[str, Any]] = []
    finished: dict[str, Any] | None = None
    for raw in lines:
        raw = raw.strip()
        if not raw:
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            continue  # truncated last line of a killed rank
        if not isinstance(rec, dict):
            continue
        ev = rec.get("ev")
        try:
            if ev == "sig":
                sigs[int(rec["sig"])] = rec
            elif ev == "start":
                event = _event(rank, rec, int(rec["id"]), int(rec.get("seq", 0)), float(rec.get("t", 0.0)))
                starts[event.id] = event
                order.append(event)
            elif ev == "end":
                ends.append(rec)
            elif ev == "error":
                context = rec.get("context")
                errors.append(RankError(rank, str(rec.get("exc_type", "Error")), str(rec.get("message", "")),
                                        str(rec.get("traceback", "")), rec.get("site"), rec.get("file"),
                                        _opt_int(rec.get("line")), float(rec.get("t", 0.0)),
                                        context if isinstance(context, dict) else None))
            elif ev == "meta":
                files.check_format(rec, f"the trace of rank {rank}")
                meta = rec
            elif ev == "exit":
                finished = rec
        except files.FormatError:
            raise
        except (KeyError, TypeError, ValueError):
            continue
    incomplete: Incomplete | None = None
    state = None
    if binary is not None and meta and records.read_header(binary) is None:
        incomplete = Incomplete(1, None)  # the rank ran, but not even the header could be written
    if binary:
        version = records.read_header(binary)
        if version is not None and version != files.FORMAT:
            raise files.FormatError(f"the trace records of rank {rank} have distcheck file format {version}, this "
                                    f"distcheck reads format {files.FORMAT}: read it with the distcheck version "
                                    "that wrote it")
        state = records.read_state(binary)
        if state is not None and (state.cut or state.lost):
            incomplete = Incomplete(state.cut or None, state.errno or None, state.unrecorded, state.lost_names)
        if state is not None and finished is None and state.exit:  # the exit line was lost, not the exit
            finished = {"ev": "exit", "ok": state.exit == records.EXIT_RETURNED, "code": state.code,
                        "from": "records"}
        positions: dict[Any, int] = {}  # sequence key -> events counted so far (records are in start order)
        for rec in records.iter_records(binary) if version is not None else ():
            if incomplete is not None and incomplete.from_id is not None and rec.id >= incomplete.from_id:
                break
            desc = sigs.get(rec.sig)
            if desc is None:
                # Its sig line was lost (a full disk): nothing to say about it, nor which group it counts in, so
                # no later position can be counted either. The trace ends before it.
                if incomplete is None:
                    incomplete = Incomplete(rec.id, None)
                incomplete.from_id = rec.id
                incomplete.lost = sorted(set(incomplete.lost) | {records.LOST_NAMES[records.LOST_LINES]})
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
    for rec in ends:  # JSON ends carry errors: they win over a record of the same id
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
    return RankTrace(rank, order, errors, meta, finished, incomplete, exit_recordable=state is not None)


def rank_of_path(path: str | os.PathLike) -> int:
    try:
        return files.rank_of(path, "trace")
    except ValueError:
        return 0


def load_rank_records(path: str | os.PathLike, rank: int | None = None, merge: bool = True) -> RankTrace:
    """Events, errors, meta and exit line of one rank's trace file (empty when the file does not exist); with
    ``merge``, what its Flight Recorder dump holds beyond them (see load_traces)."""
    path = Path(path)
    rank = rank_of_path(path) if rank is None else rank
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return RankTrace(rank, [], [], {}, None)
    try:
        binary: bytes | None = files.rank_file(path.parent, "trace_events", rank).read_bytes()
    except OSError:
        binary = None
    trace = parse_lines(text.splitlines(), rank, binary)
    if merge:
        trace.events = flight_recorder.merge(trace.events, _recorded_part(trace, flight_recorder.load_dump(
            path.parent, rank)), TraceEvent, since=float(trace.meta.get("t", 0.0)))
    return trace


def _recorded_part(trace: RankTrace, dump: flight_recorder.FlightDump | None) -> flight_recorder.FlightDump | None:
    """The ring entries of the time the trace still recorded: after its cut, the traced calls the ring holds would
    look untraced (issued by torch itself) and differ from the peers' traces for no reason of the script's."""
    if dump is None or trace.incomplete is None or trace.incomplete.from_id is None:
        return dump
    until = max((e.t_end or e.t_start for e in trace.events), default=0.0)
    entries = [e for e in dump.entries if int(e.get("time_created_ns") or 0) / 1e9 <= until]
    return dataclasses.replace(dump, entries=entries)


def load_rank_trace(path: str | os.PathLike, rank: int | None = None) -> list[TraceEvent]:
    """The collectives of one rank's trace file, in issue order."""
    return load_rank_records(path, rank).events


def load_traces(report_dir: str | os.PathLike) -> dict[int, RankTrace]:
    """Every rank's trace (``trace-rank<R>.jsonl`` and ``.bin``) of a report directory, by rank, with what the
    process group ran that Python did not call (``flight-rank<R>.json``, analysis/flight_recorder.py) merged in,
    from the first position every rank's ring still holds."""
    traces = {rank: load_rank_records(path, rank, merge=False)
              for rank, path in files.rank_files(report_dir, "trace").items()}
    dumps = {rank: flight_recorder.load_dump(report_dir, rank) for rank in traces}
    floor = flight_recorder.common_floor(dumps)
    for rank, trace in traces.items():
        trace.flight_dumped = dumps[rank] is not None
        trace.events = flight_recorder.merge(trace.events, _recorded_part(trace, dumps[rank]), TraceEvent,
                                             since=float(trace.meta.get("t", 0.0)), floor=floor)
    return traces
