"""What every zero-code check in a rank is: a name, the events it listens to, its state, its end.

    python -m distcheck run --nproc 2 -- train.py      # every rank builds each check of registry.CHECKS once

A check is a class ``Cls(core)`` (``core``: the rank's :class:`~distcheck.rank.autocheck.core.AutoCheck`, which
gives it the rank, the report directory, the step counters, the watched models and the ways out: ``keep`` and
``emit`` for findings, ``write_state`` for its state). It listens to an event by defining ``on_<event>``, one of
:data:`EVENTS`; the core binds those methods once, per event, into a tuple, so that dispatching an event is a dict
lookup and a loop of calls. ``state()`` is what the check writes into ``autocheck-rank<R>.json`` under its
``name`` (plain JSON; an empty one, None included, is left out); the report reads it through its entry of
analysis/check_table.py. ``finish()`` runs once when the script ends.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

# Every event a hook (patches.py, pipeline_schedule.py, dcp_roundtrip.py, the tracer) or the core fires, with its
# arguments. A handler named for anything else is a typo: the core refuses it at construction.
EVENTS: dict[str, str] = {
    # parallelizing calls (fully_shard, DDP, FSDP1, parallelize_module, distribute_module): how is the call's name
    "wrap_call": "(how, module, ranks, values): before torch parallelizes module over ranks (None: every rank); "
                 "values False: the call itself makes the values equal (DDP's broadcast), only structure counts",
    "wrap_begin": "(modules): the outermost parallelizing call is about to run on modules",
    "wrap_returned": "(): the outermost parallelizing call returned or raised (core.inside_wrap's end)",
    "wrap_end": "(call, modules, site): the outermost call returned modules; call is its label, site its line",
    "model_wrapped": "(module, how): a model a parallelizing call returned (or the module DDP/FSDP1 wrap)",
    "plan": "(module, plan, ranks, src_data_rank): parallelize_module's plan, before it runs",
    "distribute_tensor": "(tensor, ranks, placements, src_data_rank): a distribute_tensor call",
    # precision
    "mp_policy": "(policy, label): FSDP2's MixedPrecisionPolicy or FSDP1's MixedPrecision (None: none given)",
    "comm_hook": "(hook): DistributedDataParallel.register_comm_hook",
    "autocast": "(ctx): torch.autocast entered",
    # data-parallel training
    "gradient_sync": "(on): FSDPModule.set_requires_gradient_sync",
    "no_sync_enter": "(): DDP's no_sync() entered", "no_sync_exit": "(): DDP's no_sync() left",
    "loader_built": "(loader): a DataLoader constructed",
    "seed_set": "(seed): torch.manual_seed",
    # the training step
    "optimizer_built": "(optimizer): an Optimizer constructed (core.optimizers counts them first)",
    "optimizer_step": "(optimizer, step): the outermost optimizer.step() begins; step: its 0-based count",
    "optimizer_step_done": "(optimizer, step): that step ended",
    "backward": "(loss): Tensor.backward called (core.backwards counts it first)",
    "after_backward": "(): that backward() returned",
    "first_forward": "(ctx): a watched model's first forward, before its check (discovery.FirstForward)",
    "model_checked": "(root): the first-forward check of root is done",
    # collectives and checkpoints
    "async_collective": "(works, op, args, kwargs, site): a Work the user's line got back (the tracer's on_async)",
    "work_waited": "(work): Work.wait / is_completed() True / get_future",
    "load_state_dict": "(module, result, site): nn.Module.load_state_dict(strict=False) returned result",
    "dcp_save_plan": "(state_dict, checkpoint_id, site): DCP's save planner set up",
    "dcp_load_plan": "(planner, site): DCP's load planner made its local plan",
    "dcp_load_start": "(): dcp.load begins", "dcp_load_end": "(completed, ranks): dcp.load ended",
    "dcp_step": "(optimizer): any optimizer.step(), nested ones included (once DCP is imported)",
    # pipelines (torch.distributed.pipelining)
    "pipeline_built": "(schedule, site): a schedule constructed",
    "pipeline_step": "(schedule, args, kwargs, target, site): a recorded schedule's step(), before torch runs it",
    "pipeline_sending": "(stage, metas): what a stage is about to send on (shape inference's metadata)",
    "pipeline_forwarded": "(stage, output): a recorded stage's forward_one_chunk returned output",
    "uninstalled": "(): the checks stop (the end of a pytest test, or of the run)",
}

PREFIX = "on_"


class Check:
    """The base of every zero-code check: subclasses set ``name`` and define ``on_<event>`` handlers."""

    name: ClassVar[str]

    def __init__(self, core: Any) -> None:
        self.core = core

    def state(self) -> Any:
        """This check's part of ``autocheck-rank<R>.json`` (plain JSON); empty: nothing is written."""
        return None

    def finish(self) -> None:
        """The script ended: report what only the end tells."""

    @classmethod
    def events(cls) -> tuple[str, ...]:
        """The events this check listens to: its ``on_<event>`` methods."""
        return listened(cls)


def listened(cls: type) -> tuple[str, ...]:
    """The events a class handles (a check, or the core itself, which counts steps before the checks hear them)."""
    return tuple(attr[len(PREFIX):] for attr in dir(cls) if attr.startswith(PREFIX) and callable(getattr(cls, attr)))


def handlers(listeners: Iterable[Any]) -> dict[str, tuple[Callable[..., None], ...]]:
    """``{event: (bound handler, ...)}`` in the listeners' order; an ``on_`` method for no known event raises."""
    out: dict[str, list[Callable[..., None]]] = {}
    for listener in listeners:
        for event in listened(type(listener)):
            if event not in EVENTS:
                raise TypeError(f"{type(listener).__name__}.{PREFIX}{event}: no such event (protocol.EVENTS)")
            out.setdefault(event, []).append(getattr(listener, PREFIX + event))
    return {event: tuple(bound) for event, bound in out.items()}
