"""Collective tracer: every collective a rank issues, with its user call site, recorded on disk as it happens.

    python -m distcheck run --nproc 2 -- train.py          # installs it in every rank

``install(report_dir, rank)`` replaces the collective functions of ``torch.distributed``,
``torch.distributed.distributed_c10d`` and ``torch.distributed._functional_collectives`` by thin wrappers.
Callers look these functions up as module attributes at call time (``dist.all_reduce``, FSDP2's
``dist.all_gather_single``, DTensor's ``funcol.all_gather_single``), so wrapping the attributes covers the public
API, FSDP2's internal collectives and the functional collectives DTensor issues. The wrappers call the original
with the original arguments and return its result untouched, so semantics (return values, async Work objects,
exceptions) do not change. Calls made while a traced call is running on the same thread (``all_gather_object``'s
internal all_gather, ``all_gather_into_tensor`` delegating to ``all_gather_single``) are not traced: the trace
names the op the user wrote, not torch's internals.

Each call records a ``start`` before the call and an ``end`` when the op completes:

* ops that return a Work (``async_op=True``, ``isend``): from the Work's future, i.e. when the backend says the
  op finished (on NCCL, when the GPU has run it), not when the call returned;
* synchronous ops on CPU tensors (gloo): on return, which is when gloo has finished them;
* synchronous ops on CUDA tensors: NCCL returns once the op is queued on the stream. NCCL's own Flight Recorder
  ring records when it completed (rank/flight_recorder.py dumps it; the analysis stores that end into the trace):
  the sig says ``completion: flight_recorder`` and the record stays open. Otherwise (the recorder off, another
  backend) a CUDA event is recorded after it on the current stream and a completion thread writes the end when the
  event has passed;
* functional collectives: when issued, flagged as such, since their completion is only observable through
  ``wait_tensor``.

Each collective is one 24-byte record stored into a shared memory map of ``<report_dir>/trace-rank<R>.bin``
(contract/trace_slots.py): its start is stored before the call, its end time into the same record when the op
completes; plain memory writes, no system call, and the kernel keeps the pages of a SIGKILLed rank. The map only
ever covers blocks allocated beforehand, so a full report file system stops the recording, never the rank with a
SIGBUS (rank/trace_log.py). What each distinct call looks like (op, group, shapes, dtypes, the user's call site) is
written once, as a ``sig`` JSON line in ``trace-rank<R>.jsonl`` next to the meta, error and exit lines; a call is
known again by its key (rank/call_keys.py). The ends of synchronous CUDA ops without NCCL's ring come from CUDA
events (rank/cuda_completions.py). ``bench/bench_trace.py`` measures the cost per
collective on a no-op process group (docs/performance.md).

The common case, a call whose description is cached, runs in C (``_tracefast.c``, built where a C compiler is
there): one call from the wrapper finds the user's frame, keys the call, stores its start, calls torch's function
and stores its end. Everything else comes back to the Python path below (``python_path``, ``finish``, ``failed``),
which shares the C path's cache and slot counter, so each rule is written once, here.
``DISTCHECK_TRACE_HOT_PATH=python`` leaves the C path out; the meta line names the path that ran.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import struct
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

from distcheck.analysis.frame_owner import LIBRARY, USER, location, owner
from distcheck.analysis.ops import C10D_OPS, FUNCOL_OPS, P2P_OPS
from distcheck.contract import env, files
from distcheck.contract import trace_lines
from distcheck.contract import trace_slots
from distcheck.processes import agent_pid
from distcheck.rank import flight_recorder
from distcheck.rank.call_keys import CACHE_LIMIT, UNCACHED, call_key
from distcheck.rank.cuda_completions import CudaCompletions
from distcheck.rank.trace_log import TraceLog
from distcheck.rank.usersite import is_internal
from distcheck.contract.site import file_line

try:  # the hot path in C, built by setup.py where a C compiler is there (docs/performance.md)
    from distcheck.rank import _tracefast
except ImportError:  # not built (no compiler at install, Python < 3.11): the Python path does everything
    _tracefast = None
ENV_HOT_PATH = env.TRACE_HOT_PATH  # "python": leave the C path out (to compare the two, or rule it out)
if os.environ.get(ENV_HOT_PATH, "").strip().lower() == "python":
    _tracefast = None


def _current_build(fast: Any) -> bool:
    """Whether a built C path is this tracer's: one built from an older layout (a stale build next to a newer
    tracer) would store records at the wrong place, and one from before Recorder.call (2026-11-27) takes none of
    the wrapper's callbacks."""
    layout = (fast.RECORD_SIZE, fast.START_TIME_OFFSET, fast.END_OFFSET, getattr(fast, "UNRECORDED_OFFSET", None))
    return layout == (trace_slots.SIZE, trace_slots.START_TIME_OFFSET, trace_slots.END_OFFSET,
                      trace_slots.UNRECORDED_OFFSET) and hasattr(fast.Recorder, "call")


