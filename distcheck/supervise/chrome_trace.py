"""Chrome / Perfetto trace of collectives: one row per rank, one slice per collective.

    python -m distcheck run --nproc 2 -- train.py    # writes <report_dir>/trace.json; open it in ui.perfetto.dev

Uses the Trace Event Format's "X" (complete) events, which chrome://tracing and Perfetto both read. A collective
that never completed is drawn up to the end of the trace and named "(never completed)", so a hang is visible as
the slice that runs off the end of its rank's row.

A big job's summarized traces (analysis/trace_events.TraceSummary) draw only what the analysis looked at: each
rank's last collectives, the first it waits on, each group's last one, and the positions around the first
divergence. The file says so in its ``otherData``; every collective is in the per-rank trace files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
    out: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for e in events[rank]:
            end = e.t_end if e.t_end is not None else t_last
            name = e.op if e.t_end is not None else f"{e.op} (never completed)"
            out.append({
                "name": name, "ph": "X", "pid": rank, "tid": 0,
                "ts": round((e.t_start - t0) * 1e6, 3), "dur": round(max(end - e.t_start, 0.0) * 1e6, 3),
                "args": {"seq": e.seq, "group": _group(e), "shapes": e.shapes, "dtypes": e.dtypes,
                         "reduce_op": e.reduce_op, "root": e.root, "peer": e.peer, "site": e.site,
                         **({"error": e.error} if e.error else {}),
                         # not called from Python: who issued it (DDP, a compiled graph, torch); its end is the
                         # issue time when the ring holds no completion time (gloo)
                         **({"via": e.extra["via"]} if e.extra.get("via") else {}),
                         **({"untraced": True} if e.extra.get("untraced") else {})},
                "cat": "untraced collective" if e.extra.get("untraced") else "collective",
            })
        for err in trace.errors:
            out.append({"name": f"{err.exc_type}", "cat": "error", "ph": "i", "s": "p", "pid": rank, "tid": 0,
                        "ts": round((err.t - t0) * 1e6, 3), "args": {"message": err.message, "site": err.site}})
    return out


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
