"""torch's distributed error messages, translated into what a person can act on. Pure: text in, text out.

    python -m distcheck run --nproc 2 -- train.py    # a rank that raises one of these gets the translated message

A rank that raises records the exception in its trace (rank/entry.py), together with what only the rank knows:
the names of the parameters of the DDP modules it trained, in DDP's own order. :func:`translate` turns torch's
text into a message that names parameters and lines instead of indices; torch's text stays in the finding's
``detail.error``. Only the errors below are translated so far (the rest keep torch's first line).

* DDP unused parameters ("Expected to have finished reduction in the prior iteration ... Parameter indices which
  did not receive grad for rank 0: 4 5", or the names under TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL).
* DDP "Expected to mark a variable ready only once ... Parameter at index 1 with name block.bias has been marked
  as ready twice" (a module run by more than one reentrant checkpoint, or a parameter used outside forward).
* DTensor "aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"; from
  ``aten.stack`` or ``aten._foreach_*`` (clip_grad_norm_, foreach optimizers) it means FSDP2 left some parameters
  unsharded (no fully_shard on the root).
* Mixed meshes: "All operands in aten.stack.default must have the same mesh, but got DeviceMesh(...) and ..." and
  "DTensor does not support cross-mesh operation on ...": fully_shard/parallelize_module given different meshes.
* DTensor redistribute and placements: "Cross device mesh comm not supported yet!", "`placements` must have the
  same length as `device_mesh.ndim`", "Can not redistribute from S(0) to P(sum)", "Sharding propagation failed".
* FSDP2 "FSDP parameters should be materialized from meta device before training" (no ``to_empty()``).
* gloo "Connection closed by peer" / "Connection reset by peer" and "Timed out waiting 3000ms for recv operation
  to complete", pointed at the traced collective the rank failed in.
* NCCL watchdog timeouts ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...)
  ran for 600013 milliseconds"), pointed at the traced collective with that sequence number when the op agrees.
  NCCL numbers every op it runs on a group, including those torch issues from C++ (DDP's gradient all-reduces)
  that the tracer does not see, so a disagreeing op is said to be a guess, not named.
* "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000": two ranks on one GPU.
* A DataLoader worker's exception, which torch re-raises in the main process at ``for x in loader`` with the
  worker's traceback in its text ("Caught IndexError in DataLoader worker process 0. Original Traceback ..."):
  :func:`worker_error` reads the worker's own line from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from distcheck.analysis.frame_owner import USER, owner
from distcheck.analysis.progress import CollectiveRef, rank_progress
from distcheck.contract.findings import format_names
from distcheck.contract.site import file_line

_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+:\s*([\d ]+)")
_DDP_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+:\s*([^\n]+)")
_SHOWN = 4  # parameter names a message lists before "(+N more)"


def _ddp_unused(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    if _DDP_UNUSED not in message:
        return None
    names: list[str] = []
    match = _DDP_NAMES.search(message)
    if match:
        names = [n.strip() for n in match.group(1).split(",") if n.strip()]
    else:
        match = _DDP_INDICES.search(message)
        order = context.get("ddp_params") or []
        if match and order:
            names = [order[int(i)] for i in match.group(1).split() if int(i) < len(order)]
    sites: dict[str, str] = context.get("param_sites") or {}
    where = []
    for name in names:
        site = sites.get(name)
        if site and site not in where:
            where.append(site)
    if names:
        shown = format_names(names, _SHOWN)
        what = (f"DDP: {len(names)} parameter{'s' if len(names) != 1 else ''} got no gradient, so DDP's gradient "
                f"reduction never finished and the next forward failed: {shown}"
                + (f" (created at {', '.join(where[:_SHOWN])})" if where else ""))
    else:
        what = ("DDP: some parameters got no gradient, so DDP's gradient reduction never finished and the next "
                "forward failed (torch did not say which)")
    fixes = ("use them in the loss, or take them out of the model or set requires_grad_(False) on them; or pass "
             "find_unused_parameters=True to DistributedDataParallel (an extra graph traversal every step)")
    detail: dict[str, Any] = {"translated": "ddp_unused_parameters", "unused_params": names, "params": names,
                              "fixes": fixes}
    return {"message": f"{what}. Fix: {fixes}", "detail": detail}


_READY_TWICE = re.compile(r"Parameter at index (\d+)(?: with name ([\w.]+))? has been marked as ready twice")


def _ddp_ready_twice(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    if "Expected to mark a variable ready only once" not in message:
        return None
    match = _READY_TWICE.search(message)
    name = None
    if match:
        name = match.group(2)
        order = context.get("ddp_params") or []
        if name is None and int(match.group(1)) < len(order):
            name = order[int(match.group(1))]
    site = (context.get("param_sites") or {}).get(name) if name else None
    who = f"parameter '{name}'" + (f" (created at {site})" if site else "") if name else "a parameter"
    fixes = ("checkpoint(..., use_reentrant=False), or run each module under one checkpoint only; if the graph "
             "never changes, model._set_static_graph()")
    return {"message": (f"DDP: {who} got its gradient twice in one backward: its module runs under more than one "
                        f"reentrant checkpoint (use_reentrant=True), or the parameter is used outside forward. "
                        f"Fix: {fixes}"),
            "detail": {"translated": "ddp_ready_twice", "params": [name] if name else [], "fixes": fixes}}


_MIXED = re.compile(r"(aten\.[\w.]+):? got mixed torch\.Tensor and DTensor")
# Ops that take a whole parameter list: clip_grad_norm_ stacks the per-parameter norms, foreach optimizers update
# all parameters of a dtype in one call.
_PARAM_LIST_OPS = re.compile(r"aten\.(stack|_foreach_\w+|linalg_vector_norm)\b")


def _dtensor_mixed(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _MIXED.search(message)
    if not match:
        return None
    op = match.group(1)
    if _PARAM_LIST_OPS.match(op):
        fixes = ("fully_shard(model) on the root module too, after its blocks (or parallelize every module that "
                 "holds parameters), so every parameter is a DTensor")
        return {"message": (f"{op} got both DTensors and plain tensors: the model's parameters are of two kinds, "
                            f"some sharded (fully_shard or tensor parallelism) and some plain (a module no "
                            f"fully_shard covers, often the root's own embedding or head), and clip_grad_norm_ or "
                            f"a foreach optimizer cannot mix them. Fix: {fixes}"),
                "detail": {"translated": "fsdp_unsharded_params", "aten_op": op, "params": [], "fixes": fixes}}
    fixes = ("make the plain tensor a DTensor on the same mesh (DTensor.from_local(t, mesh, [Replicate()]) or "
             "distribute_tensor), or leave DTensor land first (dtensor.full_tensor() or .to_local())")
    return {"message": (f"{op} was given a DTensor and a plain torch.Tensor: under tensor parallelism every operand "
                        f"of an op on a DTensor must be a DTensor too. Fix: {fixes}"),
            "detail": {"translated": "dtensor_mixed_tensor", "aten_op": op, "params": [], "fixes": fixes}}


_MESH_SHAPE = re.compile(r"DeviceMesh\((\([^)]*\)|\[[^\]]*\])")
_CROSS_MESH = re.compile(r"(?:All operands in (aten\.[\w.]+) must have the same mesh"
                         r"|DTensor does not support cross-mesh operation on (aten\.[\w.]+))")


def _cross_mesh(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _CROSS_MESH.search(message)
    if not match:
        return None
    op = match.group(1) or match.group(2)
    meshes = [m.group(1) for m in _MESH_SHAPE.finditer(message)][:2]
    which = f", {meshes[0]} and {meshes[1]}" if len(meshes) == 2 else ""
    fixes = ("give every fully_shard call the same mesh (one 2-D mesh for HSDP), and slice TP and FSDP meshes "
             "from one init_device_mesh (mesh['dp'], mesh['tp']) instead of creating several")
    using = " (clip_grad_norm_ or a foreach optimizer over all parameters)" if _PARAM_LIST_OPS.match(op) else ""
    return {"message": (f"{op}{using} got DTensors on two different device meshes{which}: parameters or tensors "
                        f"were distributed with different meshes (fully_shard or parallelize_module calls given "
                        f"different meshes), and one op cannot mix them. Fix: {fixes}"),
            "detail": {"translated": "mixed_meshes", "aten_op": op, "meshes": meshes, "params": [], "fixes": fixes}}


def _redistribute_mesh(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    if "Cross device mesh comm not supported" not in message:
        return None
    fixes = ("redistribute on the DTensor's own mesh (dt.redistribute(dt.device_mesh, placements)); to move it to "
             "another mesh, go through the local shard: DTensor.from_local(dt.to_local(), other_mesh, placements)")
    return {"message": (f"redistribute() was asked to move a DTensor to another device mesh; it only changes "
                        f"placements on the DTensor's own mesh. Fix: {fixes}"),
            "detail": {"translated": "redistribute_other_mesh", "params": [], "fixes": fixes}}


_PLACEMENTS_LEN = re.compile(r"`placements` must have the same length as `device_mesh.ndim`! Found placements "
                             r"length: (\d+), and device_mesh.ndim: (\d+)")
_TO_PARTIAL = re.compile(r"Can not redistribute from (\S+) to (P\(\w+\)), redistributing to Partial is for internal")
_SHARDING_PROP = re.compile(r"Sharding propagation failed (?:for|on op) (aten\.[\w.]+)\(")
_SPEC = re.compile(r"Spec\(\w+\[[^\]]*\]\(((?:_?[SP]\(\w+\)|R|,\s*)+)\)\)")  # Spec(f32[4, 4](S(0)))


def _dtensor_placements(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _PLACEMENTS_LEN.search(message)
    if match:
        given, ndim = int(match.group(1)), int(match.group(2))
        fixes = "one placement per mesh dim, e.g. [Shard(0)] on a 1-D mesh, [Replicate(), Shard(0)] on a 2-D mesh"
        return {"message": (f"{given} placement{'s' if given != 1 else ''} given for a {ndim}-D device mesh: "
                            f"DTensor needs exactly one per mesh dim. Fix: {fixes}"),
                "detail": {"translated": "dtensor_placements", "params": [], "fixes": fixes}}
    match = _TO_PARTIAL.search(message)
    if match:
        fixes = "Replicate() for the reduced value on every rank, or Shard(d) for its slices"
        return {"message": (f"redistribute() from {match.group(1)} to {match.group(2)} is not allowed: Partial "
                            f"(a pending reduction) only comes out of ops, never from redistribute. Fix: {fixes}"),
                "detail": {"translated": "dtensor_placements", "params": [], "fixes": fixes}}
    match = _SHARDING_PROP.search(message)
    if match:
        op = match.group(1)
        placements = [p for p in _SPEC.findall(message)]
        first = message.strip().splitlines()[0]
        fixes = ("redistribute the input before this op (often to Replicate()), or run it on the local shard "
                 "(.to_local()) or the whole tensor (.full_tensor())")
        on = f" with placements {', '.join(placements)}" if placements else ""
        return {"message": f"{op} cannot run on its DTensor input{on}: {first}. Fix: {fixes}",
                "detail": {"translated": "dtensor_sharding", "aten_op": op, "placements": placements, "params": [],
                           "fixes": fixes}}
    return None


_FSDP_META = re.compile(r"FSDP parameters should be materialized from meta device before training, but the "
                        r"following were still on meta device: \[([^\]]*)\]")


def _fsdp_meta(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _FSDP_META.search(message)
    if not match:
        return None
    names = [n.strip().strip("'\"") for n in match.group(1).split(",") if n.strip()]
    shown = format_names(names, _SHOWN)
    fixes = ("model.to_empty(device=...) after fully_shard, then initialize the parameters (reset_parameters() "
             "or your init_weights()) before the first forward")
    return {"message": (f"FSDP2: {len(names)} parameter{'s' if len(names) != 1 else ''} still on the meta device "
                        f"at the first forward, never given real storage: {shown}. Fix: {fixes}"),
            "detail": {"translated": "fsdp_meta_params", "params": names, "fixes": fixes}}


_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
                       r"(?:, NumelIn=(\d+), NumelOut=(\d+))?, Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
_PG_NAME = re.compile(r"PG GUID \d+\(([^)]+)\)")
# NCCL's OpType -> the torch.distributed ops that issue it.
_OPTYPE_OPS = {
    "ALLREDUCE": ("all_reduce", "all_reduce_coalesced"), "BROADCAST": ("broadcast", "broadcast_object_list"),
    "ALLGATHER": ("all_gather", "all_gather_object", "all_gather_coalesced"),
    "_ALLGATHER_BASE": ("all_gather_into_tensor", "all_gather_single", "all_gather_tensor"),
    "REDUCE_SCATTER": ("reduce_scatter",),
    "_REDUCE_SCATTER_BASE": ("reduce_scatter_tensor", "reduce_scatter_single"),
    "ALLTOALL": ("all_to_all",), "ALLTOALL_BASE": ("all_to_all_single",), "BARRIER": ("barrier",),
    "REDUCE": ("reduce",), "GATHER": ("gather", "gather_object"), "SCATTER": ("scatter", "scatter_object_list"),
    "SEND": ("send", "isend"), "RECV": ("recv", "irecv"),
}


def _nccl_watchdog(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _WATCHDOG.search(message)
    if not match:
        return None
    seq, optype = int(match.group(1)), match.group(2)
    timeout_s, ran_s = int(match.group(5)) / 1000, int(match.group(6)) / 1000
    pg = _PG_NAME.search(message)
    pg_name = pg.group(1) if pg else None
    detail: dict[str, Any] = {"translated": "nccl_watchdog_timeout", "nccl_seq": seq, "nccl_op": optype,
                              "timeout_s": timeout_s, "ran_s": ran_s, "pg_name": pg_name}
    what = (f"NCCL's watchdog timed out collective #{seq} ({optype}"
            + (f" on group {pg_name}" if pg_name else "") + f") after {ran_s:g}s (timeout {timeout_s:g}s)")
    # The traced collective at that position: same per-group number and, to trust it, an op NCCL names the same.
    # torch names the default group "0" in the trace and "default_pg" in NCCL's messages; another group's name is
    # not comparable, so its collectives are all candidates and only a single agreeing one is named.
    candidates = [e for e in context.get("events") or () if getattr(e, "seq", None) == seq
                  and getattr(e, "extra", {}).get("api") != "functional"
                  and (pg_name != "default_pg" or getattr(e, "pg_name", None) in (None, "0"))]
    agreeing = [e for e in candidates if getattr(e, "op", "") in _OPTYPE_OPS.get(optype.upper(), ())]
    if len(agreeing) == 1:
        e = agreeing[0]
        what += f": the traced {e.op} #{e.seq}" + (f" at {e.site}" if e.site else "")
        detail.update(op=e.op, seq=e.seq, site=e.site)
        if e.file and e.line:
            detail.update(file=e.file, line=e.line)
        what += ", where the other ranks of that group never arrived or are still behind"
    elif candidates:
        e = candidates[0]
        what += (f"; the traced collective #{seq} is {e.op}" + (f" at {e.site}" if e.site else "") + ", another op: "
                 "NCCL also counts collectives torch issues from C++ (DDP's gradient all-reduces), so the numbers "
                 "differ and that line is only a guess")
    what += ". See the hang finding or stacks.txt for where each rank was"
    return {"message": what, "detail": detail}


_DUPLICATE_GPU = re.compile(r"Duplicate GPU detected\s*:\s*rank (\d+) and rank (\d+) both on CUDA device (\w+)")


def _duplicate_gpu(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _DUPLICATE_GPU.search(message)
    if not match:
        return None
    a, b, device = sorted((int(match.group(1)), int(match.group(2)))) + [match.group(3)]
    fix = ("select each rank's own GPU before its first NCCL op: torch.cuda.set_device(int(os.environ["
           "'LOCAL_RANK'])), or init_process_group(..., device_id=torch.device('cuda', local_rank))")
    return {"message": f"ranks {a} and {b} both use the GPU with bus id {device}. Fix: {fix}",
            "detail": {"translated": "duplicate_gpu", "gpu_ranks": [a, b], "bus_id": device, "fixes": fix}}


_GLOO_PEER = re.compile(r"Connection (?:closed|reset) by peer|Application timeout caused pair closure")
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation to complete")


def _failed_event(context: dict[str, Any]) -> CollectiveRef | None:
    """The traced collective the error came out of: the rank's last failed one (analysis/progress.py), from the
    ``progress`` the caller computed or from its ``events``."""
    progress = context.get("progress")
    if progress is None:
        events = list(context.get("events") or ())
        if not events:
            return None
        progress = rank_progress(events[0].rank, events)
    return progress.last_failed


def _in_event(ref: CollectiveRef | None, detail: dict[str, Any]) -> str:
    if ref is None:
        return ""
    detail.update(op=ref.op, seq=ref.seq, site=ref.site or None)
    if ref.file and ref.line:
        detail.update(file=ref.file, line=ref.line)
    return f" in {ref.op} #{ref.seq}" + (f" at {ref.site}" if ref.site else "")


def _gloo_peer(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    if not _GLOO_PEER.search(message):
        return None
    detail: dict[str, Any] = {"translated": "gloo_peer_closed", "params": []}
    where = _in_event(_failed_event(context), detail)
    return {"message": (f"gloo lost its connection to another rank{where}: the rank at the other end ended "
                        f"(crashed, exited or was killed) or destroyed its process group while this one still "
                        f"needed it; that rank's own finding, or its stderr, says why"),
            "detail": detail}


def _gloo_timeout(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    match = _GLOO_TIMEOUT.search(message)
    if not match:
        return None
    seconds = int(match.group(1)) / 1000
    detail: dict[str, Any] = {"translated": "gloo_timeout", "timeout_s": seconds, "params": []}
    where = _in_event(_failed_event(context), detail)
    fixes = ("if a rank takes that long on purpose (a checkpoint saved by rank 0 alone), raise "
             "init_process_group(timeout=...) or let the others wait outside collectives; otherwise see where the "
             "other ranks were")
    detail["fixes"] = fixes
    return {"message": (f"gloo's timeout ({seconds:g}s, from init_process_group) expired{where}: the other ranks of "
                        f"the group did not reach this collective in time. Fix: {fixes}"),
            "detail": detail}


# torch's C++ errors start with their source location ("[/__w/pytorch/.../pair.cc:553] "): noise to a user.
_CPP_LOCATION = re.compile(r"^((?:\w+Error: )?)\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


# torch re-raises a DataLoader worker's exception in the main process (torch/_utils.py ExceptionWrapper) with the
# worker's traceback in the message: "Caught IndexError in DataLoader worker process 0.\nOriginal Traceback (most
# recent call last):\n  File ...". The main process's own traceback only reaches ``for x in loader``.
_WORKER = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.\s*\nOriginal Traceback \(most recent call "
                     r"last\):\n", re.S)
_TB_FRAME = re.compile(r'^  File "([^"]+)", line (\d+), in (\S+)', re.M)


@dataclass
class WorkerError:
    """A DataLoader worker's exception as the main process re-raised it: which worker, what it raised, and the
    innermost frame of the user's code in its traceback (None when it shows none: a library dataset's own code)."""

    worker: int
    exc_type: str
    text: str  # its last line without the type: "list index out of range"
    file: str | None
    line: int | None
    func: str | None

    @property
    def site(self) -> str | None:
        return file_line(self.file, self.line)


def worker_error(message: str) -> WorkerError | None:
    """The worker's exception inside a re-raised DataLoader error's ``message``, else None."""
    m = _WORKER.match(message or "")
    if m is None:
        return None
    body = message[m.end():]
    last = (body.strip().splitlines() or [""])[-1]
    text = last.split(": ", 1)[1] if last.startswith(f"{m.group(1)}:") and ": " in last else last
    user = [f for f in _TB_FRAME.findall(body) if owner(f[0]) == USER]
    file, line, func = (user[-1][0], int(user[-1][1]), user[-1][2]) if user else (None, None, None)
    return WorkerError(int(m.group(2)), m.group(1), text, file, line, func)


def first_line(text: str, limit: int = 200) -> str:
    """The line of an error's text a message quotes (a traceback's last), without a C++ source location."""
    line = (text.strip().splitlines() or [""])[-1] if "Traceback" in text else (text.strip().splitlines() or [""])[0]
    line = _CPP_LOCATION.sub(r"\1", line)
    return line if len(line) <= limit else line[:limit] + "..."


def lost_peer(text: str) -> bool:
    """The error only says that another rank went away: a consequence of that rank's own failure."""
    return bool(_GLOO_PEER.search(text))


