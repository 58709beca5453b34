"""Apply ``--parallel fsdp|ddp|tp`` to a model, and read back full (unsharded) tensors.

fsdp: FSDP2 ``fully_shard`` on every block (each element of a top-level ModuleList/Sequential) and on the root.
ddp:  DistributedDataParallel.
tp:   tensor parallelism: the model's own ``distcheck_tp_plan(mesh)`` (module path -> ParallelStyle), or the
      built-in plan for the built-in transformer (colwise q/k/v/up, rowwise out/down).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distcheck.errors import UsageError

MODES = ("fsdp", "ddp", "tp")


@dataclass
class Parallel:
    mode: str
    module: nn.Module  # what to call in the forward (DDP wrapper, or the sharded model itself)
    inner: nn.Module  # the user's module, for parameter names
    splits_batch: bool  # data parallel: each rank gets 1/N of the global batch; TP: every rank gets all of it


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """Transformer-style blocks: elements of top-level ModuleList/Sequential children."""
    out: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out.extend(m for m in child if any(True for _ in m.parameters()))
    return out


def builtin_tp_plan(model: nn.Module) -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for i, _ in enumerate(model.blocks):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out", "mlp.down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def check_tp_supported(model: nn.Module, world_size: int) -> None:
    from distcheck.checks.models import TinyTransformer

    if hasattr(model, "distcheck_tp_plan"):
        return
    if not isinstance(model, TinyTransformer):
        raise UsageError("--parallel tp needs the built-in model or a model with a distcheck_tp_plan(mesh) method "
                         "returning {module path: ParallelStyle}")
    if model.cfg.heads % world_size or model.cfg.hidden % world_size:
        raise UsageError(f"--parallel tp: the built-in model's {model.cfg.heads} heads and hidden size "
                         f"{model.cfg.hidden} must divide by the world size {world_size}; use fewer ranks or fsdp")


def apply(model: nn.Module, mode: str, device: torch.device, world_size: int) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return Parallel(mode, DistributedDataParallel(model, device_ids=ids), model, True)
    mesh = init_device_mesh(device.type, (world_size,))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Parallel(mode, model, model, True)
    if mode == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        plan = model.distcheck_tp_plan(mesh) if hasattr(model, "distcheck_tp_plan") else builtin_tp_plan(model)
        parallelize_module(model, mesh, plan)
        return Parallel(mode, model, model, False)
    raise UsageError(f"--parallel {mode}: expected one of {', '.join(MODES)}")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: DTensors are gathered (a collective: every rank must call it), others detached."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach()
    return t.detach()
