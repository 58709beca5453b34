"""Zero-code checks in a rank: thirteen jobs behind one switch (DISTCHECK_AUTOCHECK=0 turns them off).

    python -m distcheck run --nproc 2 -- train.py          # installed in every rank
    python -m distcheck compare --nproc 2 -- train.py      # plus the automatic records
    pytest -n 2 tests/                                       # the distributed marker installs it per test

* discovery.py: find the models the script parallelizes and check each once at its first forward
  (``check_model`` plus uninitialized values: ``uncovered_param``, ``bad_values``, ...);
* nan_watch.py: the first step whose loss or gradients hold NaN/Inf (``bad_values``);
* replica_drift.py: after each of the first K optimizer steps, fingerprints of what data-parallel replicas must hold
  identically (compared by the supervisor: ``tensor_divergence``);
* auto_records.py: under ``compare``, the loss and parameters of the first K steps (``auto/loss``, ``auto/params``)
  and the gradients of the first (``auto/grads``);
* module_summaries.py: under ``compare``, per-sample summaries of every module's output and input gradient in the
  first step (the first divergent module);
* prewrap.py: the model compared across ranks where it is parallelized, before torch runs (rank-seeded init, a
  model whose structure differs: ``tensor_divergence``);
* frozen_step.py: the first optimizer steps that have nothing to update (a frozen model);
* precision.py: where the rank computed in bf16/fp16 (autocast, FSDP2 mixed precision, DDP compression hooks,
  16-bit parameters), so that compare judges its records at that precision;
* async_work.py: an optimizer step over gradients whose async all-reduce nobody waited for (``tensor_divergence``);
* checkpoint_load.py: a ``load_state_dict(strict=False)`` or a DCP load with ``allow_partial_load`` that loaded
  nothing, or missed keys under a wrapper's prefix (``bad_values``); dcp_roundtrip.py: a DCP resume whose loaded
  values are not what the same run saved, or that landed in tensors the model no longer uses;
* tp_inputs.py: the ranks of a TP group feeding a replicated-input layer different batches (``tensor_divergence``);
* dp_inputs.py: the data-parallel ranks of DDP, or of FSDP2's mesh (per dp group), all fed the same first batch
  (a warning naming the DataLoader or the seed);
* pipeline_schedule.py: each pipeline stage's schedule (class, n_microbatches, stages, what its first step splits),
  written before torch runs it; the supervisor compares the stages (``collective_mismatch``);

patches.py holds the hooks (fully_shard, DDP and its no_sync(), parallelize_module, optimizers, ``backward``) that
feed these jobs through :class:`AutoCheck`, which also owns the step counters they share and the per-rank state file
``autocheck-rank<R>.json`` the supervisor reads (its format: contract/autocheck_file.py).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from distcheck.contract import autocheck_file, env
from distcheck.contract.autocheck_file import AutocheckState
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck import patches
from distcheck.rank.autocheck.async_reads import tensors_in, written_tensors
from distcheck.rank.autocheck.async_work import AsyncWatch
from distcheck.rank.autocheck.auto_records import AutoRecords, record_steps_from_env
from distcheck.rank.autocheck.checkpoint_load import LoadWatch
from distcheck.rank.autocheck.discovery import ModelWatch
from distcheck.rank.autocheck.dp_inputs import DPInputs
from distcheck.rank.autocheck.frozen_step import FrozenWatch
from distcheck.rank.autocheck.module_summaries import ModuleSummaries
from distcheck.rank.autocheck.nan_watch import NanWatch
from distcheck.rank.autocheck.pipeline_schedule import PipelineWatch
from distcheck.rank.autocheck.pipeline_schedule import patch_once as patch_pipelines
from distcheck.rank.autocheck.precision import PrecisionNotes
from distcheck.rank.autocheck.prewrap import PreWrap
from distcheck.rank.autocheck.replica_drift import ReplicaDrift, steps_from_env
from distcheck.rank.autocheck.tp_inputs import TPInputs

log = logging.getLogger("distcheck")

ENV_AUTOCHECK = env.AUTOCHECK


def enabled() -> bool:
    return os.environ.get(ENV_AUTOCHECK, "1").strip().lower() not in ("0", "false", "no", "off")


def _torch_step_frame() -> Any:
    """The innermost frame of torch.optim's code on this thread's stack: the step wrapper that calls the hooks."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/optim/" not in frame.f_code.co_filename.replace("\\", "/"):
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


