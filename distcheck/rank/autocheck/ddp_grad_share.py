"""Which rank of a DDP group checks a step's gradients for NaN/Inf: one per step, in turn.

    python -m distcheck run --nproc 2 -- train.py      # rank 0 checks steps 0, 2, 4 ..., rank 1 steps 1, 3, 5 ...

After DDP's all-reduce every rank of its process group holds the same gradients, so the NaN watch's pass over them
(one ``torch._foreach_norm``, 0.5 ms of a 10 ms step of 4 MB of gradients on a loaded 2-core machine) tells the
same on each. In the first GRAD_DENSE_STEPS steps, where every step's gradients are checked, each rank checks them on
its turns only (``step % group size == its rank in the group``), so every step is still checked, by one rank; each
rank still checks its own loss at every step, and all of its gradients on a step whose loss is bad. The rank that
checked names the group's ranks in its event (``BadEvent.replicated``), and analysis/bad_values.py gives each of them
the same gradient event, so the report reads as if every rank had checked.

Only where the gradients are DDP's all-reduced ones, as seen this very step: one DDP model, every parameter the
optimizer steps is one of its own, no Python comm hook (post-local SGD all-reduces within subgroups only), DDP's own
forward ran with grad sync on and its inner module was not called past it with sync on (``model.module(x)``
leaves each rank its own gradients; the micro-batches of ``no_sync()`` are all-reduced by the synced backward
after them, and a step after ``no_sync()`` alone is not). Anything else, and every rank checks everything, as
before.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Share:
    """This step's part for this rank: whether it checks the gradients, and the group that holds the same ones."""

    mine: bool
    ranks: list[int]


def _group(model: Any) -> tuple[int, int, list[int]]:
    import torch.distributed as dist

    group = getattr(model, "process_group", None)
    return dist.get_rank(group), dist.get_world_size(group), dist.get_process_group_ranks(group)


class DdpGradShare:
    """Counts, per step, the forwards of the one DDP model that synced and those of its inner module; ``share`` at
    each optimizer step says whether the step's gradients are the group's and whose turn it is to check them."""

    def __init__(self, group_of: Callable[[Any], tuple[int, int, list[int]]] = _group) -> None:
        self._group_of = group_of
        self._model: Any = None  # weakref to the DDP model
        self._group: tuple[int, int, list[int]] | None = None
        self._handles: list[Any] = []
        self._own: set[int] | None = None  # ids of the DDP model's parameters
        self._covered: dict[tuple[int, int], bool] = {}
        self.off = False  # a second DDP model, or the dense steps are over: no more sharing
        self.synced = 0  # DDP forwards with grad enabled and require_backward_grad_sync, since the last step
        self.inner = 0  # calls of its inner module with grad enabled and sync on (DDP's own forward makes one)

    def watch(self, model: Any) -> None:
        """A DDP model was built (``model_wrapped`` with how "ddp")."""
        if self.off:
            return
        if self._model is not None:
            self.stop()  # two DDP models: which gradients a step holds is no longer one group's
            return
        inner = getattr(model, "module", None)
        if inner is None or not hasattr(model, "require_backward_grad_sync"):
            self.stop()
            return
        import torch

        grad_on, compiling = torch.is_grad_enabled, torch.compiler.is_compiling
        me, ddp = weakref.ref(self), weakref.ref(model)
        self._model = ddp

        def outer(module: Any, args: Any) -> None:
            share = me()
            if share is not None and not compiling() and grad_on() and module.require_backward_grad_sync:
                share.synced += 1

        def through(module: Any, args: Any) -> None:
            # Inside no_sync() (gradient accumulation) the gradients stay local until the next synced backward
            # all-reduces what they add up to: only a call with grad sync on can leave a step's gradients local.
            share, wrapper = me(), ddp()
            if share is not None and wrapper is not None and not compiling() and grad_on() \
                    and wrapper.require_backward_grad_sync:
                share.inner += 1

        self._handles = [model.register_forward_pre_hook(outer), inner.register_forward_pre_hook(through)]

    def share(self, optimizer: Any, params: list[Any], step: int) -> Share | None:
        """This step's share of ``optimizer``'s ``params`` (the NaN watch lists them for its check), or None: this
        rank checks every gradient. Resets the counts for the next step."""
        synced, inner, self.synced, self.inner = self.synced, self.inner, 0, 0
        model = self._model() if self._model is not None else None
        if self.off or model is None or synced == 0 or inner != synced or getattr(model, "_comm_hooks", None):
            return None
        try:
            if self._group is None:
                self._group = self._group_of(model)
            rank, size, ranks = self._group
        except Exception:  # no process group to ask (destroyed): check everything
            return None
        if size < 2 or not self._covers(model, optimizer, params):
            return None
        return Share(step % size == rank, list(ranks))

    def _covers(self, model: Any, optimizer: Any, params: list[Any]) -> bool:
        """Every parameter ``optimizer`` steps is the DDP model's (once per optimizer and parameter count)."""
        key = (id(optimizer), len(params))
        hit = self._covered.get(key)
        if hit is None:
            if self._own is None:
                self._own = {id(p) for p in model.parameters()}
            hit = self._covered[key] = all(id(p) in self._own for p in params)
        return hit

    def stop(self) -> None:
        self.off = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._model = None
