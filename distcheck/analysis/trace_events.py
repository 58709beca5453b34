"""Reading per-rank collective traces (written by distcheck.rank.tracer) into typed events.

    from distcheck.analysis.trace_events import load_rank_trace
    events = load_rank_trace("report/trace-rank0.jsonl")   # reads trace-rank0.bin next to it too

A rank's trace is two files: ``trace-rank<R>.jsonl`` (meta, one ``sig`` line per distinct call, errors, exit) and
``trace-rank<R>.bin`` (a record per collective naming a sig; contract/trace_slots.py), whose positions in their
groups' sequences are counted here (:func:`sequence_key`). ``start``/``end`` JSON lines
are read too (error ends are written that way). Pure: no process group. Tolerant of a truncated last line (a rank
killed mid-write), unwritten record slots and unknown line kinds. Where a rank is in its collectives (last started,
last completed, the one it waits on) is analysis/progress.py's, computed from these events.

A trace cut short by a full (or failing) report file system is read as the clean prefix it is, and says so in
:attr:`RankTrace.incomplete`: from the record file's header (the first collective not recorded, why, what other
files lost writes) or from the first record whose sig line was lost, where positions could no longer be counted.
The header also holds how the script ended when the exit line itself could not be written.

A big job's traces (beyond FULL_LIMIT records on a rank or TOTAL_LIMIT in all, and no rank's Flight Recorder dump
holding entries) are not made into an event per collective: :func:`load_traces` summarizes them (analysis/trace_summary.py, :attr:`RankTrace.summary`). A group's
rank list, which every sig line repeats, is parsed once per process (rank_trace._pg_tuple), and big groups are
named, not listed, in JSON (:func:`pg_json`). The types and one rank's parse are in analysis/rank_trace.py.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from distcheck.analysis import flight_recorder
from distcheck.analysis.ops import P2P_OPS
from distcheck.analysis.rank_trace import (PG_INLINE, Incomplete, RankError, RankTrace, TraceEvent, header_state,
                                           parse_lines, pg_json, rank_of_path, sequence_key)
from distcheck.contract import files
from distcheck.contract import trace_reader
from distcheck.contract import trace_slots

# One rank's types and parse live in analysis/rank_trace.py (analysis/trace_summary.py builds on them, and this
# module loads through it); every reader takes them from here.
__all__ = ["P2P_OPS", "PG_INLINE", "Incomplete", "RankError", "RankTrace", "TraceEvent", "header_state",
           "parse_lines", "pg_json", "rank_of_path", "sequence_key", "FULL_LIMIT", "TOTAL_LIMIT",
           "load_rank_records", "load_rank_trace", "load_traces"]

# A load reads every record as an event up to these sizes; beyond, its traces are summarized (TraceSummary).
FULL_LIMIT = 4096  # records of one rank
TOTAL_LIMIT = 50_000  # records of every rank together (an event each; a trace.json slice each, ~300 bytes)


def load_rank_records(path: str | os.PathLike, rank: int | None = None, merge: bool = True) -> RankTrace:
    """Events, errors, meta and exit line of one rank's trace file (empty when the file does not exist); with
    ``merge``, what its Flight Recorder dump holds beyond them (see load_traces)."""
    path = Path(path)
    rank = rank_of_path(path) if rank is None else rank
    text = trace_reader.read_lines(path)
    if text is None:
        return RankTrace(rank, [], [], {}, None)
    try:
        binary: bytes | None = trace_slots.read_records(files.rank_file(path.parent, "trace_events", rank))
    except OSError:
        binary = None
    trace = parse_lines(text.splitlines(), rank, binary)
    if merge:
        dump = flight_recorder.load_dump(path.parent, rank)
        trace.events = flight_recorder.merge(trace.events, _recorded_part(trace, dump), TraceEvent,
                                             since=float(trace.meta.get("t", 0.0)))
        trace.flight_dumped = dump is not None
        _add_graph_runs(trace, dump)
        _add_step_counts(trace, dump)
    return trace


def _add_step_counts(trace: RankTrace, dump: flight_recorder.FlightDump | None) -> None:
    """What the rank's dump counted of its steps (analysis/step_counts.py), with its last backward()'s line."""
    if dump is None or not dump.counts:
        return
    last = next((p for p in reversed(dump.phases) if p.get("kind") == "backward"), None)
    trace.step_counts = {**dump.counts, **({"backward_file": last.get("file"), "backward_line": last.get("line")}
                                           if last else {})}


def _add_graph_runs(trace: RankTrace, dump: flight_recorder.FlightDump | None) -> None:
    """The compiled collectives of the graph runs the rank's lines hold and its ring's dump does not (a rank gloo
    aborted inside a compiled graph never dumps it): with no dump, they then stand for what it would have said
    when they name all the rank can have issued untraced (:attr:`RankTrace.flight_dumped`)."""
    added, complete = flight_recorder.graph_run_events(trace.events, trace.graphs, trace.graph_runs, dump,
                                                       TraceEvent, trace.rank, since=float(trace.meta.get("t", 0.0)))
    if added:
        trace.events = flight_recorder.interleave(trace.events, added)
        trace.flight_dumped = trace.flight_dumped or (dump is None and complete)


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


def load_traces(report_dir: str | os.PathLike, summarize: bool | None = None) -> dict[int, RankTrace]:
    """Every rank's trace (``trace-rank<R>.jsonl`` and ``.bin``) of a report directory, by rank, with what the
    process group ran that Python did not call (``flight-rank<R>.json``, analysis/flight_recorder.py) merged in,
    from the first position every rank's ring still holds.

    A big job's traces (more than FULL_LIMIT records on a rank or TOTAL_LIMIT in all, and no Flight Recorder
    dump with entries: a rank whose trace held every collective its groups counted writes none) are summarized
    (:attr:`RankTrace.summary`, analysis/trace_summary.py), one rank at a time, in time and memory linear in the
    records; a later load of the same directory reads only what the ranks appended since
    (the watch loop's stop check asks every few seconds). ``summarize`` forces (True) or forbids (False) that."""
    paths = files.rank_files(report_dir, "trace")
    dumps = {rank: flight_recorder.load_dump(report_dir, rank) for rank in paths}
    if summarize is None:
        # Records in use, not the file's size: a rank's record file grows a segment at a time, and one read while
        # the rank runs (a hang, a stop) or before its tail is cut holds thousands of empty slots.
        sizes = [max(0, trace_slots.written(files.rank_file(report_dir, "trace_events", r))) for r in paths]
        # A dump without entries (every collective its groups counted was traced: flight_recorder.all_traced, or
        # an empty ring) adds nothing to its trace: an NCCL rank stored the ring's ends in its record file at the
        # dump, and a trace still waiting on the ring for more than one end per group is read whole
        # (trace_summary.RankFollower._ends_assumed).
        untraced = any(d is not None and d.entries for d in dumps.values())
        summarize = not untraced and (max(sizes, default=0) > FULL_LIMIT or sum(sizes) > TOTAL_LIMIT)
    if summarize:
        from distcheck.analysis.trace_summary import follower

        traces = follower(report_dir).load(paths)
        if traces is not None:  # None: a trace the summary cannot take (see trace_summary.RankFollower)
            for rank, trace in traces.items():
                trace.flight_dumped = dumps.get(rank) is not None
                _add_step_counts(trace, dumps.get(rank))
            return traces
    traces = {rank: load_rank_records(path, rank, merge=False) for rank, path in paths.items()}
    floor = flight_recorder.common_floor(dumps)
    for rank, trace in traces.items():
        trace.flight_dumped = dumps[rank] is not None
        trace.events = flight_recorder.merge(trace.events, _recorded_part(trace, dumps[rank]), TraceEvent,
                                             since=float(trace.meta.get("t", 0.0)), floor=floor)
        _add_graph_runs(trace, dumps[rank])
        _add_step_counts(trace, dumps[rank])
    return traces


