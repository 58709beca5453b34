"""Chrome / Perfetto trace of collectives: one row per rank, one slice per collective.

    python -m distcheck run --nproc 2 -- train.py    # writes <report_dir>/trace.json; open it in ui.perfetto.dev

Uses the Trace Event Format's "X" (complete) events, which chrome://tracing and Perfetto both read. A collective
that never completed is drawn up to the end of the trace and named "(never completed)", so a hang is visible as
the slice that runs off the end of its rank's row.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distcheck.analysis.trace_events import RankTrace
from distcheck.contract.report import atomic_write


def chrome_events(traces: dict[int, RankTrace], end_time: float | None = None) -> list[dict[str, Any]]:
    """``end_time``: when the run ended (open collectives are drawn up to it); default: the last timestamp."""
    starts = [e.t_start for t in traces.values() for e in t.events]
    if not starts:
        return []
    t0 = min(starts)
    t_last = max([e.t_end or e.t_start for t in traces.values() for e in t.events]
                 + [err.t for t in traces.values() for err in t.errors] + [end_time or 0.0])
    out: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for e in trace.events:
            end = e.t_end if e.t_end is not None else t_last
            name = e.op if e.t_end is not None else f"{e.op} (never completed)"
            out.append({
                "name": name, "ph": "X", "pid": rank, "tid": 0,
                "ts": round((e.t_start - t0) * 1e6, 3), "dur": round(max(end - e.t_start, 0.0) * 1e6, 3),
                "args": {"seq": e.seq, "group": ",".join(map(str, e.pg)), "shapes": e.shapes, "dtypes": e.dtypes,
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


def write_chrome_trace(traces: dict[int, RankTrace], path: str | os.PathLike, end_time: float | None = None) -> Path:
    path = Path(path)
    events = chrome_events(traces, end_time)
    atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
    return path
