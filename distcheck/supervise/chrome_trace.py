"""Chrome / Perfetto trace of collectives: one row per rank, one slice per collective.

    python -m distcheck run --nproc 2 -- train.py    # writes <report_dir>/trace.json; open it in ui.perfetto.dev

Uses the Trace Event Format's "X" (complete) events, which chrome://tracing and Perfetto both read. A collective
that never completed is drawn up to the end of the trace and named "(never completed)", so a hang is visible as
the slice that runs off the end of its rank's row.

Inside each collective's slice, a rank that arrived before the last member of its group has a child slice
"waiting for rank <R>" (cat "wait") from its own start to the last one's: the straggler is the row without them,
and every other row shows how long it waited. The positions compared are analysis/arrivals.py's, the same as the
report's stragglers part: every member reached it, on one host's clock (several hosts' clocks may disagree, so a
position spanning hosts has no wait slices). A collective whose recorded end is not its completion (a functional
collective's issue; on gloo, whose ring has no completion times, DDP's buckets and broadcasts) would be a
zero-length slice with no room for its wait: it completed no earlier than the last member's start, so its slice is
drawn up to there (args "end" says so), never into the row's next slice, since slices on a row must nest. A wait is
clipped to its collective's slice ("clipped" in its args) and a zero one is not drawn; at most one per rank per
collective, so the file at most doubles.

A big job's summarized traces (analysis/trace_events.TraceSummary) draw only what the analysis looked at: each
rank's last collectives, the first it waits on, each group's last one, and the positions around the first
divergence. The file says so in its ``otherData``; every collective is in the per-rank trace files.
"""
from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

from distcheck.analysis.arrivals import arrivals
from distcheck.analysis.trace_events import PG_INLINE, RankTrace
from distcheck.contract.report import atomic_write


def drawn(trace: RankTrace) -> list:
    """The events of a rank the Chrome trace draws: every one, or a summarized trace's kept and read-back ones."""
    if trace.summary is None or not trace.summary.read:
        return trace.events
    seen = {id(e) for e in trace.events}
    return sorted([*trace.events, *(e for e in trace.summary.read.values() if id(e) not in seen)], key=lambda e: e.id)


def chrome_events(traces: dict[int, RankTrace], end_time: float | None = None) -> list[dict[str, Any]]:
    """``end_time``: when the run ended (open collectives are drawn up to it); default: the last timestamp."""
    events = {rank: drawn(t) for rank, t in traces.items()}
    starts = [e.t_start for evs in events.values() for e in evs]
    if not starts:
        return []
    t0 = min(starts)
    t_last = max([e.t_end or e.t_start for evs in events.values() for e in evs]
                 + [err.t for t in traces.values() for err in t.errors] + [end_time or 0.0])

    def ns(t: float) -> int:
        # whole nanoseconds, so that a child's end and its parent's (and the next slice's start) compare exactly
        return round((t - t0) * 1e9)

    waits = _waits(traces, events)
    out: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        row = sorted(ns(e.t_start) for e in events[rank])
        for e in events[rank]:
            end = e.t_end if e.t_end is not None else t_last
            name = e.op if e.t_end is not None else f"{e.op} (never completed)"
            start_ns = ns(e.t_start)
            end_ns = max(ns(end), start_ns)
            wait = waits.get(id(e))
            stretched = False
            if wait is not None and wait[0] != rank and e.t_end is not None and _end_stands_in(e):
                # It completed no earlier than the late rank joined: drawn up to then, so that its wait shows,
                # but not into the row's next slice (slices on a row must nest).
                i = bisect.bisect_right(row, start_ns)
                reach = min(start_ns + round(wait[1] * 1e9), row[i] if i < len(row) else ns(t_last))
                stretched, end_ns = reach > end_ns, max(end_ns, reach)
            out.append({
                "name": name, "ph": "X", "pid": rank, "tid": 0, "ts": start_ns / 1000,
                "dur": (end_ns - start_ns) / 1000,
                "args": {"seq": e.seq, "group": _group(e), "shapes": e.shapes, "dtypes": e.dtypes,
                         "reduce_op": e.reduce_op, "root": e.root, "peer": e.peer, "site": e.site,
                         **({"error": e.error} if e.error else {}),
                         # not called from Python: who issued it (DDP, a compiled graph, torch); its end is the
                         # issue time when the ring holds no completion time (gloo)
                         **({"via": e.extra["via"]} if e.extra.get("via") else {}),
                         **({"untraced": True} if e.extra.get("untraced") else {}),
                         **({"end": STRETCHED_NOTE} if stretched else {}),
                         **({"arrived_last": True} if wait is not None and wait[0] == rank else {})},
                "cat": "untraced collective" if e.extra.get("untraced") else "collective",
            })
            if wait is not None:
                out.extend(_wait_slice(rank, start_ns, end_ns, *wait))
        for err in trace.errors:
            out.append({"name": f"{err.exc_type}", "cat": "error", "ph": "i", "s": "p", "pid": rank, "tid": 0,
                        "ts": round((err.t - t0) * 1e6, 3), "args": {"message": err.message, "site": err.site}})
    return out


