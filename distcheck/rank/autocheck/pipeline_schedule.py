"""Each pipeline stage's schedule, recorded before torch runs it: the stages of one pipeline must agree on it.

    python -m distcheck run --nproc 2 -- fixtures/pp_microbatch_mismatch.py

``torch.distributed.pipelining`` never checks that the ranks of a pipeline built the same schedule: a stage whose
``n_microbatches`` (or schedule class, or ``num_stages``) differs from its peers' fails deep inside shape inference
("The size of tensor a (4) must match the size of tensor b (8)"), or waits for a microbatch nobody sends. Here the
base classes of every schedule (``PipelineScheduleSingle``, ``PipelineScheduleMulti``) are patched when the script
imports pipelining: at construction this rank notes the schedule's class, ``n_microbatches``, its stage indices,
``num_stages``, the pipeline's ranks and the user's line; at the first ``step()`` (and ``eval()``), before torch
splits anything, the shapes of what the stage splits into microbatches (the batch on the first stage, the targets on
the last) and the step's line. Each note rewrites ``autocheck-rank<R>.json`` at once (contract/autocheck_file.py,
atomic), so it survives a rank that raises or aborts inside ``step()``; the comparison across ranks is pure
(analysis/pipeline_schedule.py), in the report.

What passes between the stages is noted too, for every stage, middle ones included: the microbatch shapes and
dtypes a ``PipelineStage`` expects as input (its ``input_args``: torch allocates its receive buffers from them in
static mode and validates against them otherwise) and declares as output (``output_args``), with the line that
built it, and what it really sends on, noted before it is sent: the metadata shape inference passes to the next
stage (before any microbatch), or the outputs of its first ``forward_one_chunk`` (static shapes, no inference). A
stage whose expected input is not what its predecessor sends is then named with both stages' values and lines.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from distcheck.rank.autocheck.protocol import Check

log = logging.getLogger("distcheck")

MODULE = "torch.distributed.pipelining.schedules"
STAGE_MODULE = "torch.distributed.pipelining.stage"  # imported by MODULE: patched with it
ATTR = "_distcheck_pp"  # set on a schedule: the index of its record on this rank
STAGE_SITE = "_distcheck_pp_site"  # set on a PipelineStage: the user's line that built it
STAGE_IO = "_distcheck_pp_io"  # set on a stage of a recorded schedule: its entry of the record's "io"
LIMIT = 16  # schedules recorded per rank (a script that rebuilds its schedule in a loop must not grow the file)

_patched = False


def _group_ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else []
    return list(stages)


def _spec_dim(spec: Any) -> int | None:
    """The dim a chunk spec splits (TensorChunkSpec), 0 for torch's default (no spec), None for one that does not
    split (``_Replicate``)."""
    if spec is None:
        return 0
    dim = getattr(spec, "split_dim", None)
    return int(dim) if isinstance(dim, int) else None


def _tensor_entry(name: str, value: Any, spec: Any, Tensor: type) -> dict[str, Any] | None:
    if not isinstance(value, Tensor):
        return None
    return {"name": name, "shape": [int(s) for s in value.shape], "dim": _spec_dim(spec),
            "dtype": str(value.dtype).replace("torch.", "")}


def split_inputs(schedule: Any, args: tuple, kwargs: dict, Tensor: type) -> list[dict[str, Any]]:
    """The tensors ``step()`` splits into microbatches, with their shapes and the dim each is split along."""
    arg_specs = getattr(schedule, "_args_chunk_spec", None) or ()
    kwarg_specs = getattr(schedule, "_kwargs_chunk_spec", None) or {}
    out = []
    for i, value in enumerate(args):
        entry = _tensor_entry(f"arg {i}", value, arg_specs[i] if i < len(arg_specs) else None, Tensor)
        if entry is not None:
            out.append(entry)
    for key, value in kwargs.items():
        entry = _tensor_entry(key, value, kwarg_specs.get(key) if isinstance(kwarg_specs, dict) else None, Tensor)
        if entry is not None:
            out.append(entry)
    return out


def _metas(metas: Any) -> list[dict[str, Any]] | None:
    """[{"shape", "dtype"}] of torch's tensor metadata (a stage's ``_user_meta.inputs``: None when not given)."""
    if metas is None:
        return None
    return [{"shape": [int(x) for x in m.shape], "dtype": str(m.dtype).replace("torch.", "")} if m is not None
            else None for m in metas]


def _io_entry(stage: Any) -> dict[str, Any]:
    """What a stage expects and declares: the microbatch metadata of its input_args and output_args (None where
    not given: torch infers them at the first step), and the line that built it."""
    user = getattr(stage, "_user_meta", None)
    site = getattr(stage, STAGE_SITE, None)
    return {"stage": int(stage.stage_index), "inputs": _metas(getattr(user, "inputs", None)),
            "outputs": _metas(getattr(user, "outputs", None)),
            "file": getattr(site, "file", None), "line": getattr(site, "line", None)}


class PipelineWatch(Check):
    """The schedules this rank built, as plain JSON records (the ``pipeline`` key of its autocheck file)."""

    name = "pipeline"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # write_state() persists the records at once
        self.records: list[dict[str, Any]] = []

    def state(self) -> list[dict[str, Any]]:
        return self.records

    def on_pipeline_built(self, schedule: Any, site: Any) -> None:
        if hasattr(schedule, ATTR) or len(self.records) >= LIMIT:
            return
        stages = _stages(schedule)
        if not stages:
            return
        first = stages[0]
        record = {"index": len(self.records), "schedule": type(schedule).__name__,
                  "n_microbatches": int(schedule._n_microbatches),
                  "stages": [int(s.stage_index) for s in stages],
                  "num_stages": int(getattr(schedule, "_num_stages", first.num_stages)),
                  "group": _group_ranks(getattr(first, "group", None)),
                  "file": site.file, "line": site.line, "stepped": False,
                  "io": [_io_entry(s) for s in stages]}
        setattr(schedule, ATTR, record["index"])
        for position, stage in enumerate(stages):
            if not hasattr(stage, STAGE_IO):
                setattr(stage, STAGE_IO, (record["index"], position))
        self.records.append(record)
        self.core.write_state()

    def on_pipeline_sending(self, stage: Any, metas: Any) -> None:
        """What a stage sends on, before it is sent: the metadata shape inference passes to the next stage (torch
        sends it before any microbatch), or its first forward's outputs (static shapes: no inference)."""
        index, position = getattr(stage, STAGE_IO)
        entry = self.records[index]["io"][position]
        if "sent" in entry or stage.is_last:
            return
        entry["sent"] = _metas(metas)
        self.core.write_state()  # before the send: a peer that fails on it leaves this rank's side known

    def on_pipeline_forwarded(self, stage: Any, output: Any) -> None:
        import torch

        outputs = output if isinstance(output, (tuple, list)) else (output,)
        self.on_pipeline_sending(stage, [t if isinstance(t, torch.Tensor) else None for t in outputs])

    def on_pipeline_step(self, schedule: Any, args: tuple, kwargs: dict, target: Any, site: Any) -> None:
        index = getattr(schedule, ATTR, None)
        if index is None or self.records[index]["stepped"]:
            return
        import torch

        from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC

        record = self.records[index]
        record.update(stepped=True, step_file=site.file, step_line=site.line,
                      inputs=split_inputs(schedule, args, kwargs, torch.Tensor),
                      target=_tensor_entry("target", target, _TARGET_CHUNK_SPEC, torch.Tensor))
        self.core.write_state()  # before torch runs the step: a rank that dies inside it leaves this


