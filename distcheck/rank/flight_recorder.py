"""What the process group ran that Python did not call: DDP's buckets, compiled graphs, torch's own collectives.

    python -m distcheck run --nproc 2 -- train.py    # every traced rank keeps this beside its tracer

The tracer (rank/tracer.py) sees the collectives Python code calls. DDP's C++ Reducer (construction broadcast,
gradient buckets, join()'s shadow all-reduces) and compiled graphs (``torch.ops._c10d_functional.*`` run by Dynamo's
output code) call the process group directly. Every process group records those in torch's Flight Recorder
(c10d's in-memory ring, ``TORCH_FR_BUFFER_SIZE`` entries, on gloo too): op, sizes, dtypes, the group and its
``collective_seq_id``, but no Python frames and, on gloo, no completion. This module adds what only the rank knows
and the supervisor needs:

* **phases**: when the rank was inside ``DistributedDataParallel(...)``, a DDP forward, ``loss.backward()``,
  ``join()``'s exit or a compiled graph, with the user's line (rank/autocheck/patches.py marks them); a compiled
  graph also lists its collectives in order with the line inside the compiled function (:func:`graph_collectives`,
  from the FX graph's stack traces). The analysis (analysis/flight_recorder.py) names each untraced entry by them.
* **graph runs**: each run of a compiled graph with collectives writes one short ``graph_run`` line into the
  rank's trace before the graph issues anything (its first run also a ``graph`` line: its collectives with group,
  input shape and dtype; :class:`GraphLines`). gloo aborts a rank inside the graph on sizes that differ, and an
  aborted rank dumps no ring: the analysis then makes its compiled collectives from these lines (about 5 µs a run).
  Once a DDP model exists, a run line also holds each of the graph's groups' count of collectives so far: DDP's
  bucket all-reduces are in no line, and the count numbers the run's collectives as the peers' rings do.
* **liveness**: a daemon thread reads the per-group counters of enqueued and completed collectives every
  ``POLL_S`` (0.1 s; a 43 µs call that skips the entries) and, when they moved, rewrites ``flight-rank<R>.status``
  at most every ``WRITE_S`` (0.5 s) with its recent looks and their times (contract/flight_status_file.py), so the
  watch loop counts a loop that only runs DDP's all-reduces as progress instead of declaring it hung, and the live
  straggler look compares the ranks' counts at one moment.
* **dumps**: the ring, the phases and the group names go to ``flight-rank<R>.json`` when the script ends, when it
  raises, and when the supervisor asks (``flight-request``: the same thread answers it while the main thread is
  stuck in a collective).
  When the rank's own trace holds every collective the ring's per-group counters say were issued (no DDP, no
  compiled graph, no point-to-point op: analysis/flight_recorder.traced_ring), the dump keeps only the counters and
  says ``"all_traced": true``: nothing in it would name an untraced call, and a big job's analysis stays
  summarized. On NCCL the tracer leaves each synchronous collective's record open for the ring's completion time:
  the dump first stores those ends into the rank's ``trace-rank<R>.bin`` (what the analysis's merge would store),
  and keeps its entries when any open record has no entry left in the ring.
  A rank SIGKILLed, or stuck holding the GIL, leaves no dump: the memory-mapped trace still has every collective
  Python called. Dumping reads the whole ring: about 35 µs an entry on gloo (0.7 s for 20000, held with the GIL),
  84 ms for 2000 NCCL entries on an H100 host; hence only at the end, on error and on request.

``DISTCHECK_FLIGHT_RECORDER=0`` leaves all of this out (the user's own ``TORCH_FR_BUFFER_SIZE`` is never changed).
"""
from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from distcheck.contract import env, files, flight_dump_file, flight_status_file
from distcheck.contract import trace_slots

log = logging.getLogger("distcheck")

