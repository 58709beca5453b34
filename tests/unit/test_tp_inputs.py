"""Which modules of a TP plan take replicated inputs (rank/autocheck/tp_inputs.py): only those are compared."""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from distcheck.rank.autocheck.tp_inputs import plan_modules, replicated_input


def test_replicated_input_follows_each_styles_input_layouts():
    assert replicated_input(ColwiseParallel())  # its default: Replicate()
    assert not replicated_input(ColwiseParallel(input_layouts=Shard(0)))  # sequence-parallel input: a shard
    assert not replicated_input(RowwiseParallel())  # Shard(-1): each rank's part
    assert not replicated_input(SequenceParallel())
    assert replicated_input(PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)))
    assert not replicated_input(PrepareModuleInput(input_layouts=(Shard(1), None),
                                                   desired_input_layouts=(Replicate(), None)))


def test_plan_modules_expand_wildcards_in_plan_order():
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"wq": nn.Linear(2, 2)}) for _ in range(2)]),
                           "out": nn.Linear(2, 2)})
    col, row = ColwiseParallel(), RowwiseParallel()
    found = plan_modules(model, {"layers.*.wq": col, "out": row})
    assert [(n, s) for n, _, s in found] == [("layers.0.wq", col), ("layers.1.wq", col), ("out", row)]
    assert plan_modules(model.out, col) == [("", model.out, col)]
