"""Where the first NaN/Inf came from (rank/autocheck/nan_origin.py): the batch, the first module and its line.

    pytest tests/unit/test_nan_origin.py
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distcheck.rank.autocheck.nan_origin import HeldInputs, locate, replay_refused


def _line(text: str) -> int:
    return next(i for i, line in enumerate(open(__file__).read().splitlines(), 1) if text in line)


class Gate(nn.Module):
    def forward(self, x):
        return x * torch.exp(x)  # OVERFLOW


class Masked(nn.Module):
    """Attention-style: a -inf mask on purpose, then a softmax that makes it finite again."""

    def forward(self, x):
        mask = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool).triu(1)
        scores = (x.unsqueeze(-1) * x.unsqueeze(-2)).masked_fill(mask, float("-inf"))
        return (scores.softmax(-1) * x.unsqueeze(-2)).sum(-1)


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h = torch.log(h - 1e3)  # OWN CODE
        return self.b(h)


def _held(model, *inputs):
    held = HeldInputs()
    held.watch(model)
    model(*inputs)
    return held


def test_a_non_finite_batch_is_the_origin_with_its_index():
    model = nn.Sequential(nn.Linear(4, 4), Gate())
    x = torch.zeros(3, 4)
    x[2, 1] = float("nan")
    held = _held(model, x)
    assert locate(held.forwards) == {"where": "batch", "model": "Sequential", "input": "args[0]", "value": "nan",
                                     "index": [2, 1]}


def test_the_first_module_whose_output_overflows_is_named_with_its_op_and_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Masked(), Gate(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(30.0)
    held = _held(model, torch.ones(2, 4))
    origin = locate(held.forwards)
    assert origin["where"] == "module" and origin["module"] == "2" and origin["type"] == "Gate", origin
    assert origin["op"] == "aten.exp" and origin["value"] == "inf"
    assert origin["file"] == __file__ and origin["line"] == _line("# OVERFLOW")


def test_a_nan_made_by_the_parents_own_code_names_the_parent_and_the_child_it_fed():
    model = nn.Sequential(Parent())
    held = _held(model, torch.ones(2, 4))
    origin = locate(held.forwards)
    assert origin["module"] == "0" and origin["before"] == "before it called '0.b'", origin
    assert origin["op"] == "aten.log" and origin["line"] == _line("# OWN CODE")


def test_finite_outputs_point_to_the_loss_and_the_rerun_leaves_buffers_and_rng_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    held = _held(model, torch.randn(8, 4))
    before = model[1].running_mean.clone(), model[1].num_batches_tracked.clone()
    rng = torch.random.get_rng_state()
    assert locate(held.forwards)["where"] == "loss"
    assert torch.equal(model[1].running_mean, before[0]) and torch.equal(model[1].num_batches_tracked, before[1])
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_no_other_forward_hook_sees_the_rerun():
    from torch.nn.modules.module import register_module_forward_hook

    model = nn.Sequential(nn.Linear(4, 4), Gate())
    with torch.no_grad():
        model[0].weight.fill_(100.0)
    held = _held(model, torch.ones(1, 4))
    seen = []
    mine = model[1].register_forward_hook(lambda m, a, o: seen.append("module"))
    everyone = register_module_forward_hook(lambda m, a, o: seen.append("global"))
    try:
        assert locate(held.forwards)["module"] == "1"
        assert seen == [] and len(held.forwards) == 1  # nor the held inputs' own pre-hook
        model(torch.ones(1, 4))
        assert "module" in seen and "global" in seen  # and every hook is back
    finally:
        mine.remove()
        everyone.remove()


def test_the_inputs_of_ddps_inner_module_are_held_and_cleared_each_step():
    inner = nn.Linear(4, 4)
    wrapper = nn.Module()
    wrapper.module = inner  # what DDP and FSDP1 hold
    held = HeldInputs()
    held.watch(wrapper)
    inner(torch.ones(1, 4))  # model.module(x): the bypass still reaches the inner module
    assert len(held.forwards) == 1 and held.forwards[0].module is inner
    held.clear()
    assert not held.forwards
    # the last 16 are kept: forwards before the first step (a sanity evaluation) do not crowd out the step's own
    for i in range(20):
        inner(torch.full((1, 4), float(i)))
    assert len(held.forwards) == 16 and held.forwards[-1].args[0][0, 0] == 19
    held.stop()
    inner(torch.ones(1, 4))
    assert not held.forwards


def test_a_model_whose_forward_needs_the_other_ranks_is_not_rerun():
    assert "SyncBatchNorm" in replay_refused(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))
    assert replay_refused(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))) is None


def test_a_collective_inside_the_rerun_stops_it_before_anything_is_sent():
    import torch.distributed as dist

    class Reduces(nn.Module):
        def forward(self, x):
            dist.all_reduce(x)
            return x

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        held = _held(nn.Sequential(Reduces()), torch.ones(2))
        origin = locate(held.forwards)
    finally:
        dist.destroy_process_group()
    assert origin["where"] == "unknown" and "collective cannot be re-run" in origin["why"], origin


def test_the_origin_reads_as_one_clause_and_gives_the_findings_line():
    from distcheck.analysis.nan_origin import origin_site, origin_text

    module = {"where": "module", "module": "gate", "type": "Gate", "op": "aten.exp", "value": "inf",
              "file": "/w/train.py", "line": 24}
    assert origin_text(module, 1) == ("on rank 1 the first module in forward order whose output is not finite (its "
                                      "inputs were) is 'gate' (Gate): its torch.exp at train.py:24 made inf from "
                                      "finite values")
    assert origin_site(module) == ("/w/train.py", 24)
    batch = {"where": "batch", "model": "Net", "input": "args[0]", "value": "nan", "index": [3, 5]}
    assert origin_text(batch, 1) == "on rank 1 the batch itself already holds nan: input args[0] of Net.forward " \
                                    "at index [3, 5]"
    assert origin_site(batch) is None and origin_text(None, 0) is None
    assert "not known (the model is sharded" in origin_text({"where": "unknown", "why": "the model is sharded"}, 0)