def current() -> AutoCheck | None:
    return patches.active


def _emit(findings: list[Finding]) -> None:
    from distcheck.rank import sink

    sink.emit(findings)


def on_async(works: list[Any], op: str, args: tuple, kwargs: dict, site: Any) -> None:
    """The tracer's hook for a Work the user's line got back (rank/tracer.py ``on_async``)."""
    check = current()
    if check is not None:
        import torch

        check.async_work.issued(works, op, tensors_in(args, kwargs, torch.Tensor), site,
                                written_tensors(op, args, kwargs, torch.Tensor))


READ_WATCH_STEPS = 3  # optimizer steps in which ops are watched for reading what an async collective still writes


class AutoCheck:
    """The zero-code checks of one run (or one pytest test) in this rank: the hooks' events go to the jobs."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, emit: bool) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.opt_steps: dict[int, int] = {}  # id(optimizer) -> steps taken
        self._stepping: Any = None  # the optimizer whose step() is running (the outermost one)
        self._nested = 0  # inner step() calls running inside it
        self._step_frame: Any = None  # torch's frame of the outermost step()
        self.backwards = 0
        self.optimizers = 0
        self.models = ModelWatch(self, self.out_dir, rank, emit)
        self.nan = NanWatch(self)
        self.records = AutoRecords(self)
        self.drift = ReplicaDrift(self)
        self.prewrap = PreWrap(self)
        self.precision = PrecisionNotes()
        self.frozen = FrozenWatch(self, steps_from_env())
        self.module_summaries = ModuleSummaries(self, enabled=bool(record_steps_from_env()))
        self.models.on_watch.append(self.nan.forget_names)
        self.async_work = AsyncWatch(rank, _emit)
        self.checkpoints = LoadWatch(rank, _emit)
        self.tp_inputs = TPInputs(rank, _emit)
        self.dp_inputs = DPInputs(self)
        self.pipeline = PipelineWatch(self)

    @property
    def active(self) -> bool:
        return patches.active is self

    # -- events from the hooks -------------------------------------------------------------------------------------
    def watch(self, module: Any) -> None:
        self.models.watch(module)
        self.precision.note_module(module)

    def on_backward(self, loss: Any) -> None:
        self.backwards += 1
        self.drift.on_backward()
        self.records.on_backward(loss)
        self.nan.on_backward(loss)

    def after_backward(self) -> None:
        self.nan.after_backward()
        if not self.optimizers:  # without an optimizer the first step ends with the first backward()
            self.module_summaries.finish_step()

    def on_optimizer_step(self, optimizer: Any) -> None:
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
        self.models.on_first_step()  # a model whose own forward never ran (model.module(x)) is checked here
        self.async_work.on_optimizer_step(optimizer)
        step = self.opt_steps.get(id(optimizer), 0)
        self.opt_steps[id(optimizer)] = step + 1
        self.nan.on_optimizer_step(optimizer, step)

    def on_optimizer_step_done(self, optimizer: Any) -> None:
        if self._nested:
            self._nested -= 1
            return
        if self._stepping is not optimizer:  # a step whose pre-hook ran before the check was installed
            return
        self._stepping = None
        step = self.opt_steps.get(id(optimizer), 1) - 1
        # After the step, not before: a closure (LBFGS, Lightning) computes the gradients inside it.
        self.frozen.on_optimizer_step(optimizer, step)
        if self.frozen.rows and self.frozen.rows[-1]["step"] == step:  # this step's row: was it built too early?
            self.prewrap.replaced.explain(self.frozen.rows[-1], optimizer)
        self.records.on_optimizer_step_done(optimizer)
        self.drift.on_optimizer_step_done(step)
        self.module_summaries.finish_step()
        if step + 1 >= READ_WATCH_STEPS:
            self.async_work.stop_watching_reads()

    # -- results --------------------------------------------------------------------------------------------------
    @property
    def findings(self) -> list[Finding]:
        return self.models.findings

    @property
    def model_checks(self) -> list[dict[str, Any]]:
        return self.models.model_checks

    @property
    def auto_records(self) -> int:
        return self.records.count

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

    def state(self) -> dict[str, Any]:
        return AutocheckState(
            self.rank, self.models.model_checks, self.steps_done, self.counter, self.backwards,
            self.nan.first_bad.to_json() if self.nan.first_bad else None, self.nan.seconds, self.records.count,
            self.drift.state(), self.module_summaries.state(), self.prewrap.state(), self.frozen.state(),
            self.models.warnings, self.precision.state(), self.pipeline.state()).to_json()

    def write_state(self) -> None:
        exc = autocheck_file.write(self.out_dir, self.rank, self.state())
        if exc is not None:  # a full disk: the report says what is missing (the trace header keeps it)
            from distcheck.contract.trace_slots import LOST_AUTOCHECK
            from distcheck.rank.tracer import note_lost

            note_lost(LOST_AUTOCHECK, exc)
            log.warning("distcheck: cannot write %s: %s", autocheck_file.path(self.out_dir, self.rank).name,
                        exc.strerror or exc)

    def finish(self) -> None:
        self.async_work.finish()
        self.prewrap.finish()
        self.nan.finish(self.steps_done, self.counter)
        self.write_state()

    def stop_watching(self) -> None:
        self.records.stop_naming()
        self.models.stop()
        self.module_summaries.finish_step()


def install(out_dir: str | os.PathLike, rank: int, emit: bool = False) -> AutoCheck | None:
    """Activate the zero-code checks for this process (None when DISTCHECK_AUTOCHECK=0)."""
    if not enabled():
        return None
    patches.patch_once()
    patch_pipelines()
    patches.active = AutoCheck(out_dir, rank, emit)
    from distcheck.rank import tracer

    if tracer.current() is not None:
        tracer.current().on_async = on_async
    return patches.active


def uninstall() -> None:
    if patches.active is not None:
        patches.active.stop_watching()
    patches.active = None


# -- the pytest marker's pool: one verdict per test -------------------------------------------------------------

def test_findings(check: AutoCheck, key: str, timeout: float = 2.0) -> list[Finding]:
    """After a test body: rank 0 gets every rank's first-NaN record (side channel) and returns all findings.

    The other ranks only publish and never wait, so a rank stuck elsewhere cannot stall them; rank 0 waits at most
    ``timeout`` per missing rank and merges what it got.
    """
    from distcheck.analysis.bad_values import fold_first_bad, merge_states
    from distcheck.analysis.pipeline_schedule import pipeline_findings, schedules_from_states
    from distcheck.errors import ChannelTimeout
    from distcheck.rank.runtime import current_channel

    check.finish()
    channel = current_channel()
    states = {check.rank: check.state()}
    if channel is not None:
        channel.put(f"autocheck/{key}/{check.rank}", states[check.rank])
        if check.rank != 0:
            return []
        # A test that ran no model, no backward and no pipeline here (plain collectives) has nothing to merge: do
        # not wait.
        quiet = not check.model_checks and not check.backwards and not states[check.rank].get("pipeline")
        for r in ([] if quiet else range(1, channel.world_size)):
            try:
                states[r] = channel.get(f"autocheck/{key}/{r}", r, timeout=timeout)
            except ChannelTimeout:
                log.warning("distcheck: rank %s sent no automatic-check record for this test", r)
    findings, _ = merge_states(states)
    # Stages whose schedules disagree: the one finding says which values differ and where, beside torch's error.
    findings += pipeline_findings(schedules_from_states(states))
    return fold_first_bad(list(check.findings) + findings)


def failure_text(findings: list[Finding]) -> str:
    from distcheck.contract.findings import headline

    lines = ["distcheck's automatic checks found what the test's asserts did not (DISTCHECK_AUTOCHECK=0 turns "
             "them off):"]
    lines += ["  " + headline(f) for f in findings]
    return "\n".join(lines)
