"""Zero-code checks in a rank: fourteen jobs behind one switch (DISTCHECK_AUTOCHECK=0 turns them off).

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
* checkpoint_load.py: a ``load_state_dict(strict=False)`` that loaded nothing, or missed keys under a wrapper's
  prefix (``bad_values``); dcp_roundtrip.py: the same for a DCP load with ``allow_partial_load``, and a DCP resume
  whose loaded values are not what the same run saved, or that landed in tensors the model no longer uses;
* tp_inputs.py: the ranks of a TP group feeding a replicated-input layer different batches (``tensor_divergence``);
* dp_inputs.py: the data-parallel ranks of DDP, or of FSDP2's mesh (per dp group), all fed the same first batch
  (a warning naming the DataLoader or the seed);
* pipeline_schedule.py: each pipeline stage's schedule (class, n_microbatches, stages, what its first step splits),
  written before torch runs it; the supervisor compares the stages (``collective_mismatch``);

Each check is one class in its own module, ``Cls(core)`` with a ``name``, ``on_<event>`` handlers, ``state()`` and
``finish()`` (protocol.py); registry.py lists them, in the order events reach them. core.py's :class:`AutoCheck`
builds them, dispatches the events and writes ``autocheck-rank<R>.json`` (``{check name: state}`` beside the run's
rank, steps, counter and backward() count; its format: contract/autocheck_file.py). patches.py holds the hooks
(fully_shard, DDP and its no_sync(), parallelize_module, optimizers, ``backward`` ...), which fire events and name
no check. The report, compare and the pytest pool turn the states into findings through one table,
analysis/check_table.py.

To add a zero-code check, touch:
  1. rank/autocheck/<check>.py: a ``Check`` subclass with its ``name``, its ``on_<event>`` handlers (a new event:
     its line in protocol.EVENTS, and the hook that fires it in patches.py), ``state()``, ``finish()``;
  2. rank/autocheck/registry.py: its line in CHECKS;
  3. analysis/<check>.py (or an existing analysis module): a pure function from ``{rank: its state}`` and the
     run-level fields to a ``Verdict`` (findings, checks, notes), and its line in analysis/check_table.TABLE
     (nothing when its findings leave through ``core.emit`` at once);
  4. its tests (tests/unit/, and a fixture under fixtures/ with an integration test) and its docs (this list,
     docs/checks.md).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from distcheck.contract import env
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck import patches
from distcheck.rank.autocheck.core import AutoCheck
from distcheck.rank.autocheck.pipeline_schedule import patch_once as patch_pipelines

log = logging.getLogger("distcheck")

ENV_AUTOCHECK = env.AUTOCHECK


def enabled() -> bool:
    return os.environ.get(ENV_AUTOCHECK, "1").strip().lower() not in ("0", "false", "no", "off")


def current() -> AutoCheck | None:
    return patches.active


def on_async(works: list[Any], op: str, args: tuple, kwargs: dict, site: Any) -> None:
    """The tracer's hook for a Work the user's line got back (rank/tracer.py ``on_async``)."""
    check = current()
    if check is not None:
        check.fire("async_collective", works, op, args, kwargs, site)


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
    """After a test body: rank 0 gets every rank's automatic-check state (side channel) and returns all findings.

    The other ranks only publish and never wait, so a rank stuck elsewhere cannot stall them; rank 0 waits at most
    ``timeout`` per missing rank and merges what it got.
    """
    from distcheck.analysis.bad_values import fold_first_bad
    from distcheck.analysis.check_table import judge
    from distcheck.analysis.shared_files import several_writers
    from distcheck.contract import saves_file
    from distcheck.errors import ChannelTimeout
    from distcheck.rank import save_watch
    from distcheck.rank.runtime import current_channel

    check.finish()
    channel = current_channel()
    states = {check.rank: check.state()}
    if channel is not None:
        channel.put(f"autocheck/{key}/{check.rank}", states[check.rank])
        if check.rank != 0:
            return []
        # A test that checked no model, ran no backward and built no pipeline here (plain collectives) has nothing
        # to merge: do not wait.
        mine = states[check.rank]
        quiet = not check.backwards and not mine.get("models") and not mine.get("pipeline") and not save_watch.noted()
        for r in ([] if quiet else range(1, channel.world_size)):
            try:
                states[r] = channel.get(f"autocheck/{key}/{r}", r, timeout=timeout)
            except ChannelTimeout:
                log.warning("distcheck: rank %s sent no automatic-check record for this test", r)
    # The same table as the report's: the first NaN/Inf, frozen steps, drifted replicas, and pipeline stages whose
    # schedules disagree (the one finding says which values differ and where, beside torch's error).
    # One file that several ranks saved with different contents (rank/save_watch.py, as under `distcheck run`).
    shared = several_writers(saves_file.read_all(key)) if channel is None or check.rank == 0 else []
    return fold_first_bad(list(check.findings) + judge(states).findings + shared)


def failure_text(findings: list[Finding]) -> str:
    """The failed test's text: its findings as report.txt lists them (contract/report.finding_lines)."""
    from distcheck.contract.report import finding_lines

    lines = ["distcheck's automatic checks found what the test's asserts did not (DISTCHECK_AUTOCHECK=0 turns "
             "them off):"]
    return "\n".join(lines + finding_lines(findings, None))
