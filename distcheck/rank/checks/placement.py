"""Placement dump and FSDP2/TP coverage of a live model, plus cross-rank consistency (``distcheck.check_model``).

    import distcheck
    fully_shard(block) for each block; fully_shard(model)
    findings = distcheck.check_model(model)       # on every rank, under torchrun or distcheck run

For every parameter and buffer: Tensor or DTensor, mesh, placements, global and local shape, bytes per rank, and
which fully_shard module (or TP style, or DDP) manages it. A parameter left out of the sharding is the silent bug:
nothing fails, its gradient is never reduced, and it drifts apart on every rank. Those are ``uncovered_param``.
Under torch.distributed, every rank must call check_model: it also checks each DeviceMesh the model uses and
compares the replicated values across ranks (through the side channel, not the user's process group).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Iterable

import torch
import torch.nn as nn

from distcheck.analysis.placement import (FSDP_IGNORED, PlacementRow, coverage_findings, merge_rank_findings,
                                          mixed_mesh_notes, render_placement_table)
from distcheck.analysis.replicas import group_findings
from distcheck.contract.findings import Finding
from distcheck.rank.usersite import param_site

log = logging.getLogger("distcheck")

_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__))
_TENSOR_API = os.path.join(_TORCH_DIR, "distributed", "tensor", "_api.py")

__all__ = ["PlacementRow", "describe_model", "render_placement_table", "placement_json", "fsdp_modules",
           "check_model", "model_meshes"]


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _compact_ranks(ranks: list[int]) -> str:
    """``[0, 2, 4, 6]`` -> ``0..6/2``; contiguous -> ``0..7``; irregular -> the list."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}..{ranks[-1]}" + (f"/{step}" if step != 1 else "")
    return ",".join(map(str, ranks))


def _style_in(obj: Any, depth: int = 0) -> str | None:
    """The ParallelStyle behind a forward hook that distribute_module installed (hooks close over the style)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    if depth > 4 or obj is None:
        return None
    if isinstance(obj, ParallelStyle):
        return type(obj).__name__
    if isinstance(obj, functools.partial):
        return _style_in(obj.func, depth + 1) or next(
            (s for s in (_style_in(a, depth + 1) for a in obj.args) if s), None)
    if inspect.ismethod(obj):
        return _style_in(obj.__self__, depth + 1)
    if inspect.isfunction(obj) and "." in obj.__qualname__:
        # The built-in styles hand distribute_module staticmethods (ColwiseParallel._prepare_input_fn): the
        # instance is gone, but the qualname names the class.
        owner = obj.__globals__.get(obj.__qualname__.split(".", 1)[0])
        if isinstance(owner, type) and issubclass(owner, ParallelStyle):
            return owner.__name__
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            found = _style_in(cell.cell_contents, depth + 1)
        except ValueError:  # empty cell
            continue
        if found:
            return found
    return None


def tp_style(module: nn.Module) -> str | None:
    """Name of the tensor-parallel style applied to ``module`` (from its hooks), or None."""
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    for hook in hooks:
        style = _style_in(hook)
        if style:
            return style
    for hook in hooks:  # a hand-written distribute_module() call without a ParallelStyle object
        code = getattr(hook, "__code__", None)
        if code is not None and os.path.realpath(code.co_filename) == _TENSOR_API:
            return "distribute_module"
    return None


def fsdp_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) of every module carrying fully_shard state; the root is named "<root>"."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _fsdp_managed(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> fqn of the fully_shard module whose param group manages it."""
    managed: dict[int, str] = {}
    for fqn, module in fsdp_modules(model):
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", []) or []:
            for fp in group.fsdp_params:
                info = fp._module_info
                for mod, pname in [(info.module, info.param_name),
                                   *zip(info.shared_modules, info.shared_param_names)]:
                    p = mod._parameters.get(pname)
                    if p is not None:
                        managed[id(p)] = fqn
                managed[id(fp.sharded_param)] = fqn
    return managed


