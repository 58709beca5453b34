"""The replica-drift watch: do data-parallel replicas still hold the same parameters after each early step?

    python -m distcheck run --nproc 2 -- train.py             # the first 3 optimizer steps (default)
    python -m distcheck run --nproc 2 --steps 5 -- train.py   # DISTCHECK_DRIFT_STEPS=5 in the ranks; 0: off

What must be identical across ranks, by how the script parallelized its model: a DDP model's parameters on every
rank of its process group; a DTensor parameter on the ranks that share its coordinates on every non-Replicate
mesh dim (HSDP's replicate dim, a TP layer's replicated bias); a plain parameter of a tensor-parallel model on
every rank of its TP mesh; an FSDP1 unit's chunk on the ranks that hold the same one (NO_SHARD, HYBRID_SHARD's
replicate group), by original parameter, and the parameters of FSDP1's ``ignored_modules`` on every rank that trains
the model. At the first forward (the baseline) and after each of the first K optimizer steps, this rank
fingerprints those parameters (about one ``torch.sum`` over them; nothing at all for a plain FSDP2 model, or FSDP1
with FULL_SHARD and nothing ignored, which replicate nothing) and writes the fingerprints to
``autocheck-rank<R>.json``. The supervisor compares the ranks' files (analysis/replica_drift.py), so no rank ever
waits for another here.

To say what the script did, backward() calls under DDP's ``no_sync()`` are counted per step, with the line of the
``with model.no_sync():`` that turned the gradient all-reduce off; and a step built on a forward that went around DDP
(``model.module(x)`` with grad enabled while DDP's own forward, which arms the all-reduce, never ran in that step)
keeps the line of that forward. Two forward pre-hooks per DDP model (on it and on its ``module``) only set or read a
flag, and are removed after the K checked steps; the step hooks do the rest.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Any

from distcheck.analysis.replica_drift import fingerprint_row
from distcheck.contract import env
from distcheck.rank.autocheck.discovery import outermost, user_name
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site, caller_site

log = logging.getLogger("distcheck")

ENV_DRIFT_STEPS = env.DRIFT_STEPS
DEFAULT_STEPS = 3


def steps_from_env() -> int:
    text = os.environ.get(ENV_DRIFT_STEPS, "").strip()
    try:
        return max(0, int(text)) if text else DEFAULT_STEPS
    except ValueError:
        return DEFAULT_STEPS


def replicated_params(roots: list[Any]) -> list[tuple[str, Any, Any]]:
    """(name, replica key, parameter) for every parameter some other rank must hold an identical copy of.

    The key is JSON-able; ranks whose keys are equal must agree. Parameters replicated nowhere are left out.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from distcheck.rank.checks import fsdp1
    from distcheck.rank.checks.replicas import replica_key

    out: list[tuple[str, Any, Any]] = []
    for root in roots:
        if fsdp1.units(root):
            out += _fsdp1_replicated(root)
            continue
        named = list(root.named_parameters())
        plain_group = None
        if isinstance(root, DistributedDataParallel):
            plain_group = ["ddp", dist.get_process_group_ranks(root.process_group)]
            # Parameters the user told DDP to ignore are not synchronized by it: they may differ on purpose.
            ignored = set(getattr(root, "parameters_to_ignore", ()) or ())
            named = [(n, p) for n, p in named if user_name(n) not in ignored]
        else:
            mesh = next((getattr(p, "device_mesh", None) for _, p in named
                         if getattr(p, "device_mesh", None) is not None), None)
            if mesh is not None:  # a tensor-parallel model: its plain parameters must agree over the TP mesh
                plain_group = ["tp", mesh.mesh.flatten().tolist()]
        for name, p in named:
            if getattr(p, "placements", None) is not None:
                key = replica_key(p)
                mesh_shape = key[1]
                replicated = any(pl.is_replicate() and mesh_shape[d] > 1 for d, pl in enumerate(p.placements))
                if replicated:
                    out.append((user_name(name), [list(key[0]), list(key[1]), [list(c) for c in key[2]]], p))
            elif plain_group is not None and len(plain_group[1]) > 1:
                out.append((user_name(name), plain_group, p))
    return out


def _fsdp1_replicated(root: Any) -> list[tuple[str, Any, Any]]:
    """An FSDP1 model's replicas: each unit's local pieces where other ranks hold the same chunk (NO_SHARD's group,
    HYBRID_SHARD's replicate group), and the parameters of its ``ignored_modules`` (FSDP1 never reduces their
    gradients) over every rank that trains the model."""
    from distcheck.rank.checks import fsdp1

    units = fsdp1.units(root)
    index = fsdp1.FlatIndex([root])
    out: list[tuple[str, Any, Any]] = []
    for unit in index.units:
        ranks = fsdp1.replicated(unit)
        if ranks is None:
            continue
        key = ["fsdp1", ranks, fsdp1.shard_key(unit)[2]]
        out += [(name, key, piece) for name, piece in fsdp1.local_pieces(unit) if piece.numel()]
    everyone = fsdp1.data_parallel_ranks(units[0].module)
    if everyone and len(everyone) > 1:
        key = ["fsdp1_ignored", everyone, getattr(units[0].module, fsdp1.WRAP_SITE, None)]
        ignored = fsdp1.ignored_params(root)
        out += [(user_name(n), key, p) for n, p in root.named_parameters() if id(p) in ignored]
    return out