def _fire(event: str, *args: Any) -> None:
    """The event for the active check (which never lets a failure reach the user's pipeline)."""
    from distcheck.rank.autocheck import patches

    check = patches.current()
    if check is not None:
        check.fire(event, *args)


def _wrap(base: type) -> None:
    from distcheck.rank.usersite import caller_site

    init, step = base.__init__, base.step

    @functools.wraps(init)
    def init_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        site = caller_site()
        _fire("pipeline_built", self, site)

    @functools.wraps(step)
    def step_wrapper(self: Any, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        if getattr(self, ATTR, None) is not None:
            site = caller_site()
            # step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs): what is left
            # in kwargs besides those is the model's keyword inputs.
            model_kwargs = {k: v for k, v in kwargs.items() if k not in ("losses", "return_outputs", "loss_kwargs")}
            _fire("pipeline_step", self, args, model_kwargs, target, site)
        return step(self, *args, target=target, **kwargs)

    base.__init__ = init_wrapper
    base.step = step_wrapper


def _wrap_stage(stage_module: Any) -> None:
    """The line that built each ``PipelineStage``, and each recorded stage's first forward output."""
    from distcheck.rank.usersite import caller_site

    cls = getattr(stage_module, "PipelineStage", None)
    base = getattr(stage_module, "_PipelineStageBase", None)
    if cls is not None:
        init = cls.__init__

        @functools.wraps(init)
        def init_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            try:
                setattr(self, STAGE_SITE, caller_site())
            except Exception as exc:
                log.debug("distcheck: could not note a pipeline stage's line: %s", exc)

        cls.__init__ = init_wrapper
        send_meta = getattr(cls, "_send_meta", None)
        if send_meta is not None:
            @functools.wraps(send_meta)
            def send_meta_wrapper(self: Any, meta: Any, dst_stage: int, *args: Any, **kwargs: Any) -> Any:
                metas = getattr(meta, "forward_metas", None)  # forward inference's (not the backward's grads)
                if metas is not None and getattr(self, STAGE_IO, None) is not None:
                    _fire("pipeline_sending", self, metas)
                return send_meta(self, meta, dst_stage, *args, **kwargs)

            cls._send_meta = send_meta_wrapper
    if base is not None:
        forward = base.forward_one_chunk

        @functools.wraps(forward)
        def forward_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = forward(self, *args, **kwargs)
            if getattr(self, STAGE_IO, None) is not None:  # a stage of a recorded schedule: one look per chunk
                _fire("pipeline_forwarded", self, output)
            return output

        base.forward_one_chunk = forward_wrapper


def _patch(module: Any) -> None:
    # Every schedule class derives from one of these two, and none overrides their __init__ without calling it
    # or their step() at all: two classes cover GPipe, 1F1B, the interleaved and zero-bubble schedules alike.
    for base in (module.PipelineScheduleSingle, module.PipelineScheduleMulti):
        _wrap(base)
    stage_module = sys.modules.get(STAGE_MODULE)
    if stage_module is not None:  # the schedules import it: it is there
        _wrap_stage(stage_module)


def patch_once() -> None:
    """Patch the schedules now if the script imported pipelining already, else when it does (it costs an import
    that most scripts never make)."""
    global _patched
    if _patched:
        return
    _patched = True
    if MODULE in sys.modules:
        _patch(sys.modules[MODULE])
        return
    from distcheck.rank.autocheck.patches import _PatchOnImport

    sys.meta_path.insert(0, _PatchOnImport({MODULE: _patch}))
