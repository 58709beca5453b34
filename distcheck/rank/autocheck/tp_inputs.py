"""The ranks of one tensor-parallel group must feed a replicated-input layer the same batch.

    python -m distcheck run --nproc 2 -- fixtures/tp_input_per_rank.py

``ColwiseParallel`` (and ``PrepareModuleInput`` with ``Replicate()`` input layouts) treats the plain tensor a
module receives as replicated: every rank of the TP mesh must pass the same values, and torch never checks. A
loader seeded or sharded by the global rank (instead of the data-parallel rank) feeds each TP rank another batch;
the replicated parts of the model (a bias, a norm) then diverge and the finding that follows blames gradients.

At ``parallelize_module`` (patched, rank/autocheck/patches.py) the plan's modules whose every input layout is
``Replicate()`` get a one-shot forward pre-hook, ahead of torch's own input hook. At each one's first forward the
TP group's ranks compare fingerprints of its plain-tensor inputs in one side-channel exchange (rank/checks/replicas.py:
never the user's process group); a difference is one ``tensor_divergence`` naming the module, the ranks, the
user's line of the forward call and the usual cause. Inputs that are already DTensors are consistent by
construction and skipped; so are modules whose input is sharded (RowwiseParallel, SequenceParallel), and compiled
code. At most PER_PLAN modules of each plan are watched: the first layers are where a per-rank batch enters.
"""
from __future__ import annotations

import fnmatch
import logging
import time
from typing import Any, Callable

from distcheck.contract.findings import Finding, format_ranks
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site, caller_site

log = logging.getLogger("distcheck")

PER_PLAN = 4


def replicated_input(style: Any) -> bool:
    """Whether a ParallelStyle takes its module's inputs as replicated (ColwiseParallel's default, a
    PrepareModuleInput whose every layout is Replicate())."""
    from torch.distributed.tensor import Replicate

    layouts = getattr(style, "input_layouts", None)
    if layouts is None:
        return False
    layouts = layouts if isinstance(layouts, (list, tuple)) else (layouts,)
    return bool(layouts) and all(isinstance(p, Replicate) for p in layouts if p is not None) and \
        any(p is not None for p in layouts)