class ReplicaDrift(Check):
    name = "replica_drift"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the watched models
        self.steps = steps_from_env()
        self.checked: list[dict[str, Any]] = []  # one row per fingerprinted point: baseline (-1), then steps
        self.seconds = 0.0
        self._done_steps: set[int] = set()
        self._backwards = 0  # backward() calls since the last optimizer step
        self._unsynced = 0  # ... of which ran with DDP's gradient all-reduce off
        self._no_sync_depth = 0
        self._no_sync_site: Site | None = None
        self._ddp_forward_ran = False  # a DDP model's own forward ran since the last optimizer step
        self._bypass_site: Site | None = None  # the first grad-enabled forward of a DDP's module around DDP
        self._bypass_hooks: list[Any] = []

    # -- events ----------------------------------------------------------------------------------------------------
    def on_no_sync_enter(self) -> None:
        self._no_sync_depth += 1
        self._no_sync_site = caller_site()

    def on_no_sync_exit(self) -> None:
        self._no_sync_depth = max(0, self._no_sync_depth - 1)

    def on_model_wrapped(self, model: Any, how: str) -> None:
        """A DDP model: note, per step, whether its own forward ran and where its ``module`` was called around
        it."""
        import torch

        if how != "ddp" or not self.steps or not isinstance(getattr(model, "module", None), torch.nn.Module):
            return
        me = weakref.ref(self)
        self._bypass_hooks.append(model.register_forward_pre_hook(functools.partial(_ddp_forward, me)))
        self._bypass_hooks.append(model.module.register_forward_pre_hook(
            functools.partial(_inner_forward, me, torch.is_grad_enabled)))

    def _stop_bypass_watch(self) -> None:
        for handle in self._bypass_hooks:
            handle.remove()
        self._bypass_hooks = []

    def on_backward(self, loss: Any) -> None:
        self._backwards += 1
        if self._no_sync_depth:
            self._unsynced += 1

    def on_model_checked(self, root: Any) -> None:
        if self.steps and not self.checked:
            self._take(-1, None)

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        backwards, unsynced = self._backwards, self._unsynced
        # A training step built on a forward around DDP: a backward() ran, and DDP's own forward did not.
        bypass = self._bypass_site if backwards and not self._ddp_forward_ran else None
        self._backwards = self._unsynced = 0
        self._ddp_forward_ran, self._bypass_site = False, None
        if step + 1 >= self.steps:
            self._stop_bypass_watch()  # the later steps are not compared: their forwards pay nothing
        if step >= self.steps or step in self._done_steps or not self.checked:
            return
        self._done_steps.add(step)
        self._take(step, {"backwards": backwards, "unsynced": unsynced,
                          "no_sync_site": self._no_sync_site.detail() if unsynced and self._no_sync_site else None,
                          "ddp_bypass_site": bypass.detail() if bypass else None,
                          "site": caller_site().detail()})

    # -- the fingerprints ------------------------------------------------------------------------------------------
    def _take(self, step: int, how: dict[str, Any] | None) -> None:
        from distcheck.rank.checks.fingerprint import fingerprint_many

        started = time.perf_counter()
        try:
            items = replicated_params(outermost(self.core.models.alive()))
            if not items and step == -1:
                self.steps = 0  # nothing replicated (plain FSDP2, or no model): nothing to watch later either
                return
            fps = fingerprint_many((name, p) for name, _, p in items)
            row = {"step": step, "params": [fingerprint_row(name, key, fps[name]) for name, key, _ in items
                                            if name in fps]}
            if how:
                row.update(how)
            self.checked.append(row)
        except Exception as exc:  # the check must never break the user's training
            log.warning("distcheck: the replica drift check failed: %s: %s", type(exc).__name__, exc)
            self.steps = 0
            return
        finally:
            self.seconds += time.perf_counter() - started
        if step >= 0:
            self.core.write_state()

    def state(self) -> dict[str, Any] | None:
        if not self.checked:
            return None
        return {"steps": self.steps, "checked": self.checked, "seconds": self.seconds}


def _ddp_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    drift = ref()
    if drift is not None:
        drift._ddp_forward_ran = True


def _inner_forward(ref: weakref.ref, grad_enabled: Any, module: Any, args: Any) -> None:
    """The wrapped module's forward: inside DDP's own (the flag is set) it is the normal path and costs a read."""
    drift = ref()
    if drift is None or drift._ddp_forward_ran or drift._bypass_site is not None or not grad_enabled():
        return  # no_grad evaluation of model.module builds no step: not a bypass
    drift._bypass_site = caller_site()