ENV_ENABLE = env.FLIGHT_RECORDER
ENV_BUFFER = "TORCH_FR_BUFFER_SIZE"
DEFAULT_ENTRIES = 10000  # 200 to 1000 DDP steps; a few MB of the rank's memory, a 0.35 s dump on gloo
# Ten looks a second, two writes at most: the live straggler look compares ranks' counts at one moment, and counts
# half a second apart, in steps shorter than that, made a slow rank look level or ahead at a quarter of the looks
# (a simulation of 0.26 s steps: 27% of runs unnamed with 0.5 s looks, 0.3% with 0.1 s). A look reads the counters
# in 43 µs on gloo (JSON included, 2026-11-27): 0.04% of a core. The file is rewritten no oftener than before.
POLL_S = flight_status_file.POLL_S
_PHASE_LIMIT = 4096  # phases kept: each names the entries created while it was open, older ones are gone anyway
_GRAPH_LIMIT = 1024


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def ring_kept() -> bool:
    """Whether torch keeps a ring this run (the user may have set TORCH_FR_BUFFER_SIZE=0): only then can a
    collective's end be left to it."""
    try:
        return enabled() and int(os.environ.get(ENV_BUFFER, str(DEFAULT_ENTRIES)) or 0) > 0
    except ValueError:
        return False


def enable_env() -> None:
    """Before the first process group exists: make sure torch keeps a ring big enough to name what a hang left."""
    if enabled():
        os.environ.setdefault(ENV_BUFFER, str(DEFAULT_ENTRIES))


# -- phases ---------------------------------------------------------------------------------------------------------
class Phases:
    """What the rank was doing, with the user's line, while the process group recorded entries. Appended from any
    thread (deque.append is atomic); an open phase has ``t1`` None until it closes."""

    def __init__(self) -> None:
        self.done: collections.deque[dict[str, Any]] = collections.deque(maxlen=_PHASE_LIMIT)
        self.open: dict[int, dict[str, Any]] = {}
        self.graphs: dict[int, dict[str, Any]] = {}
        self.seen: set[str] = set()  # every kind ever begun (a DDP model built long ago still owns the buckets)
        # How many of each kind began, and each optimizer's step() count: a rank that skipped a step the others
        # ran has run fewer backward() when its DDP all-reduces no longer pair (analysis/step_counts.py)
        self.counts: collections.Counter[str] = collections.Counter()
        self.steps: dict[int, int] = {}
        self._ids = itertools.count(1).__next__

    def begin(self, kind: str, file: str | None, line: int | None, **extra: Any) -> int:
        pid = self._ids()
        self.seen.add(kind)
        self.counts[kind] += 1
        self.open[pid] = {"kind": kind, "file": file, "line": line, "t0": time.time(), "t1": None, **extra}
        return pid

    def end(self, pid: int) -> None:
        phase = self.open.pop(pid, None)
        if phase is not None:
            phase["t1"] = time.time()
            self.done.append(phase)

    def stepped(self, optimizer: Any) -> None:
        self.steps[id(optimizer)] = self.steps.get(id(optimizer), 0) + 1

    def reset(self) -> None:
        """A pytest pool runs test after test in one process: an earlier test's DDP model and counts are gone."""
        self.seen.clear()
        self.counts.clear()
        self.steps.clear()

    def snapshot(self) -> dict[str, Any]:
        # optimizer.step(): the most any one optimizer took (a container's inner optimizers step with it)
        counts = {**self.counts, "optimizer_step": max(self.steps.values(), default=0)}
        return {"phases": list(self.done) + [dict(p) for p in list(self.open.values())],
                "graphs": {str(k): v for k, v in list(self.graphs.items())}, "seen": sorted(self.seen),
                "counts": counts}


phases = Phases()