if _tracefast is not None and not _current_build(_tracefast):
    _tracefast = None

log = logging.getLogger("distcheck")

# What the wrapper does once a synchronous op returned (the second item of a cached sig, which _tracefast.c reads
# with the same numbers): write its end now, record a CUDA event for it, or nothing (a synchronous NCCL op whose
# end NCCL's ring records: no Python call at all on that path).
AFTER_END, AFTER_EVENT, AFTER_NOTHING = 0, 1, 2

ENV_REPORT_DIR = env.REPORT_DIR

# Parameters that name the root of a rooted collective or the peer of a point-to-point op.
_GLOBAL_RANK_PARAMS = ("src", "dst")
_GROUP_RANK_PARAMS = ("group_src", "group_dst")
_SKIP_SHAPES = frozenset({"group", "op", "reduceOp", "async_op", "tag", "src", "dst", "group_src", "group_dst",
                          "output_split_sizes", "input_split_sizes", "timeout", "wait_all_ranks", "device_ids",
                          "use_batch", "device", "object_list", "obj", "object_gather_list", "scatter_object_output_list",
                          "scatter_object_input_list", "gather_dim", "scatter_dim", "src_dst", "p2p_op_list"})
_DEFAULT_GROUP = object()  # cache key of group=None (the default group)


def note_lost(bit: int, exc: OSError) -> None:
    """A per-rank file other than the trace lost a write (records, findings, automatic-check state; ``bit``: a
    trace_slots.LOST_* value): kept in this rank's trace header, so the report can say what is missing."""
    tracer = _tracer
    if tracer is not None:
        tracer.events.lost(bit, exc.errno or 0)