def _fsdp1_row(model: nn.Module, op: Any) -> PlacementRow:
    """An FSDP1 original parameter (rank/checks/fsdp1.OrigParam) as a placement row."""
    from distcheck.rank.checks.fsdp1 import clean_name, data_parallel_ranks

    unit = op.unit
    info = unit.handle.flat_param._param_infos[op.index]
    if op.replicate_ranks:
        mesh_shape, names = [len(op.replicate_ranks), len(op.shard_ranks)], ["replicate", "shard"]
        ranks = data_parallel_ranks(unit.module) or sorted(set(op.shard_ranks) | set(op.replicate_ranks))
    else:  # NO_SHARD's group holds whole copies: a replicate dim
        names = ["shard"] if unit.handle.uses_sharded_strategy else ["replicate"]
        mesh_shape, ranks = [len(op.shard_ranks)], op.shard_ranks
    site = param_site(model, op.path)
    return PlacementRow(
        name=op.name, role="parameter", cls="Tensor", dtype=str(op.dtype), mesh_shape=mesh_shape,
        mesh_dim_names=names, mesh_ranks=_compact_ranks(ranks), placements=None, global_shape=op.shape,
        local_shape=[op.here], bytes_per_rank=op.here * op.dtype.itemsize, requires_grad=op.requires_grad,
        module=clean_name(unit.prefix + info.module_name), module_type=type(info.module).__name__, fsdp=unit.label,
        fsdp1=unit.strategy, flat_shard=op.held, file=site.file, line=site.line)


def describe_model(model: nn.Module) -> list[PlacementRow]:
    """One row per parameter and buffer (deduplicated like named_parameters), in module order; an FSDP1 unit's
    flat parameter (or its views) as one row per original parameter."""
    from torch.nn.parallel import DistributedDataParallel

    from distcheck.rank.checks import fsdp1

    ddp_ignored: set[str] = set()
    is_ddp = isinstance(model, DistributedDataParallel)
    if is_ddp:
        ddp_ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    managed = _fsdp_managed(model)
    owners: dict[int, tuple[str, nn.Module, str]] = {}
    styles: dict[str, str | None] = {}
    modules = dict(model.named_modules())
    for mname, mod in modules.items():
        styles[mname] = tp_style(mod)
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), (mname, mod, pname))
        for bname, b in mod._buffers.items():
            if b is not None:
                owners.setdefault(id(b), (mname, mod, bname))
    rows: list[PlacementRow] = []
    units = fsdp1.units(model)
    index = fsdp1.FlatIndex([model]) if units else None
    originals = {(id(u.module), op.index): op for u in units for op in fsdp1.original_params(u)}
    fsdp1_ignored = fsdp1.ignored_params(model) if units else {}
    named = [(n, "parameter", p) for n, p in model.named_parameters()]
    named += [(n, "buffer", b) for n, b in model.named_buffers() if b is not None]
    for name, role, t in named:
        hit = index.find(t) if index and role == "parameter" else None
        if hit is not None:  # FSDP1: a flat parameter stands for all of its unit's parameters, a view for one
            unit, i = hit
            count = len(unit.handle.flat_param._fqns)
            rows += [_fsdp1_row(model, originals[(id(unit.module), j)])
                     for j in ([i] if i is not None else range(count))]
            continue
        mname, mod, attr = owners.get(id(t), ("", model, name.rsplit(".", 1)[-1]))
        if _is_dtensor(t):
            mesh = t.device_mesh
            local = t.to_local()
            mesh_shape = list(mesh.mesh.shape)
            mesh_names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
            mesh_ranks = _compact_ranks([int(x) for x in mesh.mesh.flatten().tolist()])
            placements = [repr(p) for p in t.placements]
            cls = "DTensor"
        else:
            local = t
            mesh_shape = mesh_names = mesh_ranks = placements = None
            cls = "Tensor" if type(t) in (torch.Tensor, nn.Parameter) else type(t).__name__
        site = param_site(model, f"{mname}.{attr}" if mname else attr)
        file, line = site.file, site.line
        inner = mname.split(".", 1)[1] if is_ddp and mname.startswith("module") and "." in mname else ""
        rows.append(PlacementRow(
            name=fsdp1.clean_name(name) if units else name, role=role, cls=cls, dtype=str(t.dtype),
            mesh_shape=mesh_shape, mesh_dim_names=mesh_names,
            mesh_ranks=mesh_ranks, placements=placements, global_shape=list(t.shape),
            local_shape=list(local.shape), bytes_per_rank=local.numel() * local.element_size(),
            requires_grad=bool(getattr(t, "requires_grad", False)),
            module=fsdp1.clean_name(mname) if units else mname, module_type=type(mod).__name__,
            fsdp=managed.get(id(t)) if role == "parameter" else None, tp_style=styles.get(mname),
            ddp=is_ddp and role == "parameter" and name.removeprefix("module.") not in ddp_ignored
            and inner not in ddp_ignored,
            fsdp_ignored=bool(getattr(t, FSDP_IGNORED, False)) or id(t) in fsdp1_ignored, file=file, line=line))
    return rows