STRETCHED_NOTE = ("not recorded (only its issue, or when its phase ended): drawn up to the last member's start, "
                  "the earliest it could complete")


def _end_stands_in(e: Any) -> bool:
    """The event's end is not when it completed: a functional collective's issue, or (gloo's ring has no
    completion times) an untraced entry's creation or the end of the DDP phase that waited for it."""
    return bool(e.issued_only or e.extra.get("end_unknown"))


def _waits(traces: dict[int, RankTrace], events: dict[int, list]) -> dict[int, tuple[int, float]]:
    """The drawn event's id -> (the rank its group waited for, its own wait in seconds): the positions the drawn
    events of every member reach (a summarized trace's few kept ones rarely do, and then draw no waits)."""
    hosts = {r: t.meta.get("host") for r, t in traces.items()}
    out: dict[int, tuple[int, float]] = {}
    for a in arrivals(events, hosts):
        for m in a.members:
            out[id(a.events[m])] = (a.late, a.waits[m])
    return out


def _wait_slice(rank: int, start_ns: int, end_ns: int, late: int, waited: float) -> list[dict[str, Any]]:
    """The child slice of a collective's slice (from ``start_ns`` to ``end_ns``) for its rank's wait for ``late``:
    nested because it starts with its parent on the same row and ends no later (clipped); none for the late rank
    or a wait shorter than a nanosecond."""
    want = round(waited * 1e9)
    drawn = min(want, end_ns - start_ns)
    if rank == late or drawn <= 0:
        return []
    args: dict[str, Any] = {"late_rank": late, "waited_s": round(waited, 6)}
    if drawn < want:
        # its slice ended first (its end is a completion recorded before the late start: clocks, or the row's
        # next slice cut a stretched one short): the rest of the wait is not on this slice
        args["clipped"] = True
    return [{"name": f"waiting for rank {late}", "cat": "wait", "ph": "X", "pid": rank, "tid": 0,
             "ts": start_ns / 1000, "dur": drawn / 1000, "args": args}]


def _group(e: Any) -> str:
    """A slice's group: its ranks, or a big group's name and size (a 4096-rank list per slice made a 567 MB file)."""
    if len(e.pg) <= PG_INLINE:
        return ",".join(map(str, e.pg))
    return f"{e.pg_name or '?'} ({len(e.pg)} ranks)"


PARTIAL_NOTE = ("the collectives the analysis looked at (each rank's last ones, the ones it waits on, the first "
                "divergence); every collective is in the per-rank trace files (trace-rank<R>.jsonl/.bin)")


def write_chrome_trace(traces: dict[int, RankTrace], path: str | os.PathLike, end_time: float | None = None) -> Path:
    path = Path(path)
    events = chrome_events(traces, end_time)
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if any(t.summary is not None for t in traces.values()):
        doc["otherData"] = {"partial": PARTIAL_NOTE}
    atomic_write(path, json.dumps(doc, separators=(",", ":")) + "\n")
    return path
