"""Device-mesh checks: simulated meshes in one process, live meshes across ranks, and torch's mesh errors.

    python -m distcheck mesh --world-size 4096 --shape 64,8,8 --names dp,tp,pp --rank 600

- ``simulate(spec, ranks)``: builds the mesh with torch's own ``init_device_mesh`` on the fake process group, once
  per queried rank, and checks torch's coordinates and groups against distcheck.analysis.mesh (which computes them
  for every rank). torch itself catches a mesh bigger than the world, but not a smaller one: with the fake group,
  ``init_device_mesh((8, 8, 8))`` in a 1024-rank world raises nothing and rank 600 gets no coordinate.
- ``check_live_mesh(mesh)``: every rank publishes its view of a real DeviceMesh over the side channel (not the
  process group, which may be the very thing that is broken) and all ranks check layout, coverage and groups.
- ``mesh_error_finding(exc, tb)``: turns a torch error raised inside init_device_mesh / DeviceMesh into a
  ``mesh_mismatch`` finding with the user's line.
"""
from __future__ import annotations

import logging
import math
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distcheck.analysis.mesh import (EXPERT_ATTRS, HEAD_ATTRS, HIDDEN_ATTRS, LiveMeshView, MeshSpec, ModelCheck,
                                     ModuleAttr, ParamShape, coordinate, group_of, live_mesh_findings,
                                     shard_sizes)
from distcheck.errors import UsageError
from distcheck.contract.findings import Finding
from distcheck.rank.usersite import traceback_site

log = logging.getLogger("distcheck")

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_MESH_FILE = os.path.join(_TORCH_DIR, "distributed", "device_mesh.py")


# ----------------------------------------------------------------------------------------------- simulated mesh


@dataclass
class RankView:
    """torch's answer for one simulated rank: its coordinate and its group on each dim (or torch's error)."""

    rank: int
    coordinate: tuple[int, ...] | None
    groups: list[list[int]] = field(default_factory=list)
    error: str = ""
    agrees: bool = True  # torch's coordinate and groups equal distcheck.analysis.mesh's


def _fake_store() -> dist.Store:
    # torch registers the "fake" backend when this module is imported; it ships with torch (no download).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def simulate_rank(spec: MeshSpec, rank: int) -> RankView:
    """Build the mesh with torch as ``rank`` of a fake ``spec.world_size``-rank world and read back its view."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise UsageError("the mesh simulation needs a process without a process group: run `python -m distcheck "
                         "mesh` on its own, not under torchrun")
    dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=spec.world_size)
    try:
        try:
            mesh = init_device_mesh("cpu", spec.shape, mesh_dim_names=spec.names)
        except RuntimeError as exc:
            return RankView(rank, None, [], error=str(exc).splitlines()[0], agrees=spec.product > spec.world_size)
        coord = mesh.get_coordinate()
        groups: list[list[int]] = []
        if coord is not None:
            for d in range(spec.ndim):
                groups.append(sorted(dist.get_process_group_ranks(mesh.get_group(d))))
        coord = tuple(coord) if coord is not None else None
        want_groups = [group_of(spec.shape, d, rank) for d in range(spec.ndim)] if coord is not None else []
        agrees = coord == coordinate(spec.shape, rank) and groups == want_groups
        return RankView(rank, coord, groups, agrees=agrees)
    finally:
        dist.destroy_process_group()


@dataclass
class ParamShardView:
    name: str
    placements: list[str]
    local_shape: list[int]


def simulate_shards(spec: MeshSpec, rank: int, params: list[ParamShape], check: ModelCheck) -> list[ParamShardView]:
    """Local shapes torch's DTensor would give ``rank`` for each parameter under the placements of ``check``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=spec.world_size)
    try:
        mesh = init_device_mesh("cpu", spec.shape, mesh_dim_names=spec.names)
        out = []
        for p in params:
            shards = check.params.get(p.name, {}).get("shards", {})
            placements = []
            for d in range(spec.ndim):
                s = shards.get(spec.dim_name(d))
                placements.append(Shard(s["tensor_dim"]) if s else Replicate())
            local, _ = compute_local_shape_and_global_offset(p.shape, mesh, placements)
            out.append(ParamShardView(p.name, [repr(pl) for pl in placements], list(local)))
        return out
    finally:
        dist.destroy_process_group()