def user_phase(kind: str, **extra: Any) -> Callable[[Callable], Callable]:
    """Decorate a wrapper of torch's (DDP's forward, Tensor.backward, ...) so the entries the process group records
    while it runs are named ``kind`` at the user's line that called it."""
    def wrap(fn: Callable) -> Callable:
        import torch

        is_compiling = torch.compiler.is_compiling

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # Dynamo inlining a compiled DDP forward: it must see torch's function only
                return fn(*args, **kwargs)
            from distcheck.rank.usersite import caller_site

            site = caller_site()
            pid = phases.begin(kind, site.file, site.line, **extra)
            try:
                return fn(*args, **kwargs)
            finally:
                phases.end(pid)

        return run

    return wrap


_phases_installed = False


def install_phases() -> None:
    """Mark the calls inside which torch's C++ issues collectives on the user's behalf (once per process). Each
    wrapper calls the original with the same arguments and returns its result."""
    global _phases_installed
    if _phases_installed:
        return
    _phases_installed = True
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.autograd.backward = user_phase("backward")(torch.autograd.backward)  # loss.backward() calls it
    DDP.__init__ = user_phase("ddp_init")(DDP.__init__)  # parameter shape check, construction broadcast
    DDP.forward = user_phase("ddp_forward")(DDP.forward)  # buffer broadcasts, bucket rebuild
    try:
        from torch.distributed.algorithms.join import Join

        Join.__exit__ = user_phase("join")(Join.__exit__)  # the shadow all-reduces of ranks out of data
    except ImportError:  # pragma: no cover - every supported torch has Join
        pass
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: phases.stepped(optimizer))


# -- compiled graphs ------------------------------------------------------------------------------------------------
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _site_in_compiled(stack_trace: str | None) -> tuple[str | None, int | None]:
    """The innermost user frame of an FX node's stack trace (Dynamo records the user code that made each op)."""
    from distcheck.rank.usersite import is_internal

    if not stack_trace:
        return None, None
    found: tuple[str | None, int | None] = (None, None)
    for match in _FRAME_RE.finditer(stack_trace):
        if not is_internal(match.group(1)):
            found = (match.group(1), int(match.group(2)))
    return found


def _group_arg(node: Any) -> str | None:
    """The group name a functional collective node is called with (its last argument in every
    ``_c10d_functional`` op's schema, or ``group_name=``)."""
    name = node.kwargs.get("group_name")
    if name is None and node.args and isinstance(node.args[-1], str):
        name = node.args[-1]
    return None if name is None else str(name)


def _shape(value: Any) -> list[int | str] | None:
    """A fake tensor's shape: ints, and a dynamic graph's sizes as sympy prints them: one symbol by its name
    ("s87") or a formula of symbols ("2*s87", "(s87//2)"); the graph's run line gives each symbol's value
    (:func:`symbol_sources`), the analysis evaluates the formula (analysis/flight_recorder._run_shape). None when a
    size is neither."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    out: list[int | str] = []
    for d in shape:
        if type(d) is int:
            out.append(d)
            continue
        expr = getattr(getattr(d, "node", None), "expr", None)
        if expr is None:
            return None
        if getattr(expr, "is_Integer", False):  # a symbolic size the graph specialized
            out.append(int(expr))
            continue
        if not getattr(expr, "free_symbols", None):
            return None
        out.append(str(expr))
    return out


def symbol_sources(gm: Any) -> list[tuple[str, int, int]]:
    """Where a run of a dynamic graph finds each size symbol's value: (name, argument index, -1) for a symbol Dynamo
    lifted as an int argument, (name, argument index, dim) for one only a tensor argument's size holds."""
    found: dict[str, tuple[str, int, int]] = {}
    args = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(args):
        value = node.meta.get("example_value")
        expr = getattr(getattr(value, "node", None), "expr", None)
        if expr is not None and getattr(expr, "is_Symbol", False):
            found[str(expr)] = (str(expr), i, -1)
    for i, node in enumerate(args):
        for d, size in enumerate(getattr(node.meta.get("example_value"), "shape", None) or ()):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and getattr(expr, "is_Symbol", False) and str(expr) not in found:
                found[str(expr)] = (str(expr), i, d)
    return list(found.values())