def brief(text: str) -> str | None:
    """A few words for a backend error met in another rank's position, or None when it is not one we know."""
    if _GLOO_PEER.search(text):
        return "gloo lost its connection to another rank: that rank ended or left the group"
    match = _GLOO_TIMEOUT.search(text)
    if match:
        return f"gloo gave up after {int(match.group(1)) / 1000:g}s waiting for the other ranks"
    match = _WATCHDOG.search(text)
    if match:
        return f"NCCL's watchdog timed out collective #{match.group(1)} ({match.group(2)})"
    return None


_TRANSLATORS = (_ddp_unused, _ddp_ready_twice, _dtensor_mixed, _cross_mesh, _redistribute_mesh, _dtensor_placements,
                _fsdp_meta, _nccl_watchdog, _gloo_peer, _gloo_timeout, _duplicate_gpu)


def translate(exc_type: str, message: str, context: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``{"message": ..., "detail": {...}}`` for an error distcheck knows, else None. ``context``: what the rank
    knew (``ddp_params``: names in DDP's index order; ``param_sites``: name -> "file.py:LINE"), the rank's traced
    collectives (``events``: trace_events.TraceEvent objects) and, when the caller has it, their ``progress``
    (analysis/progress.RankProgress: the collective an error came out of is its ``last_failed``)."""
    context = context or {}
    for translator in _TRANSLATORS:
        try:
            out = translator(message, context)
        except (ValueError, IndexError, TypeError):  # an unexpected variant of the text: keep torch's own
            out = None
        if out is not None:
            return out
    return None
