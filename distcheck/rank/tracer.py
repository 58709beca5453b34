"""Collective tracer: every collective a rank issues, with its user call site, as JSON lines on disk.

    DISTCHECK_TRACE=1 DISTCHECK_REPORT_DIR=out torchrun --nproc-per-node 2 train.py   # via distcheck.rank.tracer.install_from_env()
    python -m distcheck run --nproc 2 -- train.py                                     # installs it in every rank

``install(report_dir, rank)`` replaces the collective functions of ``torch.distributed``,
``torch.distributed.distributed_c10d`` and ``torch.distributed._functional_collectives`` by thin wrappers.
Callers look these functions up as module attributes at call time (``dist.all_reduce``, FSDP2's
``dist.all_gather_single``, DTensor's ``funcol.all_gather_single``), so wrapping the attributes covers the public
API, FSDP2's internal collectives and the functional collectives DTensor issues. The wrappers call the original
with the original arguments and return its result untouched, so semantics (return values, async Work objects,
exceptions) do not change. Calls made while a traced call is running on the same thread (``all_gather_object``'s
internal all_gather, ``all_gather_into_tensor`` delegating to ``all_gather_single``) are not traced: the trace
names the op the user wrote, not torch's internals.

Each call writes one ``start`` line before the call and one ``end`` line when it completes (sync calls: on
return; ``async_op=True``: from the Work's future callback; functional collectives: when the op has been issued,
flagged ``"issued": true``, since their completion is only observable through ``wait_tensor``). Lines go to
``<report_dir>/trace-rank<R>.jsonl`` with one unbuffered ``os.write`` on an O_APPEND descriptor each, so a
SIGKILLed rank keeps every line it wrote and lines from the future-callback thread never interleave.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from distcheck.analysis.ops import C10D_OPS, FUNCOL_OPS, P2P_OPS
from distcheck.contract import files
from distcheck.rank.usersite import SiteFinder

log = logging.getLogger("distcheck")

ENV_TRACE = "DISTCHECK_TRACE"
ENV_REPORT_DIR = "DISTCHECK_REPORT_DIR"

# Parameters that name the root of a rooted collective or the peer of a point-to-point op.
_GLOBAL_RANK_PARAMS = ("src", "dst")
_GROUP_RANK_PARAMS = ("group_src", "group_dst")
_SKIP_SHAPES = frozenset({"group", "op", "reduceOp", "async_op", "tag", "src", "dst", "group_src", "group_dst",
                          "output_split_sizes", "input_split_sizes", "timeout", "wait_all_ranks", "device_ids",
                          "use_batch", "device", "object_list", "obj", "object_gather_list", "scatter_object_output_list",
                          "scatter_object_input_list", "gather_dim", "scatter_dim", "src_dst", "p2p_op_list"})


_DEFAULT_GROUP = object()  # cache key of group=None (the default group)
# Ops whose start line is not cached (their payload is not described by shapes alone).
_UNCACHED = frozenset({"batch_isend_irecv", "all_gather_object", "gather_object", "broadcast_object_list",
                       "scatter_object_list", "send_object_list", "recv_object_list"})
_CACHE_LIMIT = 4096  # distinct call signatures kept; dynamic shapes must not grow memory without bound


class _Writer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        fd = self.fd
        if fd < 0:
            return
        try:
            os.write(fd, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())
        except OSError:
            pass  # a full disk must not break the user's training

    def write_raw(self, line: str) -> None:
        fd = self.fd
        if fd < 0:
            return
        try:
            os.write(fd, line.encode())
        except OSError:
            pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


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
    if name is None:
        text = str(op)  # ReduceOp instances print like "ReduceOp.SUM" or "<...PREMUL_SUM...>"
        name = text.rsplit(".", 1)[-1].strip("<>")
    return str(name).upper()


class Tracer:
    """The installed tracer of this process (one at a time; see install / uninstall)."""

    def __init__(self, report_dir: str | os.PathLike, rank: int) -> None:
        import torch

        self._torch = torch
        self.rank = rank
        self.path = trace_path(report_dir, rank)
        self.writer = _Writer(self.path)
        self.sites = SiteFinder()
        self._ids = itertools.count(1)
        self._seq: dict[Any, int] = {}
        self._lines: dict[tuple, tuple[str, Any]] = {}
        self._groups: dict[Any, tuple[str, str | None, tuple[int, ...]]] = {}
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self.writer.write({"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "t": time.time(),
                           "argv": list(sys.argv), "torch": torch.__version__})

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
        for pname, value in params.items():
            if pname in _SKIP_SHAPES:
                continue
            if isinstance(value, Tensor):
                shapes.append(list(value.shape))
                dtypes.append(_dtype_name(value))
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
                for t in value:
                    if isinstance(t, Tensor):
                        shapes.append(list(t.shape))
                        dtypes.append(_dtype_name(t))
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
        event: dict[str, Any] = {"ev": "start", "op": op, "pg": pg, "pg_name": pg_name, "shapes": shapes,
                                 "dtypes": dtypes, "reduce_op": reduce_op}
        if op in P2P_OPS:
            event["peer"] = root
            event["root"] = None
        else:
            event["peer"] = None
            event["root"] = root
        if params.get("output_split_sizes") is not None or params.get("input_split_sizes") is not None:
            event["uneven"] = True
        if p2p is not None:
            event["p2p"] = p2p
        if funcol:
            event["api"] = "functional"
        if op in ("broadcast_object_list", "scatter_object_list"):
            objs = params.get("object_list", params.get("scatter_object_output_list"))
            event["objects"] = len(objs) if isinstance(objs, list) else None
        return event

    def _seq_key(self, event: dict[str, Any]) -> Any:
        """Collectives count per process group; point-to-point ops per (sender, receiver)."""
        op = event["op"]
        if op in P2P_OPS:
            me = self.rank
            peer = event["peer"]
            sending = op.startswith(("send", "isend"))
            return ("p2p", event["pg"], me if sending else peer, peer if sending else me)
        if op == "batch_isend_irecv":
            return ("p2p-batch", event["pg"])  # paired per send/receive, not a group position
        return event["pg_name"] or event["pg"]

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
        local = self._local
        writer = self.writer
        ids = self._ids
        sites = self.sites
        Work = None
        try:
            from torch.distributed.distributed_c10d import Work
        except ImportError:  # pragma: no cover - every supported torch has Work
            pass

        cache = self._lines
        Tensor = self._torch.Tensor
        cacheable = op not in _UNCACHED
        write_fd = writer.write_raw

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "busy", False):
                return fn(*args, **kwargs)
            local.busy = True
            try:
                try:
                    site = sites.find(2)
                    # The hot path: the static part of the start line (op, group, shapes, dtypes, reduce op,
                    # root, site) is cached as JSON text per call signature; only id, seq and time are formatted.
                    hit = None
                    if cacheable:
                        params = dict(zip(names, args))
                        if kwargs:
                            params.update(kwargs)
                        key: list[Any] = [id(site)]
                        for pname, value in params.items():
                            if isinstance(value, Tensor):
                                key.append((pname, tuple(value.shape), value.dtype))
                            elif isinstance(value, list):
                                key.append((pname, tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor)
                                                         else None for t in value)))
                            elif pname != "async_op" and not isinstance(value, (bool, Tensor)):
                                key.append((pname, id(value) if pname == "group" else value))
                        try:
                            hkey = tuple(key)
                            hit = cache.get(hkey)
                        except TypeError:  # an unhashable argument: describe it in full every time
                            hkey = None
                    if hit is None:
                        event = self._describe(op, names, args, kwargs, funcol, default_op)
                        event["site"] = site.site
                        event["file"] = site.file
                        event["line"] = site.line
                        seq_key = self._seq_key(event)
                        prefix = json.dumps(event, separators=(",", ":"), default=str)[:-1] + ","
                        hit = (prefix, seq_key)
                        if cacheable and hkey is not None:
                            if len(cache) >= _CACHE_LIMIT:
                                cache.clear()
                            cache[hkey] = hit
                    prefix, seq_key = hit
                    seq = self._seq[seq_key] = self._seq.get(seq_key, 0) + 1
                    eid = next(ids)
                    write_fd(f'{prefix}"id":{eid},"seq":{seq},"t":{time.time():.6f}}}\n')
                except Exception as exc:  # tracing must never break the user's collective
                    log.debug("trace of %s failed: %s", op, exc)
                    return fn(*args, **kwargs)
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    writer.write({"ev": "end", "id": eid, "t": time.time(), "error": f"{type(exc).__name__}: {exc}"})
                    raise
            finally:
                local.busy = False
            if result is None and not funcol:
                write_fd(f'{{"ev":"end","id":{eid},"t":{time.time():.6f}}}\n')
            else:
                self._finish(eid, result, Work, funcol)
            return result

        traced.__distcheck_original__ = fn  # type: ignore[attr-defined]
        return traced

    def _finish(self, eid: int, result: Any, Work: Any, funcol: bool) -> None:
        writer = self.writer
        works = None
        if Work is not None:
            if isinstance(result, Work):
                works = [result]
            elif isinstance(result, list) and result and all(isinstance(w, Work) for w in result):
                works = result
        if not works:
            record: dict[str, Any] = {"ev": "end", "id": eid, "t": time.time()}
            if funcol:
                record["issued"] = True
            writer.write(record)
            return
        try:
            futures = [w.get_future() for w in works]
            fut = futures[0] if len(futures) == 1 else self._torch.futures.collect_all(futures)
        except Exception:  # a backend without futures: the op is at least issued
            writer.write({"ev": "end", "id": eid, "t": time.time(), "issued": True})
            return

        batch = len(futures) > 1

        def done(f: Any) -> None:
            record: dict[str, Any] = {"ev": "end", "id": eid, "t": time.time()}
            try:
                value = f.value()
                if batch:  # collect_all: a list of the batch's futures, each may have failed
                    for sub in value:
                        sub.value()
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
            writer.write(record)

        fut.add_done_callback(done)

    # -- installation ---------------------------------------------------------------------------------------
    def patch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        wrapped: dict[int, Callable] = {}
        for op in C10D_OPS:
            fn = getattr(c10d, op, None)
            if fn is None:
                continue
            traced = wrapped.setdefault(id(fn), self.wrap(fn, op, funcol=False))
            for module in (c10d, dist):
                if getattr(module, op, None) is fn:
                    self._patched.append((module, op, fn))
                    setattr(module, op, traced)
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

    def unpatch(self) -> None:
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched.clear()

    def note(self, record: dict[str, Any]) -> None:
        """Write a non-collective line (``{"ev": "error", ...}``) into this rank's trace."""
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
    return _tracer


def uninstall() -> None:
    """Restore the original torch.distributed functions and close the trace file."""
    global _tracer
    if _tracer is None:
        return
    _tracer.unpatch()
    _tracer.writer.close()
    _tracer = None


def current() -> Tracer | None:
    return _tracer


def install_from_env() -> Tracer | None:
    """Install when DISTCHECK_TRACE=1 and DISTCHECK_REPORT_DIR are set (the rank comes from RANK)."""
    if os.environ.get(ENV_TRACE, "") not in ("1", "true", "yes") or not os.environ.get(ENV_REPORT_DIR):
        return None
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    return install(os.environ[ENV_REPORT_DIR], rank)