def trace_path(report_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(report_dir, "trace", rank)


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _reduce_op_name(op: Any) -> str | None:
    if op is None:
        return None
    if isinstance(op, str):
        return op.upper()
    name = getattr(op, "name", None)  # ReduceOp.RedOpType
    if name is None and getattr(op, "op", None) is not None:
        # A ReduceOp instance (NCCL's PREMUL_SUM, which FSDP2's set_gradient_divide_factor uses) prints with its
        # address, which differs per rank: its RedOpType is the name.
        name = getattr(op.op, "name", None)
    if name is None:
        text = str(op)  # ReduceOp instances print like "ReduceOp.SUM" or "<...PREMUL_SUM...>"
        name = text.rsplit(".", 1)[-1].strip("<>")
    return str(name).upper()


_NESTED = object()  # _user_frame's answer for a call made while a traced call is on the same thread's stack
# Stands in for torch.compiler where a torch has no compile flag: its is_compiling() is then the whole test.
_NOT_COMPILING = types.SimpleNamespace(_is_compiling_flag=False)


SPLIT_PEERS = 1024  # the per-peer sizes of an exchange are recorded for groups up to this size


def _shape(t: Any, Tensor: type) -> list[int] | None:
    return list(t.shape) if isinstance(t, Tensor) else None


def _rows(splits: Any, tensor: Any, n: int, Tensor: type) -> list[list[int]] | None:
    """all_to_all_single's per-peer blocks as shapes: ``splits[j]`` rows of the tensor's row shape, or dim 0 split
    evenly over the ``n`` peers when no splits are given (what torch does)."""
    if not isinstance(tensor, Tensor) or tensor.dim() == 0:
        return None
    row = list(tensor.shape[1:])
    if splits is None:
        return [[tensor.shape[0] // n, *row]] * n
    try:
        return [[int(k), *row] for k in splits]
    except (TypeError, ValueError):
        return None


def _peer_split(op: str, params: dict[str, Any], n: int, Tensor: type) -> dict[str, Any] | None:
    """What this rank sends to and expects from each peer of an exchange, by its place in the group: ``{"send":
    [shape per peer], "recv": [shape per peer]}``. Recorded with the call's start, before the backend sees it, so
    it survives a backend that aborts on sizes that do not pair up (gloo). Peer i's send to j must equal j's recv
    from i (analysis/split_matrix.py). None for other ops, and past SPLIT_PEERS ranks."""
    if n == 0 or n > SPLIT_PEERS:
        return None
    if op in ("all_to_all_single", "all_to_all_single_autograd"):
        inp = params.get("input", params.get("self"))
        out = params.get("output")
        send = _rows(params.get("input_split_sizes"), inp, n, Tensor)
        out_splits = params.get("output_split_sizes")
        # The functional form allocates its output: its rows come from output_split_sizes, else from the input's.
        recv = _rows(out_splits, out if out is not None else inp, n, Tensor)
        if send is None or recv is None:
            return None
        return {"send": send, "recv": recv, "unit": "rows"}
    if op == "all_to_all":
        ins, outs = params.get("input_tensor_list"), params.get("output_tensor_list")
        if not isinstance(ins, (list, tuple)) or not isinstance(outs, (list, tuple)):
            return None
        return {"send": [_shape(t, Tensor) for t in ins], "recv": [_shape(t, Tensor) for t in outs]}
    if op == "all_gather":
        outs, mine = params.get("tensor_list"), _shape(params.get("tensor"), Tensor)
        if not isinstance(outs, (list, tuple)) or mine is None:
            return None
        return {"send": [mine] * n, "recv": [_shape(t, Tensor) for t in outs]}
    if op == "reduce_scatter":
        ins, mine = params.get("input_list"), _shape(params.get("output"), Tensor)
        if not isinstance(ins, (list, tuple)) or mine is None:
            return None
        return {"send": [_shape(t, Tensor) for t in ins], "recv": [mine] * n}
    return None


def _library_call(user: Any) -> str | None:
    """The call the user's line made into a third-party library on the way to this collective (Lightning's
    ``self.log(..., sync_dist=True)``), as ``lightning/pytorch/core/module.py:512 in log``; None when the user's
    code called torch directly. Once per sig, so the walk costs nothing per collective."""
    try:
        frame = sys._getframe(2)
    except ValueError:
        return None
    outer = None
    while frame is not None and frame is not user:
        if owner(frame.f_code.co_filename) == LIBRARY:
            outer = frame  # the outermost library frame below the user's is the call the user made
        frame = frame.f_back
    if frame is None or outer is None:
        return None
    return location(outer.f_code.co_filename, outer.f_lineno, outer.f_code.co_name)


class Tracer:
    """The installed tracer of this process (one at a time; see install / uninstall)."""

    def __init__(self, report_dir: str | os.PathLike, rank: int) -> None:
        import torch

        self._torch = torch
        self.rank = rank
        self.path = trace_path(report_dir, rank)
        self.writer = trace_lines.LineWriter(self.path)
        self.events = TraceLog(files.rank_file(report_dir, "trace_events", rank))
        self.writer.on_lost = functools.partial(self.events.lost, trace_slots.LOST_LINES)
        # Without a CUDA (or ROCm) build no tensor is on the GPU: keys leave the device out (~60 ns a tensor).
        self._gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
        self._internal: dict[str, bool] = {}  # file name -> not the user's code (usersite's one rule, cached)
        self._fast = None if _tracefast is None else _tracefast.Log(self.events.mm, self._internal, torch.Tensor,
                                                                    self._gpu_build)
        if self._fast is not None:
            self.events.attach(self._fast)
        self.writer.write({"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "pid": os.getpid(),
                           "host": socket.gethostname(),
                           "ppid": agent_pid(), "t": time.time(), "argv": list(sys.argv),
                           "torch": torch.__version__, "hot_path": "python" if self._fast is None else "c"})
        self._sig_ids = itertools.count(1)
        self._codes: dict[int, Any] = {}  # id -> code object of every call site cached by id: ids stay unique
        self._groups: dict[Any, tuple[str, str | None, tuple[int, ...]]] = {}
        self._backends: dict[str | None, str] = {}  # group name -> "nccl", "gloo", ...
        self._traced_code: Any = None  # the code object every wrapper shares (see _user_frame)
        self._patched: list[tuple[Any, str, Any]] = []
        # Called with (works, op, args, kwargs, site) for each Work a call from the user's own line returned
        # (rank/autocheck/async_work.py); None: nobody asks.
        self.on_async: Callable[..., None] | None = None
        self.completions = CudaCompletions(self._write_end, lambda: torch.cuda.Event(), self._sig_of)

    def _sig_of(self, eid: int) -> int:
        """The sig a record names (its start word's high half)."""
        return trace_slots.START_SLOT.unpack_from(self.events.mm, eid * trace_slots.SIZE)[0] >> 32

    def _write_end(self, eid: int, t: float) -> None:
        self.events.end(eid, t)

    def close(self) -> None:
        self.completions.drain(timeout=1.0)
        self.events.close()
        self.writer.close()

    # -- process groups -------------------------------------------------------------------------------------
    def _group_info(self, group: Any, funcol: bool) -> tuple[str, str | None, tuple[int, ...]]:
        """(ranks as "0,1", group name, global ranks) of a c10d group argument or a functional RANK_TYPES."""
        import torch.distributed as dist

        key = _DEFAULT_GROUP if group is None else group
        if isinstance(group, list):
            key = tuple(group)
        elif isinstance(group, tuple):
            key = (id(group[0]),) + tuple(group[1:])
        try:
            hit = self._groups.get(key)
        except TypeError:
            hit, key = None, None
        if hit is not None:
            return hit
        c10d = dist.distributed_c10d
        name: str | None = None
        ranks: tuple[int, ...] = ()
        try:
            if isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group):
                ranks = tuple(group)
            else:
                pg = group
                if funcol:
                    from torch.distributed import _functional_collectives as fc

                    resolved = fc._resolve_group(group)
                    pg = c10d._resolve_process_group(resolved) if isinstance(resolved, str) else resolved
                if pg is None:
                    pg = c10d._get_default_group()
                name = getattr(pg, "group_name", None)
                ranks = tuple(dist.get_process_group_ranks(pg))
                try:
                    self._backends[name] = str(dist.get_backend(pg))
                except Exception:  # a group of a backend torch cannot name: no completion from its ring
                    pass
        except Exception as exc:  # an invalid group: the real call raises the user-facing error
            log.debug("cannot resolve process group %r: %s", group, exc)
        info = (",".join(map(str, ranks)), name, ranks)
        if key is not None and ranks:
            self._groups[key] = info
        return info

    # -- events ---------------------------------------------------------------------------------------------
    def _describe(self, op: str, names: tuple[str, ...], args: tuple, kwargs: dict, funcol: bool,
                  default_op: str | None = None) -> dict[str, Any]:
        params = dict(zip(names, args))
        if kwargs:
            params.update(kwargs)
        Tensor = self._torch.Tensor
        pg, pg_name, pg_ranks = self._group_info(params.get("group"), funcol)
        shapes: list[list[int]] = []
        dtypes: list[str] = []
        p2p: list[dict[str, Any]] | None = None
        cuda = False
        for pname, value in params.items():
            if pname in _SKIP_SHAPES:
                continue
            if isinstance(value, Tensor):
                shapes.append(list(value.shape))
                dtypes.append(_dtype_name(value))
                cuda = cuda or value.is_cuda
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
                for t in value:
                    if isinstance(t, Tensor):
                        shapes.append(list(t.shape))
                        dtypes.append(_dtype_name(t))
                        cuda = cuda or t.is_cuda
        if op == "batch_isend_irecv":
            p2p = []
            for item in params.get("p2p_op_list") or ():
                t = getattr(item, "tensor", None)
                kind = getattr(getattr(item, "op", None), "__name__", str(getattr(item, "op", "?")))
                ipg, _, iranks = self._group_info(getattr(item, "group", None), False)
                peer = getattr(item, "peer", None)
                if peer is None and getattr(item, "group_peer", None) is not None and iranks:
                    peer = iranks[item.group_peer]
                p2p.append({"op": kind, "peer": peer, "pg": ipg,
                            "shape": list(t.shape) if t is not None else None,
                            "dtype": _dtype_name(t) if t is not None else None})
                if t is not None:
                    shapes.append(list(t.shape))
                    dtypes.append(_dtype_name(t))
            if p2p:
                pg = p2p[0]["pg"]
                pg_ranks = tuple(int(r) for r in pg.split(",")) if pg else pg_ranks
        root = None
        for pname in _GLOBAL_RANK_PARAMS:
            if params.get(pname) is not None:
                root = int(params[pname])
        for pname in _GROUP_RANK_PARAMS:
            if params.get(pname) is not None and pg_ranks:
                root = int(pg_ranks[int(params[pname])])
        if funcol and op == "broadcast" and root is not None and pg_ranks:
            root = int(pg_ranks[root])  # funcol.broadcast takes a group-relative src
        reduce_op = _reduce_op_name(params.get("op", params.get("reduceOp"))) or default_op
        event: dict[str, Any] = {"op": op, "cuda": cuda, "pg": pg, "pg_name": pg_name, "shapes": shapes,
                                 "dtypes": dtypes, "reduce_op": reduce_op}
        if op in P2P_OPS:
            event["peer"] = root
            event["root"] = None
        else:
            event["peer"] = None
            event["root"] = root
        if params.get("output_split_sizes") is not None or params.get("input_split_sizes") is not None:
            event["uneven"] = True
        split = _peer_split(op, params, len(pg_ranks), Tensor)
        if split is not None:
            event["split"] = split
        if p2p is not None:
            event["p2p"] = p2p
        if funcol:
            event["api"] = "functional"
        if op in ("broadcast_object_list", "scatter_object_list"):
            objs = params.get("object_list", params.get("scatter_object_output_list"))
            event["objects"] = len(objs) if isinstance(objs, list) else None
        return event

    def _user_frame(self, frame: Any) -> Any:
        """The first frame, from ``frame`` outwards, in the user's code (None when there is none), or _NESTED when a
        traced call is on the way there: then torch is running this op for a traced one (``all_gather_object``'s
        all_gather), and the trace names the op the user wrote, not torch's internals. Only calls from torch's
        or distcheck's own code get here, so a user's direct call pays for no thread-local flag."""
        internal = self._internal
        traced_code = self._traced_code
        while frame is not None:
            code = frame.f_code
            if code is traced_code:
                return _NESTED
            filename = code.co_filename
            hit = internal.get(filename)
            if hit is None:
                hit = internal[filename] = is_internal(filename)
            if not hit:
                return frame
            frame = frame.f_back
        return None

    def _new_sig(self, op: str, names: tuple[str, ...], args: tuple, kwargs: dict, funcol: bool,
                 default_op: str | None, frame: Any) -> tuple[int, int]:
        """Describe a call in full, write its ``sig`` line and return (the first word of its records, what the
        wrapper does after the op: AFTER_END, AFTER_EVENT or AFTER_NOTHING)."""
        event = self._describe(op, names, args, kwargs, funcol, default_op)
        if frame is not None:
            self._codes[id(frame.f_code)] = frame.f_code  # the cache keys it by id: it must never be reused
            event.update(site=file_line(frame.f_code.co_filename, frame.f_lineno),
                         file=frame.f_code.co_filename, line=frame.f_lineno)
            via = _library_call(frame)
            if via:
                event["via"] = via
        else:
            event.update(site=None, file=None, line=None)
        cuda = event.pop("cuda", False)
        sig = next(self._sig_ids)
        after = AFTER_EVENT if cuda else AFTER_END
        if cuda and "nccl" in self._backends.get(event.get("pg_name"), "") and flight_recorder.ring_kept():
            # NCCL's own Flight Recorder ring records when each op completed (its watchdog queries the events
            # ProcessGroupNCCL records anyway); an event of ours cost 10 to 50 µs per collective on an H100
            # (docs/performance.md, GPU). The record stays open; the analysis stores the ring's end into it.
            self.completions.ring_sigs.add(sig)
            event["completion"] = "flight_recorder"
            after = AFTER_NOTHING
        self.writer.write({"ev": "sig", "sig": sig, **event})
        # A functional collective's end is when it was issued: its completion is only seen by wait_tensor.
        return trace_slots.start_word(sig, trace_slots.ISSUED if funcol else 0), after

    def wrap(self, fn: Callable, op: str, funcol: bool) -> Callable:
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}
        names = tuple(parameters)
        # The reduce op the call uses when the caller leaves it out (c10d defaults to SUM).
        default_op = None
        for pname in ("op", "reduceOp"):
            if pname in parameters and parameters[pname].default is not inspect.Parameter.empty:
                default_op = _reduce_op_name(parameters[pname].default)
        Work = None
        try:
            from torch.distributed.distributed_c10d import Work
        except ImportError:  # pragma: no cover - every supported torch has Work
            pass

        # Everything the hot path touches is a local of this closure: each attribute lookup saved is 30 to 80 ns,
        # and the whole wrapper has to stay near 1 µs (bench/bench_trace.py).
        getframe = sys._getframe
        user_frame = self._user_frame
        internal_get = self._internal.get
        sigs: dict[tuple, tuple[int, int]] = {}  # call key -> (first word of its records, AFTER_*)
        events = self.events
        claim = events.claim
        grow = events.grow
        mm = events.mm
        pack_start = trace_slots.START_SLOT.pack_into
        pack_end = trace_slots.END_TIME.pack_into
        now = time.time
        SIZE, END_OFFSET = trace_slots.SIZE, trace_slots.END_OFFSET
        Tensor = self._torch.Tensor
        gpu_build = self._gpu_build
        cacheable = op not in UNCACHED
        new_sig = self._new_sig
        completions = self.completions
        writer = self.writer
        # The C path (_tracefast.c): the common case in one call, sharing this wrapper's cache (its Recorder is made
        # below: it needs this wrapper's code object).
        fast = self._fast
        call = None
        end = fast.end if fast is not None else None
        # Under torch.compile, Dynamo inlines this wrapper: it folds is_dynamo_compiling() to True and sees ``fn``,
        # torch's own function, which it rewrites into a traceable collective, as it does without distcheck. The C
        # path and the Python path below are nothing it could trace (``fullgraph=True`` would reject the graph
        # break). What a compiled graph issues is seen from the process group's own record
        # (rank/flight_recorder.py). The flag covers the rest of what torch.compiler.is_compiling() says True to
        # (a compile session, torch.export's non-strict tracing). In eager mode: a call that returns False and an
        # attribute read, 110 ns on this project's machine, where is_compiling(), which also calls
        # torch.jit.is_scripting(), took 270 ns.
        compiler = self._torch.compiler
        is_dynamo_compiling = getattr(compiler, "is_dynamo_compiling", None)
        if is_dynamo_compiling is None or not hasattr(compiler, "_is_compiling_flag"):  # a torch without them
            is_dynamo_compiling, compiler = compiler.is_compiling, _NOT_COMPILING

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if is_dynamo_compiling() or compiler._is_compiling_flag:
                return fn(*args, **kwargs)
            if call is not None:  # begin, the op and its end in C; what is not the common case comes back below
                return call(args, kwargs)
            return python_path(args, kwargs, None)

        def python_path(args: tuple, kwargs: dict, hkey: Any) -> Any:
            """The whole traced call in Python: where the C path is not built, and for what it hands over (a cache
            miss, with ``hkey`` its key; a file not classified yet; an argument it does not key)."""
            try:
                frame = getframe(2)  # traced's caller
            except ValueError:  # called straight from C (a thread started by _thread, say): no Python caller
                frame = None
            if frame is not None and internal_get(frame.f_code.co_filename) is not False:  # torch's caller
                frame = user_frame(frame)
                if frame is _NESTED:
                    return fn(*args, **kwargs)
            try:
                # The static part of an event (op, group, shapes, dtypes, reduce op, root, site) is described
                # once per distinct call and written as a sig line; the event names it by number. The call is
                # keyed by its site as (id(code), f_lasti): hashing a code object or computing f_lineno costs
                # up to 0.5 µs each (Python 3.11 computes both on every access).
                hit = None
                if cacheable and hkey is None:
                    hkey = call_key(frame, args, kwargs, Tensor, gpu_build)
                    try:
                        hit = sigs.get(hkey)
                    except TypeError:  # an unhashable argument: describe the call every time
                        hkey = None
                if hit is None:
                    hit = new_sig(op, names, args, kwargs, funcol, default_op, frame)
                    if cacheable and hkey is not None:
                        if len(sigs) >= CACHE_LIMIT:
                            sigs.clear()
                        sigs[hkey] = hit
                word, after = hit
                eid = claim()  # an event's id is the slot of its record
                offset = eid * SIZE
                try:  # no bounds check of our own: a store past the map's end fails, and then it grows
                    pack_start(mm, offset, word, now())
                except struct.error:
                    grow(offset)
                    pack_start(mm, offset, word, now())
            except Exception as exc:  # tracing must never break the user's collective
                log.debug("trace of %s failed: %s", op, exc)
                return fn(*args, **kwargs)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                failed(eid, exc)
                raise
            if result is None and not funcol and after == AFTER_END:
                try:  # the op has run: nothing may turn its result into an exception now
                    if end is not None:
                        end(eid)
                    else:
                        pack_end(mm, eid * SIZE + END_OFFSET, now())
                except Exception as exc:  # the trace closed under a running call (uninstall), a full disk
                    log.debug("trace of the end of %s failed: %s", op, exc)
            else:
                finish(eid, after, result, args, kwargs)
            return result

        def finish(eid: int, after: int, result: Any, args: tuple, kwargs: dict) -> None:
            """The end of a call whose end is not "now": a CUDA event, NCCL's ring, a Work's future, a functional
            collective (both paths)."""
            try:  # the op has run: nothing may turn its result into an exception now
                if result is None and not funcol:
                    if after == AFTER_EVENT:
                        completions.add(eid)
                    # AFTER_NOTHING: NCCL's ring gives the end; the record stays open
                else:
                    self._finish(eid, result, Work, funcol)
                    if self.on_async is not None and Work is not None and not funcol:
                        self._note_async(result, Work, op, args, kwargs)
            except Exception as exc:  # the trace closed under a running call (uninstall), a full disk, no CUDA
                log.debug("trace of the end of %s failed: %s", op, exc)

        def failed(eid: int, exc: BaseException) -> None:
            """The op raised: its record ends with the error (both paths); the exception goes on to the caller."""
            try:
                writer.write({"ev": "end", "id": eid, "t": now(), "error": f"{type(exc).__name__}: {exc}"})
            except Exception as error:  # a closed trace, a full disk: the user's exception matters, not ours
                log.debug("trace of the error of %s failed: %s", op, error)

        self._traced_code = traced.__code__  # the same for every wrapper: _user_frame knows a traced call by it
        if fast is not None and cacheable:
            call = _tracefast.Recorder(fast, sigs, traced.__code__, _NESTED, fn, python_path, finish, failed,
                                       funcol).call
        traced.__distcheck_original__ = fn  # type: ignore[attr-defined]
        return traced

    def _note_async(self, result: Any, Work: Any, op: str, args: tuple, kwargs: dict) -> None:
        """Hand a Work the user's own line got back (``async_op=True``, ``isend``) to ``on_async`` with the call's
        tensors and line: a call from torch or a library waits for its own Works."""
        works = [result] if isinstance(result, Work) else [w for w in result if isinstance(w, Work)] \
            if isinstance(result, list) else []
        if not works:
            return
        caller = sys._getframe(1)  # out to the traced call's caller (finish() is called from C or from Python)
        while caller is not None and caller.f_code is not self._traced_code:
            caller = caller.f_back
        caller = caller.f_back if caller is not None else None
        if caller is None or owner(caller.f_code.co_filename) != USER:
            return
        from distcheck.rank.usersite import Site

        self.on_async(works, op, args, kwargs, Site(caller.f_code.co_filename, caller.f_lineno))

    def _finish(self, eid: int, result: Any, Work: Any, funcol: bool) -> None:
        events = self.events
        works = None
        if Work is not None:
            if isinstance(result, Work):
                works = [result]
            elif isinstance(result, list) and result and all(isinstance(w, Work) for w in result):
                works = result
        if not works:  # a functional collective's record is flagged issued from its start
            events.end(eid, time.time())
            return
        try:
            futures = [w.get_future() for w in works]
            fut = futures[0] if len(futures) == 1 else self._torch.futures.collect_all(futures)
        except Exception:  # a backend without futures: the op is at least issued
            events.end(eid, time.time(), issued=True)
            return

        batch = len(futures) > 1
        writer = self.writer

        def done(f: Any) -> None:
            t = time.time()
            try:
                value = f.value()
                if batch:  # collect_all: a list of the batch's futures, each may have failed
                    for sub in value:
                        sub.value()
            except Exception as exc:
                writer.write({"ev": "end", "id": eid, "t": t, "error": f"{type(exc).__name__}: {exc}"})
                return
            events.end(eid, t)

        fut.add_done_callback(done)

    # -- installation ---------------------------------------------------------------------------------------
    def patch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped: dict[int, Callable] = {}
        # Modules of torch's that bound a collective by name at import (DTensor's _collective_utils does
        # ``from ...distributed_c10d import scatter``): already imported (a zygote preloads DTensor), they would call
        # the original. The same rebinding for them; modules imported later look the patched attribute up.
        importers = [m for name, m in list(sys.modules.items())
                     if m is not None and name.startswith("torch.distributed.") and m not in (c10d, dist)]
        # Their namespaces, read as dicts: getattr raises and catches an AttributeError for each name a module lacks
        # (running the module's own __getattr__ where it has one), 28 ops x 140 modules: 9 ms of each rank's start,
        # against 1 ms this way.
        namespaces = [(module, getattr(module, "__dict__", None) or {}) for module in (c10d, dist, *importers)]
        for op in C10D_OPS:
            fn = getattr(c10d, op, None)
            if fn is None:
                continue
            traced = wrapped.setdefault(id(fn), self.wrap(fn, op, funcol=False))
            for module, namespace in namespaces:
                if namespace.get(op) is fn:
                    self._patched.append((module, op, fn))
                    setattr(module, op, traced)
        self._keep_compile_rewrites(wrapped)
        try:
            from torch.distributed import _functional_collectives as fc
        except ImportError:  # pragma: no cover
            return
        for op in FUNCOL_OPS:
            fn = getattr(fc, op, None)
            if fn is None or hasattr(fn, "__distcheck_original__"):
                continue
            self._patched.append((fc, op, fn))
            setattr(fc, op, self.wrap(fn, op, funcol=True))

    @staticmethod
    def _keep_compile_rewrites(wrapped: dict[int, Callable]) -> None:
        """Dynamo rewrites ``dist.all_reduce`` & co. into traceable collectives by looking the callee up in
        ``traceable_collective_remaps``, whose keys are the functions ``_functional_collectives`` saw when it was
        imported: torch's own, or a wrapper of an earlier install (a pytest pool installs the tracer per test).
        Every one of them, the original and this install's wrapper must map to the same rewrite."""
        fc = sys.modules.get("torch.distributed._functional_collectives")
        remaps = getattr(fc, "traceable_collective_remaps", None)
        if not isinstance(remaps, dict):
            return
        for key, target in list(remaps.items()):
            original = getattr(key, "__distcheck_original__", None)
            if original is not None:
                remaps.setdefault(original, target)
        for traced in wrapped.values():
            target = remaps.get(traced.__distcheck_original__)
            if target is not None:
                remaps[traced] = target

    def unpatch(self) -> None:
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched.clear()

    def note(self, record: dict[str, Any]) -> None:
        """Write a non-collective line (``{"ev": "error", ...}``) into this rank's trace."""
        if record.get("ev") == "exit":  # the script is over: record the ends of GPU collectives still in flight
            self.completions.drain(timeout=1.0)
            flight_recorder.final_dump("exit")  # before the exit line: a reader that sees the exit finds the ring
            self.events.exited(bool(record.get("ok")), record.get("code") or 0)  # kept even when the line is lost
        record.setdefault("t", time.time())
        self.writer.write(record)


_tracer: Tracer | None = None


def install(report_dir: str | os.PathLike, rank: int) -> Tracer:
    """Start tracing this process's collectives into ``<report_dir>/trace-rank<rank>.jsonl``."""
    global _tracer
    if _tracer is not None:
        uninstall()
    Path(report_dir).mkdir(parents=True, exist_ok=True)
    _tracer = Tracer(report_dir, rank)
    _tracer.patch()
    # what the process group runs that Python does not call, and each compiled graph's runs in the trace's lines
    flight_recorder.start(report_dir, rank, _tracer.writer)
    return _tracer


def uninstall() -> None:
    """Restore the original torch.distributed functions and close the trace file."""
    global _tracer
    if _tracer is None:
        return
    flight_recorder.stop()
    _tracer.unpatch()
    _tracer.close()
    _tracer = None


def current() -> Tracer | None:
    return _tracer