def model_shapes(model: nn.Module) -> tuple[list[ParamShape], list[ModuleAttr], dict[str, int]]:
    """Parameter shapes, head/hidden/expert counts and repeated-layer containers of a (meta-device) model."""
    params = []
    owner: dict[int, nn.Module] = {}
    for _, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    for name, p in model.named_parameters():
        params.append(ParamShape(name, tuple(p.shape), type(owner.get(id(p), model)).__name__))
    attrs = []
    layers: dict[str, int] = {}
    for mname, mod in model.named_modules():
        where = mname or type(mod).__name__
        for attr in HEAD_ATTRS + HIDDEN_ATTRS + EXPERT_ATTRS:
            value = getattr(mod, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                attrs.append(ModuleAttr(where, attr, value))
        for cname in ("config", "cfg", "args", "model_args"):
            config = getattr(mod, cname, None)
            if config is None or isinstance(config, (nn.Module, torch.Tensor)):
                continue
            for attr in HEAD_ATTRS + HIDDEN_ATTRS + EXPERT_ATTRS:
                value = getattr(config, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    attrs.append(ModuleAttr(f"{where}.{cname}", attr, value))
        head_dim = getattr(mod, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0 and not any(hasattr(mod, a) for a in HEAD_ATTRS):
            # Attention that stores only head_dim: its query projection's width / head_dim is the head count.
            proj = next((c for c in mod.children() if isinstance(c, nn.Linear)), None)
            if proj is not None and proj.out_features % head_dim == 0:
                attrs.append(ModuleAttr(where, "heads", proj.out_features // head_dim))
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 1:
            kinds = {type(c) for c in mod}
            if len(kinds) == 1 and sum(1 for _ in next(iter(mod)).parameters()) > 0:
                layers[mname or type(mod).__name__] = len(mod)
    # Keep only the outermost repeated container (the transformer blocks), not the lists inside a block.
    outer = {k: v for k, v in layers.items() if not any(k != o and k.startswith(o + ".") for o in layers)}
    return params, attrs, outer


def build_meta_model(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model with shapes only: a 70B model costs no memory here."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"the --model factory returned {type(model).__name__}, not an nn.Module: return the "
                         f"unparallelized model")
    return model


# ------------------------------------------------------------------------------------------------ live meshes


def _group_ranks(mesh: Any, d: int) -> list[int] | None:
    try:
        return sorted(dist.get_process_group_ranks(mesh.get_group(d)))
    except Exception:  # a rank outside the mesh has no group on any dim
        return None


def local_view(mesh: Any) -> LiveMeshView:
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    coord = root.get_coordinate()
    # A submesh's .mesh is only this rank's slice; the root's is the whole layout.
    full = root.mesh
    shape = tuple(full.shape)
    mesh_ranks = tuple(int(x) for x in full.reshape(-1).tolist())
    groups = [_group_ranks(root, d) if coord is not None else None for d in range(len(shape))]
    return LiveMeshView(dist.get_rank() if dist.is_initialized() else 0,
                        dist.get_world_size() if dist.is_initialized() else 1,
                        shape, tuple(root.mesh_dim_names) if root.mesh_dim_names else None, mesh_ranks,
                        tuple(coord) if coord is not None else None, groups)


def check_live_mesh(mesh: Any, label: str | None = None) -> list[Finding]:
    """Check a live DeviceMesh on every rank (collective over the world, through the side channel).

    Every rank of the world must call this with its own handle to the same mesh. Submeshes are checked through
    their root mesh. Without torch.distributed only the local view is checked.
    """
    from distcheck.rank.runtime import current_channel

    view = local_view(mesh)
    names = ",".join(view.names) if view.names else "x".join(map(str, view.shape))
    label = label or f"device mesh ({names})"
    channel = current_channel()
    if channel is None:
        return live_mesh_findings({view.rank: view}, label)
    views = channel.exchange(f"mesh/{names}", view)
    return live_mesh_findings({v.rank: v for v in views}, label)


# ---------------------------------------------------------------------------------------- torch's mesh errors

_KNOWN = ("Mesh should not be bigger than", "mesh_shape and mesh_dim_names should have same length",
          "Each mesh_dim_name must be unique", "Device type with index is not supported",
          "DeviceMesh only support homogeneous hardware", "non-overlapping layout", "valid layout",
          "rank map")


def mesh_error_finding(exc: BaseException, tb: TracebackType | None = None) -> Finding | None:
    """A ``mesh_mismatch`` finding for an error torch raised while building a DeviceMesh, else None.

    Recognized by the traceback passing through torch/distributed/device_mesh.py (or a known message); the
    user's line is the last frame outside torch and distcheck before torch's mesh code was entered.
    """
    tb = tb if tb is not None else exc.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    in_mesh = [i for i, f in enumerate(frames) if os.path.realpath(f.filename) == os.path.realpath(_MESH_FILE)]
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not in_mesh and not any(k in message for k in _KNOWN):
        return None
    first = in_mesh[0] if in_mesh else len(frames)
    user = traceback_site(tb, before=first)
    shape = names = None
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    walker = tb
    while walker is not None:  # the arguments of init_device_mesh, when the error came through it
        code = walker.tb_frame.f_code
        if code.co_name == "init_device_mesh" and os.path.realpath(code.co_filename) == os.path.realpath(_MESH_FILE):
            shape = walker.tb_frame.f_locals.get("mesh_shape")
            names = walker.tb_frame.f_locals.get("mesh_dim_names")
        walker = walker.tb_next
    # a library's mesh builder (torchtitan's) made the call: say which, under the user's line that called it
    where = (f" at {user.site}" + (f" via {user.via}" if user.via else "")) if user else ""
    call = f"init_device_mesh({tuple(shape)!r}" + (f", mesh_dim_names={tuple(names)!r}" if names else "") + ")" \
        if shape is not None else "DeviceMesh(...)"
    hint = ""
    if shape is not None and math.prod(shape) != world:
        hint = f": the mesh needs {math.prod(shape)} ranks but the world has {world}; make the product of the " \
               f"dims equal the world size"
    detail: dict[str, Any] = {"torch_error": f"{type(exc).__name__}: {message}", "world_size": world}
    if shape is not None:
        detail["shape"] = list(shape)
    if names:
        detail["names"] = list(names)
    if user:
        import linecache

        detail.update(user.detail())
        detail["code"] = linecache.getline(user.file, user.line).strip()
    return Finding("mesh_mismatch", [rank], f"{call}{where} failed on rank {rank}{hint} "
                                            f"(torch: {message})", detail)


__all__ = ["simulate_rank", "simulate_shards", "model_shapes", "build_meta_model", "check_live_mesh",
           "local_view", "mesh_error_finding", "RankView", "ParamShardView", "shard_sizes"]