def placement_json(rows: Iterable[PlacementRow]) -> list[dict[str, Any]]:
    """The JSON form for report.json's "placements"."""
    return [r.to_json() for r in rows]


def model_meshes(model: nn.Module) -> list[Any]:
    """The root DeviceMeshes of the model's DTensors and fully_shard states, in first-use order."""
    seen: dict[tuple, Any] = {}

    def add(mesh: Any) -> None:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        key = (tuple(root.mesh.shape), tuple(root.mesh_dim_names or ()), tuple(root.mesh.flatten().tolist()))
        seen.setdefault(key, root)

    for t in list(model.parameters()) + list(model.buffers()):
        if _is_dtensor(t):
            add(t.device_mesh)
    for _, module in fsdp_modules(model):
        for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", []) or []:
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if mesh is not None:
                add(mesh)
    return list(seen.values())


def check_model(model: nn.Module, *, skip: Iterable[str] = (), where: str = "(check_model)", cause: str = "",
                warnings: list[dict[str, Any]] | None = None) -> list[Finding]:
    """Placement/coverage findings, mesh checks and replica consistency; the same list on every rank.

    Replicas that differ are one finding (their names, count and largest difference); ``skip``: names another check
    already reported, ``where``/``cause``: when they were compared and what made them differ, when known.
    ``warnings`` receives report.json "warnings" entries (parameters on mixed meshes in a correct model)."""
    import torch.distributed as dist

    from distcheck.rank import sink
    from distcheck.rank.checks import fsdp1
    from distcheck.rank.checks.mesh import check_live_mesh
    from distcheck.rank.checks.replicas import compare_replicas, named_tensors, replica_key
    from distcheck.rank.runtime import current_channel

    rows = describe_model(model)
    channel = current_channel()
    rank = dist.get_rank() if dist.is_initialized() else 0
    units = fsdp1.units(model)
    managers = [fqn for fqn, _ in fsdp_modules(model)] + [u.label for u in units]
    local = coverage_findings(rows, managers, [rank])
    if rank == 0:  # the same on every rank: one warning for all of them
        notes = mixed_mesh_notes(rows, list(range(channel.world_size)) if channel is not None else [rank])
        for note in notes:
            log.warning("distcheck: %s", note.message)
        if warnings is not None:
            warnings += [n.to_json() for n in notes]
    if log.isEnabledFor(logging.INFO):
        log.info("placements:\n%s", render_placement_table(rows))
    if channel is None:
        return local
    ranks = list(range(channel.world_size))
    gathered = channel.exchange("check_model/coverage", [f.to_json() for f in local])
    findings = merge_rank_findings(gathered, ranks)
    # Check only the meshes every rank uses: a rank with a different set would wait forever on the others.
    meshes = {tuple(m.mesh.shape) + tuple(m.mesh_dim_names or ()): m for m in model_meshes(model)}
    per_rank = channel.exchange("check_model/meshes", sorted(meshes, key=str))
    common = set(per_rank[0]).intersection(*per_rank[1:])
    for key in sorted(common, key=str):
        findings += check_live_mesh(meshes[key])
    skip = set(skip)
    from torch.nn.parallel import DistributedDataParallel

    ddp = isinstance(model, DistributedDataParallel)  # names as the user wrote them, without DDP's "module."
    items = [(n.removeprefix("module.") if ddp else n, role, t) for n, role, t in named_tensors("model", model)]
    # FSDP1: each unit's local pieces by their original names, compared only where ranks hold the same chunk
    items, key = fsdp1.replica_items(model, items, replica_key) if units else (items, replica_key)
    items = [(n, role, t) for n, role, t in items if n not in skip]
    findings += group_findings(compare_replicas("check_model", items, channel, ranks, context=where, key=key),
                               where, cause)
    if rank == 0:
        sink.emit(findings, rank)
    return findings
