"""Join torch's Flight Recorder ring with the traced collectives: what the process group ran that Python did not call.

    from distcheck.analysis.trace_events import load_traces
    traces = load_traces("report/")      # merges flight-rank<R>.json into each rank's events (via merge below)

A rank's ``flight-rank<R>.json`` (rank/flight_recorder.py) holds the ring's entries (group name,
``collective_seq_id``, op, sizes, dtypes, creation time), the phases the rank went through (DDP construction and
forward, ``backward()``, ``join()``'s exit, each run of a compiled graph, with the user's line) and the compiled
graphs' collectives with their lines. NCCL keeps a ring of its own, with the time each op completed: the
tracer leaves the ends of synchronous NCCL collectives to it (``completion: flight_recorder`` in their sig), and the
join stores them into the traced events (or the rank itself into its trace at the dump, when :func:`traced_ring`
finds nothing untraced: its dump then has no entries to join).

**The join.** Per process group, entries in sequence order against the traced events in issue order: an entry is
the traced call's own when it was created after that call started and before the next traced call on the group
started, it is the first entry since that call (or the call is one that issues several: ``*_object``,
``batch_isend_irecv``, coalesced ops), and its op is the same kind. Every other entry is *untraced*: it becomes a
:class:`TraceEvent` with ``extra["origin"]`` ``"ddp"``, ``"compiled"`` or ``"torch"``, ``extra["via"]`` saying who
issued it ("DDP gradient bucket all-reduce", "compiled step (train.py:12)") and the user's line from the phase it
was created in (for a compiled graph, the line inside the compiled function, by its place in the graph).

**Graph runs.** A rank that gloo aborted inside a compiled graph dumped no ring: its trace's ``graph_run`` lines
(written before each run) stand for it (:func:`graph_run_events`), as for the runs after a dump; the ring stays
authoritative for the runs it covers. On a rank with a DDP model the lines also hold each group's counter, which
numbers the run's collectives as the ring would (DDP's buckets are in no line).

**Positions.** Untraced events count in a sequence of their own per group (``sequence_key`` ``("untraced", group)``)
numbered by torch's ``collective_seq_id``, which counts every collective of the group, traced or not. The traced
events keep their positions, so a rank whose ring is missing (SIGKILLed) or overflowed changes nothing about how
the traced calls align; :func:`common_floor` drops the untraced positions below what every rank's ring still holds.
Pure: no process group, no torch.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

from distcheck.analysis.ops import PEER_OPS
from distcheck.contract import flight_dump_file
from distcheck.contract.site import file_line

# Traced calls that issue several backend collectives, and how many at most: the *_object helpers exchange sizes
# first, a barrier or a list all-gather may run as more than one op on some backends, a batch or a coalesced call
# one per tensor. Any of them accepts an entry of any kind (what the backend runs differs by backend).
_MULTI = {"all_gather_object": 3, "gather_object": 3, "broadcast_object_list": 3, "scatter_object_list": 3,
          "send_object_list": 3, "recv_object_list": 3, "barrier": 2, "monitored_barrier": 2, "all_gather": 2,
          "all_to_all": 2, "batch_isend_irecv": 64, "all_reduce_coalesced": 64, "all_gather_coalesced": 64,
          "all_gather_into_tensor_coalesced": 64, "reduce_scatter_tensor_coalesced": 64}

# Collectives a backend runs as another (gloo's reduce_scatter is an all-reduce, its gather an all-gather): the
# ring names what the backend ran, the trace what the caller asked for.
_RUNS_AS = {"reduce_scatter": {"all_reduce"}, "reduce": {"all_reduce"}, "gather": {"all_gather"},
            "scatter": {"broadcast"}, "all_to_all": {"all_gather", "send", "recv"}}


def same_kind(traced_op: str, ring_op: str) -> bool:
    """Whether a ring entry can be the backend's run of a traced call."""
    if traced_op in _MULTI:
        return True  # bounded by _MULTI's count
    want, got = family(traced_op), family(ring_op)
    return want == got or got in _RUNS_AS.get(want, ())


_PHASE_VIA = {"backward": ("ddp", "DDP gradient bucket {op}"), "ddp_init": ("ddp", "DDP construction {op}"),
              "ddp_forward": ("ddp", "DDP forward {op} (buffers or bucket rebuild)"),
              "join": ("ddp", "DDP join() shadow {op}")}
