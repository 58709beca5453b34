"""The frozen-model watch: does optimizer.step() have anything to update in the first steps?

    python -m distcheck run --nproc 2 -- train.py      # the first 3 optimizer steps (DISTCHECK_DRIFT_STEPS)

After each of the first K optimizer steps (the global step post-hook, rank/autocheck/patches.py: a closure
computes the gradients inside the step), this rank looks at
the optimizer's parameters, without reading a single value: none at all, none with ``requires_grad``, or not one
with a gradient means this step changes nothing. Why, where distcheck can see it: FSDP2's
``set_requires_gradient_sync(False)`` (patched to note its line) never switched back on, no backward() before the
step, every parameter frozen, an optimizer built over no parameters, an optimizer built before a parallelizing call
replaced the parameters it holds (:class:`ReplacedParams`). Each step's verdict goes to
``autocheck-rank<R>.json``; the supervisor reports a rank whose every checked step was frozen
(analysis/replica_drift.py: ``frozen_finding``).
"""
from __future__ import annotations

import weakref
from typing import Any

from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.autocheck.replica_drift import steps_from_env
from distcheck.rank.usersite import Site, caller_site


def _site(site: Site | None) -> list | None:
    return [site.file, site.line] if site is not None and site.file and site.line else None


class FrozenWatch(Check):
    name = "frozen"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the backward() count
        self.steps = steps_from_env()  # the drift check's steps: the first K are looked at
        self.rows: list[dict[str, Any]] = []
        self.sync_off: Site | None = None  # the last set_requires_gradient_sync(False) still in force
        self._built: dict[int, tuple[weakref.ref, Site]] = {}  # id(optimizer) -> where it was built
        self._backwards_at_last_step = 0
        self.replaced = ReplacedParams()
        self._before_wrap: dict[int, Any] | None = None  # the running outermost wrap's parameters (replaced)

    def state(self) -> list[dict[str, Any]]:
        return self.rows

    def on_optimizer_built(self, optimizer: Any) -> None:
        self._built[id(optimizer)] = (weakref.ref(optimizer), caller_site())
        self.replaced.note_optimizer(optimizer)  # is it built before a call replaces its parameters?

    def on_gradient_sync(self, on: bool) -> None:
        self.sync_off = None if on else caller_site()

    def on_wrap_begin(self, modules: Any) -> None:
        self._before_wrap = self.replaced.before(modules)

    def on_wrap_end(self, call: str, modules: Any, site: Site | None) -> None:
        """Which optimizers' parameters the call took away: theirs is the call's line (``built_before_wrap``)."""
        before, self._before_wrap = self._before_wrap, None
        self.replaced.after(before, call, modules, site)

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        """After the step, not before: a closure (LBFGS, Lightning) computes the gradients inside it."""
        backwards = self.core.backwards - self._backwards_at_last_step
        self._backwards_at_last_step = self.core.backwards
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
        self.replaced.explain(self.rows[-1], optimizer)  # was it built before a call replaced its parameters?


class ReplacedParams:
    """Optimizers built before a call that replaced their parameters (fully_shard, FSDP1, parallelize_module).

    ``fully_shard`` swaps each parameter for a new sharded DTensor ``nn.Parameter``, FSDP1 for its flat parameter and
    a parallel style for a new DTensor parameter: an optimizer built before holds the old tensors, which no backward()
    reaches. Each outermost parallelizing call, while an optimizer is alive, notes which of the module's parameters
    it took away; an optimizer holding one of them keeps the call's name and line, and the frozen-step row of that
    optimizer names them as the cause (``built_before_wrap``). One set of ids per call, nothing per step.
    """

    def __init__(self) -> None:
        self._optimizers: list[weakref.ref] = []
        self.wraps: dict[int, tuple[str, list]] = {}  # id(optimizer) -> (the call, [file, line])

    def note_optimizer(self, optimizer: Any) -> None:
        self._optimizers.append(weakref.ref(optimizer))

    def _live(self) -> list[Any]:
        self._optimizers = [ref for ref in self._optimizers if ref() is not None]
        return [ref() for ref in self._optimizers]

    def before(self, modules: Any) -> dict[int, Any] | None:
        """The parameters the call may replace, by id (None when no optimizer exists yet: nothing to note)."""
        if not self._live():
            return None
        return {id(p): p for m in _module_list(modules) for p in m.parameters()}

    def after(self, before: dict[int, Any] | None, call: str, modules: Any, site: Site | None) -> None:
        if not before:
            return
        kept = {id(p) for m in _module_list(modules) for p in m.parameters()}
        gone = before.keys() - kept
        if not gone:
            return
        for opt in self._live():
            held = {id(p) for g in getattr(opt, "param_groups", []) for p in g.get("params", [])}
            if id(opt) not in self.wraps and held & gone:
                self.wraps[id(opt)] = (call, _site(site))

    def explain(self, row: dict[str, Any], optimizer: Any) -> None:
        """A frozen step of an optimizer whose parameters a later call replaced: that call is the cause."""
        wrap = self.wraps.get(id(optimizer))
        if wrap is not None and row.get("cause") == "no_grad":
            row.update(cause="built_before_wrap", wrap_call=wrap[0], wrap_site=wrap[1])


def _module_list(modules: Any) -> list[Any]:
    import torch.nn as nn

    items = modules if isinstance(modules, (list, tuple)) else [modules]
    return [m for m in items if isinstance(m, nn.Module)]