def _sizes(sources: list[tuple[str, int, int]], args: tuple[Any, ...]) -> dict[str, int]:
    """The symbols' values in this run (a boxed backend is called with one list of arguments)."""
    flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
    out = {}
    for name, i, d in sources:
        try:
            out[name] = int(flat[i]) if d < 0 else int(flat[i].shape[d])
        except Exception:
            continue
    return out


def graph_collectives(gm: Any) -> list[dict[str, Any]]:
    """The collectives of an FX graph in graph order: op, the compiled function's line that issued it, the output's
    shape, and what a graph run line needs to stand for the ring's entry (rank/flight_recorder's module doc): the
    group's name, the input's shape and dtype (None where unknown or symbolic)."""
    out: list[dict[str, Any]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if not name.startswith("_c10d_functional.") or "wait_tensor" in name:
            continue
        op = name.split(".")[1].rstrip("_")
        file, line = _site_in_compiled(node.meta.get("stack_trace"))
        value = node.meta.get("example_value")
        shape = list(value.shape) if hasattr(value, "shape") else None
        first = node.args[0] if node.args else None
        given = first.meta.get("example_value") if hasattr(first, "meta") else None
        dtype = getattr(given, "dtype", None)
        out.append({"op": op, "file": file, "line": line, "shape": shape, "group": _group_arg(node),
                    "input_shape": _shape(given), "dtype": None if dtype is None else str(dtype)})
    return out


# -- graph run lines ------------------------------------------------------------------------------------------------
class GraphLines:
    """Each compiled graph's runs in the rank's trace (contract/trace_lines.py): its first run writes a ``graph``
    line (what it issues: op, group and its ranks, input shape and dtype, the line inside the compiled function),
    every run a ``graph_run`` line (graph id, time), before the graph issues anything. A rank that gloo aborts inside
    the graph never dumps its ring; these lines are then what its compiled collectives are known by
    (analysis/flight_recorder.graph_run_events). One short O_APPEND write per run, not per collective.

    Once a DDP model exists, its Reducer's collectives (which only the ring names) share the groups' numbering: a
    run line then also holds each group's count of collectives enqueued so far (``seq``, the process group's own
    sequence number, about 1 µs a group: :func:`group_counters`), so the analysis numbers the run's collectives as
    the ring would (``collective_seq_id``) and lines them up with a peer's ring by that number."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.described: set[int] = set()
        self.groups: dict[int, list[str]] = {}  # graph id -> the groups its collectives run on
        self.counted: dict[str, bool] = {}  # group name -> whether its counter numbers its ring's entries

    def run(self, gid: int, t: float, args: tuple[Any, ...] = ()) -> None:
        if gid not in self.described:
            self.described.add(gid)
            graph = phases.graphs.get(gid) or {}
            colls = graph.get("collectives") or []
            names = {str(c["group"]) for c in colls if c.get("group")}
            self.groups[gid] = sorted(names)
            self.writer.write({"ev": "graph", "graph": gid, "fn": graph.get("fn"), "file": graph.get("file"),
                               "line": graph.get("line"), "collectives": colls, "groups": _ranks_of(names),
                               # DDP's own collectives, which only the ring names, share the groups' sequences
                               "ddp": "ddp_init" in phases.seen, "t": t})
        sources = (phases.graphs.get(gid) or {}).get("symbols")
        counters = group_counters(self.groups.get(gid) or (), self.counted) if "ddp_init" in phases.seen else None
        if sources or counters:  # a dynamic graph: the sizes of this run; a DDP rank: the groups' counters
            line: dict[str, Any] = {"ev": "graph_run", "graph": gid, "t": t}
            if sources:
                line["sizes"] = _sizes(sources, args)
            if counters:
                line["seq"] = counters
            self.writer.write(line)
        else:  # the common case, formatted by hand: about half of json.dumps' cost
            self.writer.write_line(b'{"ev":"graph_run","graph":%d,"t":%r}\n' % (gid, t))


def group_counters(names: Iterable[str], counted: dict[str, bool]) -> dict[str, int]:
    """{group name: collectives it enqueued so far} (``ProcessGroup._get_sequence_number_for_group()``, about 1 µs).
    On NCCL that is the ring's ``collective_seq_id`` of the last one; on gloo it also counts point-to-point ops,
    which the analysis knows from the trace (analysis/flight_recorder.graph_run_events). Only for a group with one
    backend on every device (``counted``, decided once per name): a group with a CPU and a GPU backend keeps a
    counter per backend, and this one may not be the one that runs the graph's collectives."""
    from torch.distributed.distributed_c10d import _resolve_process_group, get_backend_config

    out = {}
    for name in names:
        try:
            pg = _resolve_process_group(name)
            one = counted.get(name)
            if one is None:  # "cpu:gloo,cuda:gloo"; "cpu:gloo,cuda:nccl" has two
                one = counted[name] = len({b.rpartition(":")[2] for b in str(get_backend_config(pg)).split(",")}) == 1
            if one:
                out[name] = int(pg._get_sequence_number_for_group())
        except Exception:  # a group destroyed since, a backend without sequence numbers (fake, custom)
            continue
    return out


def _ranks_of(names: set[str]) -> dict[str, list[int]]:
    """{group name: global ranks} of the named groups this rank knows."""
    out = {}
    for name in names:
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

            out[name] = list(get_process_group_ranks(_resolve_process_group(name)))
        except Exception:
            ranks = _group_names().get(name)
            if ranks:
                out[name] = ranks
    return out


_graph_lines: GraphLines | None = None


def _recompiled(compiled: Any) -> Any:
    """Dynamo turns a lazy GraphModule its backend returned into its real forward right away (output_graph.py);
    wrapped, it would not recognize one, so do the same first."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return compiled
    owner = compiled if isinstance(compiled, _LazyGraphModule) else getattr(compiled, "__self__", None)
    if isinstance(owner, _LazyGraphModule) and (owner is compiled or getattr(compiled, "__name__", "") == "_lazy_forward"):
        _LazyGraphModule.force_recompile(owner)
        return compiled if owner is compiled else owner.forward
    return compiled


_OUTPUT_GRAPH = "torch._dynamo.output_graph"


def install_compile_hook() -> None:
    """Wrap what Dynamo returns for each graph with collectives so each run of it is a phase; the graph and the
    backend are left as they are (the backend gets the same graph, its result is called with the same args).
    Importing Dynamo costs a rank 1.2 s (more under load, long enough for a short ``--timeout`` to call the start-up
    a hang): a script that compiles imports it anyway, so the hook goes in when it does (patches.py's import hook)."""
    if _OUTPUT_GRAPH in sys.modules:
        _hook_output_graph(sys.modules[_OUTPUT_GRAPH])
        return
    from distcheck.rank.autocheck.patches import _PatchOnImport

    if not any(isinstance(f, _PatchOnImport) and _OUTPUT_GRAPH in f.targets for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport({_OUTPUT_GRAPH: _hook_output_graph}))


def _hook_output_graph(module: Any) -> None:
    OutputGraph = getattr(module, "OutputGraph", None)
    if OutputGraph is None:  # a Dynamo without this class: compiled collectives are named less precisely
        return
    original = OutputGraph.call_user_compiler
    if getattr(original, "__distcheck_original__", None) is not None:
        return

    @functools.wraps(original)
    def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
        try:
            colls = graph_collectives(gm)
            symbols = symbol_sources(gm) if any(isinstance(d, str) for c in colls
                                                for d in c.get("input_shape") or ()) else []
            code = self.root_tx.f_code
        except Exception as exc:  # introspection must never fail a compile
            log.debug("distcheck: cannot read a compiled graph: %s", exc)
            colls, code, symbols = [], None, []
        compiled = original(self, gm, example_inputs)
        if not colls or code is None or len(phases.graphs) >= _GRAPH_LIMIT:
            return compiled
        compiled = _recompiled(compiled)
        gid = len(phases.graphs) + 1
        phases.graphs[gid] = {"fn": code.co_name, "file": code.co_filename, "line": code.co_firstlineno,
                              "collectives": colls, "symbols": symbols}

        @functools.wraps(compiled)  # keeps the backend's attributes (_boxed_call: called with one list)
        def run_graph(*args: Any, **kwargs: Any) -> Any:
            pid = phases.begin("compiled", code.co_filename, code.co_firstlineno, graph=gid, fn=code.co_name)
            lines = _graph_lines
            if lines is not None:
                try:
                    lines.run(gid, phases.open[pid]["t0"], args)
                except Exception as exc:  # a line never fails the user's step
                    log.debug("distcheck: cannot record a graph run: %s", exc)
            try:
                return compiled(*args, **kwargs)
            finally:
                phases.end(pid)

        return run_graph

    call_user_compiler.__distcheck_original__ = original  # type: ignore[attr-defined]
    OutputGraph.call_user_compiler = call_user_compiler


# -- the ring -------------------------------------------------------------------------------------------------------
def _c10d() -> Any:
    import torch

    return torch._C._distributed_c10d


def _rings() -> list[tuple[str, Callable[[bool, bool], Any]]]:
    """torch keeps two rings: NCCL's (ProcessGroupNCCL, with completion times from its watchdog) and the one of
    every other backend (gloo: no completion times); each has its own dump function. CPU builds have only the
    second."""
    c10d = _c10d()
    return [(name, fn) for name, fn in (("nccl", getattr(c10d, "_dump_nccl_trace_json", None)),
                                        ("c10d", getattr(c10d, "_dump_fr_trace_json", None))) if fn is not None]


def read_status() -> dict[str, tuple[int, int]] | None:
    """{ring:group id: (last enqueued, last completed) collective_seq_id}, without reading the entries (43 µs for
    gloo's ring, JSON included, on this project's VM on a slow day; 60 µs for NCCL's on an H100 host)."""
    out = {}
    for ring, fn in _rings():
        try:
            status = json.loads(fn(False, False)).get("pg_status") or {}
        except Exception:
            continue
        for gid, s in status.items():
            try:
                out[f"{ring}:{gid}"] = (int(s.get("last_enqueued_collective", -1)),
                                        int(s.get("last_completed_collective", -1)))
            except (TypeError, ValueError):
                continue
    return out or None


_known_groups: dict[str, list[int]] = {}  # every group seen alive: destroy_process_group forgets them before the exit


def _group_names() -> dict[str, list[int]]:
    """{group name: global ranks} of every process group this rank has known (the ring names groups, gloo's dump
    has no ranks for them). Refreshed by the status thread, since the script's ``destroy_process_group()`` empties
    torch's registry before the exit dump."""
    try:
        import torch.distributed as dist

        world = dist.distributed_c10d._world
        for pg, name in list(world.pg_names.items()):
            if str(name) not in _known_groups:
                _known_groups[str(name)] = list(dist.get_process_group_ranks(pg))
    except Exception:
        pass
    return dict(_known_groups)


def _settle(limit: float = 1.0) -> None:
    """At the exit dump: give NCCL ops still queued on the GPU a bounded moment to complete, so that a correct
    script's last collective is not left open."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        status = read_status() or {}
        if all(done >= enq for key, (enq, done) in status.items() if key.startswith("nccl:")):
            return
        time.sleep(0.02)


_dump_lock = threading.Lock()


_KEEP = ("record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name",
         "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "state", "time_created_ns",
         "time_discovered_completed_ns", "thread_id")


def _all_traced(report_dir: str | os.PathLike, rank: int, entries: list[dict[str, Any]], status: dict[str, Any],
                snapshot: dict[str, Any]) -> bool:
    """Whether the rank's own trace holds every collective its groups counted (analysis/flight_recorder.traced_ring,
    from the trace files as they are now: the records are in the page cache, the sig lines written one by one).
    Costs the dump a read of the record file (24 bytes a collective, with numpy) and one look per held entry.

    On NCCL, the ends the ring knows of traced records left open for it are stored into the record file first
    (a failed store: False, the dump keeps its entries and the analysis's merge stores them)."""
    try:
        trace_file = files.rank_file(report_dir, "trace_events", rank)
        text = files.rank_file(report_dir, "trace", rank).read_text(encoding="utf-8", errors="replace")
        binary = trace_file.read_bytes()
        from distcheck.analysis.flight_recorder import traced_ring

        ring = traced_ring(entries, status, text.splitlines(), binary, snapshot)
        if ring is None:
            return False
        if ring.ends:
            _store_ends(trace_file, ring.ends)
        return True
    except Exception as exc:  # no trace (recorder without tracer), a format of another version: keep the entries
        log.debug("distcheck: cannot hold the ring against the trace: %s", exc)
        return False


def _store_ends(path: Path, ends: dict[int, float]) -> None:
    """Store each record's end (slot -> time) in place. Through the file, not the tracer's map: the same page
    cache, and it also works once the tracer has unmapped it. Only records the tracer leaves open forever (their
    sig says ``completion: flight_recorder``) are written, so no other thread stores into these bytes."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for slot, t_end in ends.items():
            data = trace_slots.END_TIME.pack(t_end)
            if os.pwrite(fd, data, slot * trace_slots.SIZE + trace_slots.END_OFFSET) != len(data):
                raise OSError(f"short write into {path}")
    finally:
        os.close(fd)


def document(rank: int, reason: str, entries: list[dict[str, Any]], status: dict[str, Any],
             groups: dict[str, list[int]], snapshot: dict[str, Any], all_traced: bool) -> dict[str, Any]:
    """``flight-rank<R>.json``'s content. A rank whose trace holds every collective its groups counted writes no
    entries, phases or group lists (what only names untraced entries), just the counters and ``all_traced``: a
    4096-rank job's dumps then cost its analysis a few hundred bytes each, and keep it summarized
    (analysis/trace_events.load_traces)."""
    if all_traced:
        entries, groups, snapshot = [], {}, {**snapshot, "phases": [], "graphs": {}}
    return {"rank": rank, "t": time.time(), "reason": reason,
            "buffer": int(os.environ.get(ENV_BUFFER, "0") or 0), "all_traced": all_traced, "entries": entries,
            "pg_status": status, "groups": groups, **snapshot}


def dump(report_dir: str | os.PathLike, rank: int, reason: str) -> bool:
    """Write the ring, the phases and the group names to ``flight-rank<R>.json`` (whole, or not at all)."""
    with _dump_lock:  # the main thread's exit dump and the status thread's answer to a request
        return _dump(report_dir, rank, reason)


def _dump(report_dir: str | os.PathLike, rank: int, reason: str) -> bool:
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    for ring, fn in _rings():
        try:
            data = json.loads(fn(True, False))
        except Exception as exc:
            log.debug("distcheck: no %s Flight Recorder dump: %s", ring, exc)
            continue
        entries += [{"ring": ring, **{k: e.get(k) for k in _KEEP}} for e in data.get("entries") or []]
        for gid, s in (data.get("pg_status") or {}).items():
            status[f"{ring}:{gid}"] = s
    if not entries and not status:
        return False
    snapshot = phases.snapshot()
    doc = document(rank, reason, entries, status, _group_names(), snapshot,
                   _all_traced(report_dir, rank, entries, status, snapshot))
    exc = flight_dump_file.write(report_dir, rank, doc)
    if exc is not None:  # a full disk must not break the user's training
        log.debug("distcheck: cannot write the Flight Recorder dump of rank %d: %s", rank, exc)
        return False
    return True


class Sink:
    """The rank's daemon thread: looks at the counters, rewrites the status file when they moved (at most every
    WRITE_S, with the looks of the last HISTORY_S), answers dump requests."""

    def __init__(self, report_dir: str | os.PathLike, rank: int) -> None:
        self.report_dir = Path(report_dir)
        self.rank = rank
        self.status_path = files.rank_file(report_dir, "flight_status", rank)
        self.request_path = self.report_dir / files.FLIGHT_REQUEST
        self._stop = threading.Event()
        self._last: dict[str, tuple[int, int]] | None = None  # what the file says
        self._written = 0.0
        self._looks: list[flight_status_file.Look] = []  # (time, enqueued counts, the look before) at each change
        self._looked: float | None = None  # the time of the last look: a change the next one sees came after it
        self._answered = time.time()  # a request left in a reused report dir is not for this run
        self._thread = threading.Thread(target=self._run, name="distcheck-flight", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        status = read_status()
        if status:
            counts = {g: e for g, (e, _) in status.items()}
            if not self._looks or self._looks[-1][1] != counts:
                self._looks.append((now, counts, self._looked if self._looked is not None else now))
                _group_names()  # new groups since the last look: remembered before the script destroys them
            if status != self._last and now - self._written >= flight_status_file.WRITE_S:
                self._write(status, now)
        self._looked = now
        try:
            asked = self.request_path.stat().st_mtime
        except OSError:
            return
        if asked > self._answered:
            self._answered = asked
            dump(self.report_dir, self.rank, "requested")

    def _write(self, status: dict[str, tuple[int, int]], now: float) -> None:
        """One small write: the watch loop reads the progress (files.flight_progress), the live straggler look the
        looks, the last of them at this moment (contract/flight_status_file.py)."""
        recent = [i for i, look in enumerate(self._looks) if look[0] >= now - flight_status_file.HISTORY_S]
        # the counts the window starts with: the last change before it
        del self._looks[:max(0, (recent[0] if recent else len(self._looks)) - 1)]
        self._last, self._written = status, now
        try:
            last = [(now, self._looks[-1][1], now)] if self._looks[-1][0] < now else []  # the counts hold now
            flight_status_file.write(self.status_path, flight_status_file.text(status, self._looks + last))
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # never let the thread die loudly in the user's process
                log.debug("distcheck: flight recorder poll failed: %s", exc)


_sink: Sink | None = None


def start(report_dir: str | os.PathLike, rank: int, lines: Any = None) -> None:
    """Before the script runs: the ring's size, the phase marks, the compile hook, the status thread (a new
    report dir replaces the old thread) and, with the tracer's line writer ``lines``, each compiled graph's runs."""
    global _sink, _graph_lines
    if not enabled():
        return
    enable_env()
    try:
        install_phases()
        install_compile_hook()
    except Exception as exc:  # a torch without these hooks: untraced entries are named less precisely
        log.debug("distcheck: flight recorder hooks not installed: %s", exc)
    stop()
    phases.reset()  # a pytest pool runs test after test in one process: a DDP model of an earlier test is gone
    _group_names()
    _sink = Sink(report_dir, rank)
    _sink.start()
    _graph_lines = None if lines is None else GraphLines(lines)


def stop() -> None:
    global _sink, _graph_lines
    _graph_lines = None
    if _sink is not None:
        _sink.stop()
        _sink = None


def final_dump(reason: str) -> None:
    """At the end of the script (returned or raised): the whole ring for the report."""
    sink = _sink
    if sink is not None:
        _settle()
        dump(sink.report_dir, sink.rank, reason)