_PHASE_WHERE = {"backward": "during backward()", "ddp_init": "in DistributedDataParallel(...)",
                "ddp_forward": "in the DDP model's forward", "join": "at the end of join()"}


def family(op: str) -> str:
    """One name per kind of collective, for torch's profiling names (``gloo:all_reduce``, ``nccl:_allgather_base``)
    and the traced ops (``all_gather_into_tensor``) alike."""
    name = op.split(":", 1)[-1].lower().lstrip("_")
    for prefix, fam in (("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("reduce_scatter", "reduce_scatter"),
                        ("allgather", "all_gather"), ("all_gather", "all_gather"), ("alltoall", "all_to_all"),
                        ("all_to_all", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
                        ("isend", "send"), ("send", "send"), ("irecv", "recv"), ("recv", "recv"),
                        ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce")):
        if name.startswith(prefix):
            return fam
    return name


_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


def dtype_name(dtype: str) -> str:
    """A dtype as torch's ring names it (c10's ``Float``) in torch's Python spelling (``float32``)."""
    return _DTYPES.get(str(dtype), str(dtype).lower())


@dataclass
class FlightDump:
    rank: int
    entries: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    graphs: dict[str, dict[str, Any]]
    groups: dict[str, list[int]]
    status: dict[str, dict[str, Any]]
    reason: str = ""
    dropped: bool = False  # the ring overflowed: its oldest entries are gone
    window: dict[str, int] = field(default_factory=dict)  # group name -> first collective_seq_id still held
    seen: frozenset[str] = frozenset()  # every phase kind the rank went through (ddp_init: a DDP model exists)
    # The rank found every collective its groups counted in its trace (all_traced) and wrote no entries: merging
    # it adds nothing, so it does not keep a big job's traces from being summarized (trace_events.load_traces).
    all_traced: bool = False
    t: float = 0.0  # when it was dumped: graph runs after it are not in it (graph_run_events)
    # How often the rank began each phase kind ("backward", "ddp_forward", ...) and its optimizer.step() count
    # ("optimizer_step"), over the whole run (the phases themselves are only the last few thousand)
    counts: dict[str, int] = field(default_factory=dict)


def load_dump(report_dir: str | os.PathLike, rank: int) -> FlightDump | None:
    """A rank's ``flight-rank<R>.json``, or None (no dump: the rank was killed, or the recorder was off)."""
    data = flight_dump_file.read(report_dir, rank)
    if data is None:
        return None
    entries = [e for e in data.get("entries") or [] if isinstance(e, dict)]
    window: dict[str, int] = {}
    for e in entries:
        if not e.get("is_p2p"):
            g = _group(e)
            window[g] = min(window.get(g, 1 << 62), int(e.get("collective_seq_id") or 0))
    return FlightDump(rank, entries, list(data.get("phases") or []), dict(data.get("graphs") or {}),
                      {str(k): list(v) for k, v in (data.get("groups") or {}).items()},
                      dict(data.get("pg_status") or {}), str(data.get("reason", "")),
                      dropped=bool(entries) and int(entries[0].get("record_id") or 0) > 0, window=window,
                      seen=frozenset(str(k) for k in data.get("seen") or ()),
                      all_traced=bool(data.get("all_traced")) and not entries, t=float(data.get("t") or 0.0),
                      counts={str(k): int(v) for k, v in (data.get("counts") or {}).items()})


def _group(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", ""))


def _created(entry: dict[str, Any]) -> float:
    return int(entry.get("time_created_ns") or 0) / 1e9


class _PhaseIndex:
    """The phases sorted by start, with the latest end among each prefix: the innermost phase open at a time is
    found by walking back from the last start before it, and the walk stops where no earlier phase reaches that
    far, so a full ring against thousands of phases stays linear in practice."""

    def __init__(self, phases: list[dict[str, Any]]) -> None:
        import bisect

        self._bisect = bisect.bisect_right
        self.phases = sorted((p for p in phases if p.get("t0") is not None), key=lambda p: p["t0"])
        self.starts = [p["t0"] for p in self.phases]
        self.reach: list[float] = []
        far = float("-inf")
        for p in self.phases:
            far = max(far, float("inf") if p.get("t1") is None else p["t1"])
            self.reach.append(far)

    def at(self, t: float) -> dict[str, Any] | None:
        """The innermost phase open at ``t`` (the latest to begin among those that contain it)."""
        i = self._bisect(self.starts, t) - 1
        while i >= 0 and self.reach[i] >= t:
            p = self.phases[i]
            if p.get("t1") is None or p["t1"] >= t:
                return p
            i -= 1
        return None

    def began_between(self, a: float, b: float) -> bool:
        """Whether a phase began in (a, b]: an entry created then belongs to that phase, not to a traced call
        made before it."""
        return self._bisect(self.starts, b) > self._bisect(self.starts, a)


def _describe(entry: dict[str, Any], dump: FlightDump, index: _PhaseIndex,
              graph_pos: dict[int, int]) -> dict[str, Any]:
    """origin, via, file and line of an untraced entry, from the phase it was created in."""
    op = family(str(entry.get("profiling_name", "?")))
    phase = index.at(_created(entry))
    if phase is None:
        return {"origin": "torch", "via": f"{op} issued by torch itself (not called from Python)", "file": None,
                "line": None}
    kind = phase.get("kind")
    file, line = phase.get("file"), phase.get("line")
    if kind == "compiled":
        graph = dump.graphs.get(str(phase.get("graph"))) or {}
        fn_site = file_line(graph.get("file") or file, graph.get("line") or line)
        key = id(phase)
        k = graph_pos.get(key, 0)
        graph_pos[key] = k + 1
        colls = graph.get("collectives") or []
        where = colls[k] if k < len(colls) else {}
        if where.get("file") and where.get("line"):
            return {"origin": "compiled", "via": f"{op} inside compiled {graph.get('fn', '?')} ({fn_site})",
                    "file": where["file"], "line": where["line"]}
        return {"origin": "compiled", "via": f"{op} inside compiled {graph.get('fn', '?')} ({fn_site})",
                "file": graph.get("file") or file, "line": graph.get("line") or line}
    origin, via = _PHASE_VIA.get(kind, ("torch", f"{{op}} issued by torch {_PHASE_WHERE.get(kind, '')}"))
    if kind == "backward" and "ddp_init" not in dump.seen:  # no DDP model: torch's own backward collectives
        origin, via = "torch", f"{{op}} issued by torch {_PHASE_WHERE['backward']}"
    return {"origin": origin, "via": via.format(op=op.replace("_", "-")), "file": file, "line": line}


def _status_done(status: dict[str, Any]) -> dict[str, int]:
    """{ring:group id: last completed collective_seq_id} of a dump's pg_status."""
    out = {}
    for gid, s in status.items():  # keyed "ring:group id" (a dump before rings were named: "group id")
        try:
            out[str(gid) if ":" in str(gid) else f"c10d:{gid}"] = int(s.get("last_completed_collective", -1))
        except (TypeError, ValueError, AttributeError):
            continue
    return out


def _completion(entry: dict[str, Any], status_done: dict[str, int], index: _PhaseIndex) -> float | None:
    """When the entry's op completed (its time, or its creation when only the group's counter says so), else
    None. NCCL's ring has completion times; gloo's only the counter."""
    t_done = int(entry.get("time_discovered_completed_ns") or 0) / 1e9
    if t_done:
        return t_done
    seq = int(entry.get("collective_seq_id") or 0)
    if entry.get("state") == "completed" or (seq and seq <= status_done.get(
            f"{entry.get('ring', 'c10d')}:{entry.get('pg_id')}", -1)):
        return _created(entry)
    # gloo's completed counter lags (it skipped the DDP broadcasts and bucket all-reduces a rank had long
    # finished). A phase that has ended waited for what it issued: DDP's forward and construction run their
    # broadcasts synchronously, its backward returns once every bucket's all-reduce is done, join()'s exit and
    # a compiled graph wait for theirs.
    phase = index.at(_created(entry))
    if phase is not None and phase.get("t1") is not None:
        return float(phase["t1"])
    return None


def merge(events: list[Any], dump: FlightDump | None, event_type: Callable[..., Any], since: float = 0.0,
          floor: dict[str, int] | None = None) -> list[Any]:
    """The rank's traced events plus an event for each untraced ring entry created at or after ``since`` (the
    trace's start: a pytest pool's process keeps one ring across tests) and, per group, at or after ``floor``'s
    position (common_floor), in issue order, ids renumbered. ``event_type`` is trace_events.TraceEvent (passed in:
    trace_events reads the dumps through this module)."""
    if dump is None or not dump.entries:
        return _assume_ends(events)

    by_group: dict[str, list[Any]] = {}
    for ev in events:
        if ev.pg_name is not None:
            by_group.setdefault(str(ev.pg_name), []).append(ev)
    claimed: dict[int, int] = {}  # id(traced event) -> entries it owns
    index = _PhaseIndex(dump.phases)
    # Traced events know their group's ranks: a dump written after destroy_process_group() may not.
    members = {str(ev.pg_name): tuple(ev.pg) for ev in events if ev.pg_name is not None and ev.pg}
    cursor: dict[str, int] = {}
    untraced: list[Any] = []
    graph_pos: dict[int, int] = {}
    status_done = _status_done(dump.status)

    def done(entry: dict[str, Any]) -> float | None:
        return _completion(entry, status_done, index)

    for entry in sorted(dump.entries, key=lambda e: (int(e.get("time_created_ns") or 0),
                                                      int(e.get("record_id") or 0))):
        created = _created(entry)
        if created < since:
            continue
        group = _group(entry)
        traced = by_group.get(group, [])
        i = cursor.get(group, -1)
        while i + 1 < len(traced) and traced[i + 1].t_start <= created:
            i += 1
        cursor[group] = i
        if i >= 0:
            ev = traced[i]
            owned = claimed.get(id(ev), 0)
            same = same_kind(ev.op, str(entry.get("profiling_name", "")))
            # A DDP backward, a compiled graph or join() that began after the call started ran after it returned
            # (a traced call never opens a phase): what it recorded is its own.
            later = index.began_between(ev.t_start, created)
            if same and not later and owned < _MULTI.get(ev.op, 1):
                claimed[id(ev)] = owned + 1
                if ev.extra.get("completion") == "flight_recorder":  # NCCL: the ring says when it completed
                    ended = done(entry)
                    ev.t_end = None if ended is None else max(ended, ev.t_start)
                continue
        desc = _describe(entry, dump, index, graph_pos)
        seq = int(entry.get("collective_seq_id") or 0)
        if floor and seq < floor.get(group, 0):
            continue
        ended = done(entry)
        t_done = int(entry.get("time_discovered_completed_ns") or 0) / 1e9
        ranks = dump.groups.get(group) or members.get(group) or []
        op = family(str(entry.get("profiling_name", "?")))
        # What every rank of the group holds alike: a scatter's inputs exist on its root only (its outputs match),
        # an all-to-all may split unevenly by design; anything else compares its inputs.
        side = "output" if op == "scatter" else "input"
        sizes = [] if op == "all_to_all" else entry.get(f"{side}_sizes")
        dtypes = [dtype_name(d) for d in entry.get(f"{side}_dtypes") or []]
        untraced.append(event_type(
            rank=dump.rank, id=0, seq=seq, pg=tuple(int(r) for r in ranks),
            op=op, shapes=[list(s) for s in sizes or []], dtypes=dtypes, reduce_op=None, peer=None,
            site=file_line(desc["file"], desc["line"]), file=desc["file"], line=desc["line"], t_start=created,
            t_end=ended, pg_name=group,
            extra={"origin": desc["origin"], "via": desc["via"], "untraced": True,
                   "sequence": ("untraced", group), "end_unknown": ended is not None and not t_done}))
    return interleave(events, untraced)


def interleave(events: list[Any], untraced: list[Any]) -> list[Any]:
    """``events`` (the rank's traced ones and any untraced already merged) with ``untraced`` added in time order,
    ids renumbered; the events not flagged untraced keep their relative order (their ids are slots claimed in call
    order)."""
    if not untraced:
        return events
    merged = sorted([*events, *untraced], key=lambda e: (e.t_start, 0 if e.extra.get("untraced") else 1))
    traced_sorted = iter(sorted((e for e in events if not e.extra.get("untraced")), key=lambda e: e.id))
    out = [e if e.extra.get("untraced") else next(traced_sorted) for e in merged]
    for n, ev in enumerate(out, 1):
        ev.id = n
    return out


def _run_shape(shape: list[Any] | None, sizes: dict[str, int]) -> list[int] | None:
    """A graph's input shape in one run: its symbols (a dynamic graph's sizes) by the run line's values, and its
    sizes that are formulas of symbols ("2*s0", "(s0//2)", "Max(1, s0)") evaluated with them."""
    if shape is None:
        return None
    try:
        return [int(sizes[d]) if isinstance(d, str) and d in sizes else size_value(d, sizes) if isinstance(d, str)
                else int(d) for d in shape]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError, RecursionError, SyntaxError):
        return None


# sympy's (and torch's symbolic shapes') functions a size formula may call, by the name sympy prints
_SIZE_CALLS: dict[str, Callable[..., int]] = {
    "Max": max, "Min": min, "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
    "FloorDiv": lambda a, b: a // b, "CeilDiv": lambda a, b: -(-a // b), "CleanDiv": lambda a, b: a // b,
    "floor": lambda a: a, "ceiling": lambda a: a, "Abs": abs}
_SIZE_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a ** b}


def size_value(formula: str, sizes: dict[str, int]) -> int:
    """An integer formula of size symbols, as sympy prints it, with ``sizes``' values: a tiny evaluator of
    + - * // % **, unary minus, integers, symbols and :data:`_SIZE_CALLS` (never ``eval``: the text is a file's).
    Raises KeyError for a symbol without a value, ValueError for anything else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return int(sizes[node.id])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _SIZE_OPS:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and not 0 <= b <= 64:
                raise ValueError(formula)
            return _SIZE_OPS[type(node.op)](a, b)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SIZE_CALLS \
                and not node.keywords:
            return int(_SIZE_CALLS[node.func.id](*(value(a) for a in node.args)))
        raise ValueError(formula)

    if len(formula) > 200:
        raise ValueError(formula)
    return value(ast.parse(formula, mode="eval").body)


def graph_run_events(events: list[Any], graphs: dict[int, dict[str, Any]],
                     runs: list[tuple[Any, ...]],
                     dump: FlightDump | None, event_type: Callable[..., Any], rank: int, since: float = 0.0
                     ) -> tuple[list[Any], bool]:
    """Untraced events for the compiled collectives of the graph runs a rank wrote into its trace lines
    (``graph``/``graph_run``, rank/flight_recorder.GraphLines) that its ring's dump does not hold: every run when
    there is no dump (gloo aborted the rank inside the graph), those after the dump's time otherwise. The ring stays
    authoritative for what it covers, so no collective counts twice.

    Each event is what :func:`merge` makes of the ring's entry for it, for the peers' ring-derived events to align
    with: the same untraced sequence of its group, op family, input shape and dtype, the line inside the compiled
    function; its position is the collectives the rank issued on the group before it (as torch's
    ``collective_seq_id`` counts them), each run's after the previous run's. On a rank with a DDP model, whose
    bucket all-reduces only the ring names, a run line holds each group's counter (``runs``' 4th field,
    rank/flight_recorder.group_counters): the position is then that counter plus the collective's place in the run,
    the ring's own number, flagged ``extra["seq_exact"]`` (trace_align lines these up with a peer's ring by that
    number), unless a point-to-point op the trace holds came first on the group (gloo's counter counts those, its
    ring's numbers do not). Runs are ``(graph id, time, sizes[, counters])`` (rank_trace.GraphRun). Every run
    but the rank's last is taken as completed (the graph waits for its collectives before returning): its end is
    unknown, its start is used. Also returns whether the lines name every untraced collective the rank can have
    issued (no graph was described after a DDP model was built: DDP's own collectives only the ring knows)."""
    until = float("-inf") if dump is None else (dump.t or float("inf"))
    todo = sorted((run[1], run[0], n) for n, run in enumerate(runs)
                  if run[1] > until and run[1] >= since and run[0] in graphs)
    if not todo:
        return [], False
    import bisect

    starts: dict[str, list[float]] = {}  # group name -> its collectives' starts so far, in order
    uncounted: dict[str, float] = {}  # group name -> when its first point-to-point op (or monitored_barrier) began
    members: dict[str, tuple[int, ...]] = {}
    for ev in events:
        if ev.pg_name is None:
            continue
        name = str(ev.pg_name)
        if ev.op in _UNCOUNTED:
            uncounted[name] = min(uncounted.get(name, ev.t_start), ev.t_start)
        if ev.op not in PEER_OPS:
            starts.setdefault(name, []).append(ev.t_start)
            if ev.pg:
                members.setdefault(name, tuple(ev.pg))
    for times in starts.values():
        times.sort()
    added: dict[str, int] = {}
    out: list[Any] = []
    last_t = todo[-1][0]
    for t, gid, n_run in todo:
        graph = graphs[gid]
        run = runs[n_run]
        sizes = run[2]
        counters = run[3] if len(run) > 3 else {}
        in_run: dict[str, int] = {}
        ranks_of = graph.get("groups") or {}
        fn_site = file_line(graph.get("file"), graph.get("line"))
        for coll in graph.get("collectives") or []:
            group = str(coll.get("group") or "")
            if not group:
                continue
            n = added[group] = added.get(group, 0) + 1
            k = in_run[group] = in_run.get(group, 0) + 1
            exact = group in counters and not uncounted.get(group, t) < t
            seq = counters[group] + k if exact else bisect.bisect_left(starts.get(group, []), t) + n
            op = family(str(coll.get("op", "?")))
            shape = _run_shape(coll.get("input_shape"), sizes)
            dtype = coll.get("dtype")
            file, line = coll.get("file") or graph.get("file"), coll.get("line") or graph.get("line")
            ranks = ranks_of.get(group) or members.get(group) or ()
            out.append(event_type(
                rank=rank, id=0, seq=seq, pg=tuple(int(r) for r in ranks),
                op=op, shapes=[] if op == "all_to_all" or shape is None else [list(shape)],
                dtypes=[] if dtype is None else [str(dtype).replace("torch.", "")], reduce_op=None, peer=None,
                site=file_line(file, line), file=file, line=line, t_start=t, t_end=None if t == last_t else t,
                pg_name=group,
                extra={"origin": "compiled", "via": f"{op} inside compiled {graph.get('fn', '?')} ({fn_site})",
                       "untraced": True, "sequence": ("untraced", group), "end_unknown": t != last_t,
                       "from": "graph_run", **({"seq_exact": True} if exact else {})}))
    complete = not any(g.get("ddp") for g in graphs.values())
    return out, complete


# Phases inside which torch issues collectives of its own: a dump that saw one keeps its entries.
_UNTRACED_PHASES = frozenset({"ddp_init", "ddp_forward", "join", "compiled"})
# Traced calls a ring counter cannot be held against one for one: point-to-point ops (the ring numbers them apart)
# and gloo's monitored_barrier (sends and receives underneath).
_UNCOUNTED = PEER_OPS | {"monitored_barrier"}


class TracedRing(NamedTuple):
    """A ring every collective of which the rank's trace holds (:func:`traced_ring`)."""

    pairs: dict[int, dict[str, Any]]  # slot (the traced record's id) -> the held ring entry that is its run
    # slot of a traced NCCL record still open (t_end 0) -> when the ring says it completed: what merge() would
    # store into it. Open ones the ring has not seen complete are not here: merge leaves them open too.
    ends: dict[int, float]


def all_traced(entries: list[dict[str, Any]], status: dict[str, Any], trace_lines: Iterable[str | bytes],
               binary: bytes | None, snapshot: dict[str, Any]) -> bool:
    """Whether every collective the rank's process groups counted is one its trace holds, so that :func:`merge`
    would add nothing to the trace: the rank then writes its dump without the entries (rank/flight_recorder.py).
    False for a ring that completes traced calls (NCCL): merge stores their ends, which :func:`traced_ring` gives.

    ``entries`` and ``status`` as the rank's dump holds them (``status`` keyed ``ring:group id``), ``trace_lines``
    and ``binary`` the rank's ``trace-rank<R>.jsonl`` and ``.bin``, ``snapshot`` its phases. True only when, per
    group, the ring's counter of collectives ever enqueued equals the traced calls on that group (groups whose
    entries left the ring are counted together), every entry still held has the kind of the traced call at its
    position and was created while that call was the group's latest (merge's own join), and nothing says torch
    issued collectives of its own (DDP, compiled graphs), issued point-to-point ops, or that the ring completes
    traced calls (NCCL). Anything unreadable, cut or failed: False (the dump keeps its entries)."""
    return traced_ring(entries, status, trace_lines, binary, snapshot, nccl=False) is not None


def traced_ring(entries: list[dict[str, Any]], status: dict[str, Any], trace_lines: Iterable[str | bytes],
                binary: bytes | None, snapshot: dict[str, Any], nccl: bool = True) -> TracedRing | None:
    """:func:`all_traced`'s check, with its pairing of each held entry to the traced record at its
    ``collective_seq_id``; None where that check fails. With ``nccl``, NCCL's ring passes too, on one more
    condition: every traced NCCL record still open is paired with a held entry, or its entry left the ring and its
    group's completed counter passed it (its end is then its start), and once the ends of those the ring saw
    complete are stored (``ends``), each group keeps at most one open: a load of the all-traced dump then assumes
    no end (``_assume_ends``) and reads the trace as merge() would have left it (a rank stuck in a collective keeps
    it open, for the hang diagnosis)."""
    import numpy as np

    from distcheck.analysis.rank_trace import _read_lines
    from distcheck.contract import trace_slots

    if snapshot.get("graphs") or _UNTRACED_PHASES & set(snapshot.get("seen") or ()):
        return None
    rings = ("c10d", "nccl") if nccl else ("c10d",)
    if any(e.get("is_p2p") or e.get("ring", "c10d") not in rings for e in entries):
        return None
    enqueued: dict[str, int] = {}  # ring:group id -> collectives it ever enqueued
    for key, s in status.items():
        ring, _, gid = str(key).rpartition(":")
        n = int(s.get("last_enqueued_collective", -1))
        if ring not in rings:
            if n > 0:
                return None  # NCCL: its ring holds the ends of traced calls
        elif n > 0:
            enqueued[f"{ring}:{gid}"] = n
    parsed = _read_lines(trace_lines, -1)
    if parsed.order or any(e.get("error") is not None for e in parsed.ends):
        return None  # JSON start lines of old, or a call that failed (it may have issued nothing)
    state = trace_slots.read_state(binary or b"")
    if state is None or state.cut or state.lost & trace_slots.LOST_LINES:
        return None
    recs = np.frombuffer(binary or b"", trace_slots.slot_dtype(), offset=trace_slots.SIZE,
                         count=len(binary or b"") // trace_slots.SIZE - 1)
    written = np.flatnonzero(recs["kind"] != 0)
    if written.size != (int(written[-1]) + 1 if written.size else 0):
        return None  # a slot claimed but not written yet: a call on its way
    recs = recs[:written.size]
    names: dict[str, int] = {}  # traced group name -> its index
    group_of = np.full(max(parsed.sigs, default=0) + 1, -1, np.int64)
    ring_sig = np.zeros(len(group_of), bool)  # sigs whose end the ring holds (the tracer left their records open)
    for n, desc in parsed.sigs.items():
        name = desc.get("pg_name")
        on_ring = desc.get("completion") == "flight_recorder"
        if str(desc.get("op")) in _UNCOUNTED or (on_ring and not nccl) or name is None or n < 0:
            continue  # any record of it makes the answer None below
        group_of[n] = names.setdefault(str(name), len(names))
        ring_sig[n] = on_ring
    sig = recs["sig"].astype(np.int64)
    if sig.size and (int(sig.max()) >= len(group_of) or (group_of[sig] < 0).any()):
        return None
    groups = group_of[sig]
    traced = dict(zip(names, np.bincount(groups, minlength=len(names)).tolist()))
    name_of: dict[str, str] = {}  # ring:group id -> name, from the entries that still name both
    for e in entries:
        gid, name = f"{e.get('ring', 'c10d')}:{e.get('pg_id')}", _group(e)
        if name_of.setdefault(gid, name) != name:
            return None
    if len(set(name_of.values())) != len(name_of) or any(gid not in enqueued for gid in name_of):
        return None  # a group made again under an old name (or run on two rings), or entries without a counter
    left_ring = 0
    for gid, n in enqueued.items():
        if gid in name_of:
            if traced.get(name_of[gid], 0) != n:
                return None
        else:
            left_ring += n
    if left_ring != sum(n for name, n in traced.items() if name not in name_of.values()):
        return None
    since = float(parsed.meta.get("t", 0.0) or 0.0)
    index = _PhaseIndex(list(snapshot.get("phases") or []))
    t = recs["t"]
    at: dict[str, Any] = {}
    pairs: dict[int, dict[str, Any]] = {}
    for e in entries:
        name = _group(e)
        slots = at.get(name)
        if slots is None:
            slots = at[name] = np.flatnonzero(groups == names[name])
            if (np.diff(t[slots]) < 0).any():
                return None  # calls of one group started out of order: merge's walk would not pair them so
        seq, created = int(e.get("collective_seq_id") or 0), _created(e)
        if not 1 <= seq <= len(slots) or created < since:
            return None
        slot = slots[seq - 1]
        start = float(t[slot])
        if not (start <= created and (seq == len(slots) or created < float(t[slots[seq]]))):
            return None
        if not same_kind(str(parsed.sigs[int(recs["sig"][slot])].get("op")), str(e.get("profiling_name", ""))):
            return None
        if index.began_between(start, created):
            return None
        if int(slot) + 1 in pairs:
            return None  # two entries at one position (a group's ids restarted): merge would not pair them so
        pairs[int(slot) + 1] = e  # slot 0 of the file is the header
    ends: dict[int, float] = {}
    waiting = np.flatnonzero(ring_sig[sig] & (recs["t_end"] == 0))
    if waiting.size:
        status_done = _status_done(status)
        # A record whose entry left the ring (a job longer than the ring) still has its group's completed counter:
        # at or below it, the op completed (NCCL runs a group's ops in order); when, the ring no longer says, so
        # its end is its start, as a load without the ring takes it (_assume_ends). Groups whose every entry left
        # the ring are known only together: all of them must have completed everything they enqueued.
        done_by_name = {name: status_done.get(gid, -1) for gid, name in name_of.items()}
        old_done = all(status_done.get(gid, -1) >= n for gid, n in enqueued.items() if gid not in name_of)
        position = np.zeros(len(recs), np.int64)  # each record's position in its group's sequence, from 1
        for g in range(len(names)):
            slots = np.flatnonzero(groups == g)
            position[slots] = np.arange(1, slots.size + 1)
        name_by_index = {i: name for name, i in names.items()}
        still_open: set[int] = set()  # groups with a record left open
        for i in waiting.tolist():
            e = pairs.get(i + 1)
            if e is None:
                name = name_by_index[int(groups[i])]
                completed = (int(position[i]) <= done_by_name[name] if name in done_by_name else old_done)
                if not completed:
                    return None  # its entry left the ring and nothing says it completed: no end to give it
                ends[i + 1] = float(t[i])
                continue
            ended = _completion(e, status_done, index)
            if ended is not None:
                ends[i + 1] = max(ended, float(t[i]))
                continue
            g = int(groups[i])
            if g in still_open:  # a load without entries would assume an end for all but its group's last one
                return None
            still_open.add(g)
    return TracedRing(pairs, ends)


def _assume_ends(events: list[Any]) -> list[Any]:
    """Without a ring (a rank SIGKILLed, or stuck holding the GIL, never dumped it), the NCCL collectives whose end
    only the ring knew: every one but the last of its group is taken as completed (NCCL runs a group's ops in
    order and the rank went on issuing), flagged ``end_unknown``; the last one stays open."""
    last: dict[str, Any] = {}
    for ev in events:
        if ev.extra.get("completion") == "flight_recorder" and ev.t_end is None:
            last[ev.group_key] = ev
    for ev in events:
        if ev.extra.get("completion") == "flight_recorder" and ev.t_end is None and last.get(ev.group_key) is not ev:
            ev.t_end = ev.t_start
            ev.extra["end_unknown"] = True
    return events


def common_floor(dumps: dict[int, FlightDump | None]) -> dict[str, int]:
    """Per group, the first collective_seq_id every rank's ring still holds: below it some rank's ring lost its
    entries, so positions there cannot be compared."""
    floor: dict[str, int] = {}
    for dump in dumps.values():
        if dump is None:
            continue
        for group, first in dump.window.items():
            floor[group] = max(floor.get(group, 0), first)
    return floor
