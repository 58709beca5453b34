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
from distcheck.options import PARALLEL_MODES

MODES = PARALLEL_MODES


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
    """Bad input for ``--parallel tp``, before anything is parallelized: a model with no plan distcheck can trust."""
    from distcheck.rank.checks.models import TinyTransformer

    if hasattr(model, "distcheck_tp_plan"):
        return
    if not isinstance(model, TinyTransformer):
        raise UsageError(f"--parallel tp: {type(model).__name__} has no tensor-parallel plan: define a method "
                         "distcheck_tp_plan(self, mesh) returning {module path: ParallelStyle}, e.g. "
                         "{'blocks.*.mlp.up': ColwiseParallel(), 'blocks.*.mlp.down': RowwiseParallel()}")
    if model.cfg.heads % world_size or model.cfg.hidden % world_size:
        raise UsageError(f"--parallel tp: the built-in model's {model.cfg.heads} heads and hidden size "
                         f"{model.cfg.hidden} must divide by the world size {world_size}; use fewer ranks or fsdp")


def check_plan_fits(model: nn.Module, plan: dict) -> None:
    """Every key of the plan must name a module of the model (``*`` matches one path component, as
    parallelize_module reads it): torch only warns about keys it cannot resolve and leaves those layers
    replicated, which would pass every check while nothing is parallel."""
    import fnmatch

    if not isinstance(plan, dict) or not plan:
        raise UsageError("--parallel tp: distcheck_tp_plan(mesh) must return a non-empty dict "
                         "{module path: ParallelStyle}")
    names = [name for name, _ in model.named_modules() if name]
    for key in plan:
        pattern = str(key)
        depth = pattern.count(".")
        if not any(fnmatch.fnmatchcase(name, pattern) and name.count(".") == depth for name in names):
            raise UsageError(f"--parallel tp: plan key {pattern!r} names no module of {type(model).__name__}: "
                             "fix distcheck_tp_plan(mesh) (module paths as in model.named_modules())")


def check_something_parallel(model: nn.Module) -> None:
    """A tensor-parallel step that left every parameter a plain tensor parallelized nothing: never a PASS."""
    if not any(hasattr(p, "placements") for p in model.parameters()):
        raise UsageError(f"--parallel tp: the plan left every parameter of {type(model).__name__} a plain tensor, "
                         "so nothing is tensor-parallel: check the ParallelStyles of distcheck_tp_plan(mesh)")


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

        check_tp_supported(model, world_size)
        plan = model.distcheck_tp_plan(mesh) if hasattr(model, "distcheck_tp_plan") else builtin_tp_plan(model)
        check_plan_fits(model, plan)
        parallelize_module(model, mesh, plan)
        check_something_parallel(model)
        return Parallel(mode, model, model, False)
    raise UsageError(f"--parallel {mode}: expected one of {', '.join(MODES)}")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: DTensors are gathered (a collective: every rank must call it), others detached."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach()
    return t.detach()
