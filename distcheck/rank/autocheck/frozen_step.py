"""The frozen-model watch: does optimizer.step() have anything to update in the first steps?

    python -m distcheck run --nproc 2 -- train.py      # the first 3 optimizer steps (DISTCHECK_DRIFT_STEPS)

After each of the first K optimizer steps (the global step post-hook, rank/autocheck/patches.py: a closure
computes the gradients inside the step), this rank looks at
the optimizer's parameters, without reading a single value: none at all, none with ``requires_grad``, or not one
with a gradient means this step changes nothing. Why, where distcheck can see it: FSDP2's
``set_requires_gradient_sync(False)`` (patched to note its line) never switched back on, no backward() before the
step, every parameter frozen, an optimizer built over no parameters. Each step's verdict goes to
``autocheck-rank<R>.json``; the supervisor reports a rank whose every checked step was frozen
(analysis/replica_drift.py: ``frozen_finding``).
"""
from __future__ import annotations

import weakref
from typing import Any

from distcheck.rank.usersite import Site, caller_site


def _site(site: Site | None) -> list | None:
    return [site.file, site.line] if site is not None and site.file and site.line else None


class FrozenWatch:
    def __init__(self, owner: Any, steps: int) -> None:
        self.owner = owner  # the AutoCheck: backward() count
        self.steps = steps
        self.rows: list[dict[str, Any]] = []
        self.sync_off: Site | None = None  # the last set_requires_gradient_sync(False) still in force
        self._built: dict[int, tuple[weakref.ref, Site]] = {}  # id(optimizer) -> where it was built
        self._backwards_at_last_step = 0

    def note_optimizer(self, optimizer: Any) -> None:
        self._built[id(optimizer)] = (weakref.ref(optimizer), caller_site())

    def note_gradient_sync(self, on: bool) -> None:
        self.sync_off = None if on else caller_site()

    def on_optimizer_step(self, optimizer: Any, step: int) -> None:
        backwards = self.owner.backwards - self._backwards_at_last_step
        self._backwards_at_last_step = self.owner.backwards
        if step >= self.steps:
            return
        params = [p for g in getattr(optimizer, "param_groups", []) for p in g.get("params", [])]
        cause = None
        if not params:
            cause = "no_params"
        elif not any(getattr(p, "requires_grad", False) for p in params):
            cause = "requires_grad_false"
        elif all(getattr(p, "grad", None) is None for p in params):
            cause = "gradient_sync_off" if self.sync_off is not None else "no_backward" if not backwards \
                else "no_grad"
        built = self._built.get(id(optimizer))
        self.rows.append({"step": step, "cause": cause, "params": len(params), "backwards": backwards,
                          "optimizer": type(optimizer).__name__, "site": _site(caller_site()),
                          "built": _site(built[1]) if built and built[0]() is optimizer else None,
                          "sync_off": _site(self.sync_off) if cause == "gradient_sync_off" else None})

    def state(self) -> list[dict[str, Any]]:
        return self.rows
