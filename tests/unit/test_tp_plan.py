"""``--parallel tp`` on user models: a plan the model defines and that fits it, or exit 2 saying what to define; a
parallelize step that leaves nothing parallel is never a PASS (torch's fake process group, no process launched)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from distcheck.rank.checks.parallelize import apply
from distcheck.errors import UsageError


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_q = nn.Linear(8, 8)
        self.attn_o = nn.Linear(8, 8)


class Unplanned(nn.Module):
    """A `blocks` list like the built-in model's, with other layer names and no distcheck_tp_plan."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


class Planned(nn.Sequential):
    def __init__(self, plan):
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self._plan = plan

    def distcheck_tp_plan(self, mesh):
        return self._plan


def styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


@pytest.mark.parametrize("model", [Unplanned(), nn.Sequential(nn.Linear(4, 4))], ids=["blocks", "sequential"])
def test_a_model_without_a_plan_is_bad_input_saying_what_to_define(fake_world, model):
    with pytest.raises(UsageError, match=r"has no tensor-parallel plan: define a method distcheck_tp_plan\(self, mesh\)"):
        apply(model, "tp", torch.device("cpu"), 2)


def test_a_plan_key_that_names_no_module_is_bad_input(fake_world):
    colwise, rowwise = styles()
    model = Planned({"0": colwise(), "blocks.*.attn.q": rowwise()})
    with pytest.raises(UsageError, match=r"plan key 'blocks\.\*\.attn\.q' names no module of Planned"):
        apply(model, "tp", torch.device("cpu"), 2)


def test_a_plan_that_parallelizes_nothing_is_never_a_pass(fake_world):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    model = Planned({"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))})
    with pytest.raises(UsageError, match="left every parameter of Planned a plain tensor"):
        apply(model, "tp", torch.device("cpu"), 2)


def test_a_plan_that_fits_is_applied(fake_world):
    colwise, rowwise = styles()
    model = Planned({"0": colwise(), "2": rowwise()})
    parallel = apply(model, "tp", torch.device("cpu"), 2)
    assert parallel.mode == "tp" and not parallel.splits_batch
    assert {n for n, p in model.named_parameters() if hasattr(p, "placements")} == {
        "0.weight", "0.bias", "2.weight", "2.bias"}