def plan_modules(root: Any, plan: Any) -> list[tuple[str, Any, Any]]:
    """(name, module, style) for the plan's entries, in plan order; parallelize_module's ``*`` wildcards expand."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(plan, ParallelStyle):
        return [("", root, plan)]
    out = []
    if not isinstance(plan, dict):
        return out
    names = dict(root.named_modules())
    for pattern, style in plan.items():
        for name in sorted(n for n in names if n and fnmatch.fnmatchcase(n, pattern)):
            out.append((name, names[name], style))
    return out


def once_at_forward(owner: Any, module: Any, what: str, run: Callable[[tuple, dict], None],
                    training_only: bool = False) -> None:
    """Call ``run(args, kwargs)`` with the inputs of ``module``'s first forward (``training_only``: its first with
    grad enabled and the module in train mode), ahead of every other forward pre-hook (torch's TP input hooks), then
    never again; compiled code is skipped (a side-channel exchange is nothing Dynamo can trace). Its time goes to
    ``owner.seconds``; a failure is a warning, never the user's forward's."""
    handle = None

    def hook(mod: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if torch.compiler.is_compiling():
            return
        if training_only and (not torch.is_grad_enabled() or not mod.training):
            return
        handle.remove()
        started = time.perf_counter()
        try:
            run(args, kwargs)
        except Exception as exc:  # the check must never break the user's forward
            log.warning("distcheck: %s failed: %s", what, exc)
        finally:
            owner.seconds += time.perf_counter() - started

    handle = module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def batch_site() -> Site:
    """The user's line that called the model with this batch: the first user frame, outwards, that is not inside
    a module's forward (the training loop's ``model(inp)``, not the model's ``self.in_proj(x)``)."""
    import sys

    import torch

    from distcheck.analysis.frame_owner import USER, owner

    frame = sys._getframe(1)
    inner = None
    while frame is not None:
        if owner(frame.f_code.co_filename) == USER:
            if not isinstance(frame.f_locals.get("self"), torch.nn.Module):
                return Site(frame.f_code.co_filename, frame.f_lineno)
            inner = inner or frame
        frame = frame.f_back
    return Site(inner.f_code.co_filename, inner.f_lineno) if inner is not None else caller_site()


def plain_inputs(args: tuple, kwargs: dict, Tensor: type, DTensor: type) -> list[tuple[str, str, Any]]:
    items = []
    for i, value in enumerate(args):
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            items.append((f"input {i}", "input", value))
    for key, value in kwargs.items():
        if isinstance(value, Tensor) and not isinstance(value, DTensor):
            items.append((f"input {key}", "input", value))
    return items


class TPInputs(Check):
    name = "tp_inputs"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the rank, wrap_depth and emit(): its findings go to the run's findings file at once
        self.seconds = 0.0

    def on_plan(self, root: Any, plan: Any, ranks: list[int] | None, src_data_rank: Any) -> None:
        """The outermost parallelize_module of one module (not its own nested calls, nor a list of modules)."""
        if isinstance(root, (list, tuple)) or self.core.wrap_depth:
            return
        if not ranks or len(ranks) < 2 or self.core.rank not in ranks:
            return
        watched = 0
        for name, module, style in plan_modules(root, plan):
            if watched >= PER_PLAN:
                break
            if replicated_input(style):
                self._watch(name or type(root).__name__, module, type(style).__name__, sorted(ranks))
                watched += 1

    def _watch(self, name: str, module: Any, style: str, ranks: list[int]) -> None:
        once_at_forward(self, module, f"comparing the inputs of {name} across the TP group",
                        lambda args, kwargs: self._compare(name, style, ranks, args, kwargs, batch_site()))

    def _compare(self, name: str, style: str, ranks: list[int], args: tuple, kwargs: dict, site: Site) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        from distcheck.rank.checks.replicas import compare_entries
        from distcheck.rank.runtime import current_channel

        channel = current_channel()
        if channel is None:
            return
        items = plain_inputs(args, kwargs, torch.Tensor, DTensor)
        if not items:
            return
        with torch.no_grad():
            compared = compare_entries(f"tp_input/{name}", items, channel, ranks)
        if not compared.divergences or self.core.rank != ranks[0]:
            return  # every rank of the group found the same: its first rank reports it
        self.core.emit([input_finding(name, style, ranks, compared.divergences, compared.summaries, site)])


def input_finding(name: str, style: str, ranks: list[int], divergences: list, summaries: dict,
                  site: Site) -> Finding:
    blamed = sorted({r for d in divergences for r in d.blamed})
    d = divergences[0]
    worst = max(summaries.get(d.name, {}).values(), key=lambda s: s.max_abs_diff, default=None)
    at = f" at {site.site}" if site.file else ""
    diff = (f" (max abs diff {worst.max_abs_diff:.4g} on rank {worst.rank} against rank {d.reference})"
            if worst is not None else f" ({d.structural})" if d.structural else "")
    message = (f"{format_ranks(ranks)} (one TP group) fed '{name}' ({style}, input Replicate) different "
               f"inputs at its first forward{at}: {d.name} differs on {format_ranks(blamed)}{diff}. {style} takes "
               f"its input as replicated: every rank of a TP group must get the same batch. The usual cause: a "
               f"DataLoader or seed by the global rank instead of the data-parallel rank (a DistributedSampler "
               f"with num_replicas and rank from the data-parallel mesh dim, mesh['dp'].get_local_rank())")
    return Finding("tensor_divergence", blamed, message,
                   {"cause": "tp_input_differs", "module": name, "style": style, "group": ranks,
                    "inputs": [x.name for x in divergences], "file": site.file, "line": site.line,
                    "max_abs_diff": worst.max_abs_diff if worst is not None else None})
