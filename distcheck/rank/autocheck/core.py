"""The core the zero-code checks of a rank share: the events, the step counters, the watched models, the ways out.

    python -m distcheck run --nproc 2 -- train.py      # rank/autocheck install() builds one per run (per pytest test)

:class:`AutoCheck` builds every check of registry.CHECKS as ``Cls(core)`` and, once, per event, the tuple of their
bound ``on_<event>`` handlers (protocol.py): the hooks call :meth:`AutoCheck.fire` and never a check by name, so
that a DDP step pays a dict lookup and the calls. The core listens first (its own ``on_`` methods): it counts the
backward() calls and the optimizers, and keeps the models passed to parallelizing calls. What it gives the checks:

- ``rank``, ``out_dir``; ``opt_steps``/``backwards``/``optimizers``, ``steps_done``, ``counter``, ``loss_step``;
- ``models``: the models this rank parallelized (:class:`WatchedModels`);
- ``wrap_depth``: how many parallelizing calls are running (parallelize_module's own distribute_module calls are
  part of the outer one: the checks and the hooks skip nested calls by it); :meth:`inside_wrap` counts one;
- ``keep(findings)``: findings of the run's verdict (the model checks'), also in the pool's verdict under pytest;
  ``emit(findings)``: findings straight to the run's findings file (rank/sink.py), as they happen;
- ``write_state()``: ``autocheck-rank<R>.json`` now: the run-level fields and each check's ``state()`` under its
  name (contract/autocheck_file.py), for a rank that may die before :meth:`finish`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Iterator

from distcheck.analysis.frame_owner import torch_phase
from distcheck.contract import autocheck_file
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck import patches, protocol
from distcheck.rank.autocheck.registry import CHECKS

log = logging.getLogger("distcheck")


def _torch_step_frame() -> Any:
    """The innermost frame of torch.optim's code on this thread's stack: the step wrapper that calls the hooks."""
    frame = sys._getframe(2)
    while frame is not None and torch_phase(frame.f_code.co_filename) != "optimizer step":
        frame = frame.f_back
    return frame


def _on_stack(frame: Any) -> bool:
    """Whether ``frame`` still runs on this thread (unknown: assume it does, as a nested step)."""
    if frame is None:
        return True
    here = sys._getframe(1)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False


class WatchedModels:
    """The models this rank passed to fully_shard / DDP / FSDP1 / parallelize_module / distribute_module, held
    weakly, in the order found."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._ids: set[int] = set()

    def add(self, module: Any) -> None:
        import torch.nn as nn

        if isinstance(module, nn.Module) and id(module) not in self._ids:
            self._ids.add(id(module))
            self._refs.append(weakref.ref(module))

    def alive(self) -> list[Any]:
        return [m for m in (ref() for ref in self._refs) if m is not None]


class AutoCheck:
    """The zero-code checks of one run (or one pytest test) in this rank, and what they share."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, emit: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        # Under `distcheck run` the model check's findings reach the sink (DISTCHECK_REPORT_DIR); the pytest pool
        # has none, so the core appends the kept findings to this rank's file itself.
        self.keeps_file = emit
        self.findings: list[Finding] = []  # kept: the verdict's (keep)
        self.opt_steps: dict[int, int] = {}  # id(optimizer) -> steps taken
        self._stepping: Any = None  # the optimizer whose step() is running (the outermost one)
        self._nested = 0  # inner step() calls running inside it
        self._step_frame: Any = None  # torch's frame of the outermost step()
        self.backwards = 0
        self.optimizers = 0
        self.wrap_depth = 0
        self.models = WatchedModels()
        self.checks = {cls.name: cls(self) for cls in CHECKS}
        self._handlers = protocol.handlers([self, *self.checks.values()])

    @property
    def active(self) -> bool:
        return patches.active is self

    # -- events ------------------------------------------------------------------------------------------------------
    def fire(self, event: str, *args: Any) -> None:
        """Call every handler of ``event``; a failing one is logged and never reaches the user's code."""
        for handler in self._handlers.get(event, ()):
            try:
                handler(*args)
            except Exception as exc:
                log.debug("distcheck: %s failed: %s: %s", handler.__qualname__, type(exc).__name__, exc)

    def on_backward(self, loss: Any) -> None:
        self.backwards += 1

    def on_optimizer_built(self, optimizer: Any) -> None:
        self.optimizers += 1

    def on_model_wrapped(self, module: Any, how: str) -> None:
        self.models.add(module)

    @contextlib.contextmanager
    def inside_wrap(self) -> Iterator[None]:
        """A parallelizing call runs: calls inside it are its part; its end fires ``wrap_returned``."""
        self.wrap_depth += 1
        try:
            yield
        finally:
            self.wrap_depth -= 1
            if not self.wrap_depth:
                self.fire("wrap_returned")

    def step_begins(self, optimizer: Any) -> None:
        """The global optimizer step pre-hook: fires ``optimizer_step`` once per training step."""
        # One training step, one dispatch: a container whose step() calls its inner optimizers' step()
        # (torchtitan's OptimizersContainer), a subclass calling super().step(): the hooks fire for each level.
        # The outermost step is the step; the inner ones are part of it.
        if self._stepping is not None:
            if _on_stack(self._step_frame):
                self._nested += 1
                return
            self._nested = 0  # that step raised (the user caught it): its post-hook never ran
        # The frame of torch's step wrapper: it stays on the stack while the step runs, closures included
        # (Lightning's and LBFGS's optimizer.step(closure) run forward and backward() inside the step).
        self._stepping, self._step_frame = optimizer, _torch_step_frame()
        step = self.opt_steps.get(id(optimizer), 0)
        # Before the count moves: a state written now (the first-step model check) still says the step is to come.
        self.fire("optimizer_step", optimizer, step)
        self.opt_steps[id(optimizer)] = step + 1

    def step_ends(self, optimizer: Any) -> None:
        """The global optimizer step post-hook: fires ``optimizer_step_done`` for the step that began."""
        if self._nested:
            self._nested -= 1
            return
        if self._stepping is not optimizer:  # a step whose pre-hook ran before the check was installed
            return
        self._stepping = None
        # After the step, not before: a closure (LBFGS, Lightning) computes the gradients inside it.
        self.fire("optimizer_step_done", optimizer, self.opt_steps.get(id(optimizer), 1) - 1)

    # -- what the checks share ----------------------------------------------------------------------------------------
    @property
    def loss_step(self) -> int:
        """The optimizer step a loss computed now belongs to: the running step's when a closure computes it inside
        optimizer.step() (Lightning, LBFGS), else the next step's."""
        if self._stepping is not None and _on_stack(self._step_frame):
            return self.opt_steps.get(id(self._stepping), 1) - 1
        return max(self.opt_steps.values(), default=0)

    @property
    def steps_done(self) -> int:
        return max(self.opt_steps.values()) if self.opt_steps else self.backwards

    @property
    def counter(self) -> str:
        return "optimizer.step" if self.opt_steps else "backward"

    def keep(self, found: list[Finding]) -> None:
        """Findings of the verdict this rank reports for its group (the lead): to the run's sink, or the pytest
        pool's file."""
        from distcheck.rank import sink

        if not found:
            return
        self.findings += found
        if os.environ.get(sink.ENV_REPORT_DIR):
            sink.emit(found, self.rank)
        elif self.keeps_file:
            sink.append(self.out_dir, self.rank, found)

    def emit(self, findings: list[Finding]) -> None:
        """Findings straight to the run's findings file (none under the pytest pool)."""
        from distcheck.rank import sink

        sink.emit(findings)

    # -- the state file ---------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        run = autocheck_file.RunFields(self.rank, self.steps_done, self.counter, self.backwards)
        parts = {name: part for name, part in ((n, c.state()) for n, c in self.checks.items()) if part}
        return autocheck_file.document(run, parts)

    def write_state(self) -> None:
        exc = autocheck_file.write(self.out_dir, self.rank, self.state())
        if exc is not None:  # a full disk: the report says what is missing (the trace header keeps it)
            from distcheck.contract.trace_slots import LOST_AUTOCHECK
            from distcheck.rank.tracer import note_lost

            note_lost(LOST_AUTOCHECK, exc)
            log.warning("distcheck: cannot write %s: %s", autocheck_file.path(self.out_dir, self.rank).name,
                        exc.strerror or exc)

    def finish(self) -> None:
        for check in self.checks.values():
            try:
                check.finish()
            except Exception as exc:  # one check's end must not cost the others theirs
                log.warning("distcheck: the %s check failed at the end: %s: %s", check.name, type(exc).__name__, exc)
        self.write_state()

    def stop_watching(self) -> None:
        self.fire("uninstalled")
