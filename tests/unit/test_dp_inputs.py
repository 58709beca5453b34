"""The data-parallel same-batch warning (rank/autocheck/dp_inputs.py): which loaders split by rank, which ranks
must differ on a mesh, which groups fed the same batch, what the warning blames, and that nested FSDP2 modules
compare once, at the outermost.

    .venv/bin/python -m pytest -q tests/unit/test_dp_inputs.py
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distcheck.analysis.replicas import Entry, Fingerprint
from distcheck.rank.autocheck.dp_inputs import (DPInputs, _is_distributed, dp_groups, same_batch_groups,
                                                same_batch_note)
from distcheck.rank.usersite import Site


def test_a_loader_splits_by_rank_with_a_distributed_sampler_only():
    data = TensorDataset(torch.zeros(8, 2))
    plain = DataLoader(data, batch_size=2)
    split = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert not _is_distributed(plain.sampler) and not _is_distributed(plain.batch_sampler)
    assert _is_distributed(split.sampler) and _is_distributed(split.batch_sampler)


def test_the_warning_names_the_loader_else_the_seed():
    at = Site("/w/train.py", 40)
    note = same_batch_note([[0, 1]], at, Site("/w/train.py", 30), (0, Site("/w/train.py", 12)))
    assert note.kind == "same_batches" and note.ranks == [0, 1] and note.detail["loader"] == ["/w/train.py", 30]
    assert note.detail["groups"] == [[0, 1]]
    assert note.message.startswith("ranks 0-1 (data parallel) fed the same batch at their first forward at "
                                   "train.py:40: every rank trains on the same data, so 2 ranks do the work of one")
    assert "the DataLoader built at train.py:30 has no DistributedSampler: give it DistributedSampler(dataset) " \
        in note.message
    seeded = same_batch_note([[0, 1]], at, None, (0, Site("/w/train.py", 12)))
    assert "torch.manual_seed(0) at train.py:12" in seeded.message


def test_on_a_2d_mesh_the_warning_names_each_group_and_a_sampler_over_the_dp_dim():
    note = same_batch_note([[0, 2], [1, 3]], Site("/w/train.py", 40), Site("/w/train.py", 30), None, several=True)
    assert note.ranks == [0, 1, 2, 3] and note.detail["groups"] == [[0, 2], [1, 3]]
    assert note.message.startswith("ranks 0,2 and ranks 1,3 (data parallel: one group per position on the mesh's "
                                   "other dims, whose ranks rightly share a batch) fed the same batch at their "
                                   "first forward at train.py:40: the ranks of each group train on the same data, "
                                   "so 2 ranks do the work of one")
    assert "give it DistributedSampler(dataset, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank())" \
        in note.message
    seeded = same_batch_note([[0, 2]], Site("/w/train.py", 40), None, (7, Site("/w/train.py", 12)), several=True)
    assert "seed the data generator with the data-parallel rank" in seeded.message


@pytest.mark.parametrize("shape, ranks, dp, groups", [
    ((2,), [0, 1], [0, 1], [[0, 1]]),  # FSDP2 on a 1-D mesh: every rank
    ((2, 2), [0, 1, 2, 3], [0, 2], [[0, 2], [1, 3]]),  # (dp, tp): TP peers 0-1 and 2-3 share a batch
    ((2, 2), [0, 1, 2, 3], [1, 3], [[0, 2], [1, 3]]),  # the same, seen from the other TP position
    ((2, 2), [0, 1, 2, 3], [0, 1], [[0, 1], [2, 3]]),  # (tp, dp)
    ((2, 2), [0, 1, 2, 3], [0, 1, 2, 3], [[0, 1, 2, 3]]),  # HSDP: replicate and shard are both data-parallel
    ((2, 2, 2), list(range(8)), [0, 2, 4, 6], [[0, 2, 4, 6], [1, 3, 5, 7]]),  # (replicate, shard, tp)
    ((2, 2), [4, 5, 6, 7], [4, 6], [[4, 6], [5, 7]]),  # one pipeline stage's mesh: its ranks only
    ((2, 2), [0, 1, 2, 3], [0, 3], None),  # not a sub-grid of the mesh
    ((2, 2), [0, 1, 2, 3], [0, 5], None),  # not on the mesh
])
def test_the_data_parallel_groups_of_a_mesh(shape, ranks, dp, groups):
    assert dp_groups(shape, ranks, dp) == groups


def _entries(*values: int) -> list[Entry]:
    return [Entry(f"input {i}", "input", None, Fingerprint("torch.float32", (4,), (0, 4), (v,)))
            for i, v in enumerate(values)]


def test_the_groups_that_fed_the_same_batch():
    same = {0: _entries(1, 2), 2: _entries(1, 2), 1: _entries(1, 2), 3: _entries(1, 5)}
    assert same_batch_groups([[0, 2], [1, 3]], same) == [[0, 2]]  # 1 and 3 differ in their second input
    assert same_batch_groups([[0, 1, 2]], same) == [[0, 1, 2]]
    assert same_batch_groups([[0], [1]], same) == []  # one rank alone shares nothing
    assert same_batch_groups([[0, 1]], {0: [], 1: []}) == []  # no tensor input: nothing to tell
    assert same_batch_groups([[0, 1]], {0: _entries(1), 1: _entries(1, 2)}) == []  # another structure


def test_nested_fully_shard_modules_compare_once_at_the_outermost_first_training_forward(monkeypatch):
    check = DPInputs(SimpleNamespace(rank=0))
    calls = []
    monkeypatch.setattr(check, "_compare", lambda groups, args, kwargs: calls.append((groups, tuple(args[0].shape))))
    inner = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(inner, torch.nn.ReLU())
    for m in (inner, model):  # the order of fully_shard's calls: innermost first
        check.watch(m, lambda: [[0, 1]], first_of="fully_shard")
    with torch.no_grad():
        model(torch.zeros(2, 4))  # an evaluation pass: every rank may rightly see the same data
    model(torch.zeros(5, 4))
    model(torch.zeros(6, 4))
    assert calls == [([[0, 1]], (5, 4))]  # the batch the model got, not what a submodule got, and only once
    assert not model._forward_pre_hooks and not inner._forward_pre_hooks  # later forwards cost nothing


def test_a_rank_outside_every_group_or_groups_of_one_rank_watch_nothing():
    check = DPInputs(SimpleNamespace(rank=2))
    model = torch.nn.Linear(2, 2)
    check.watch(model, [[0, 1]])
    check.watch(model, [[2], [3]])
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("fake_world", [(1, 4)], indirect=True)  # rank 1 of a 2x2 mesh (tests/unit/conftest.py)
def test_fsdp2_groups_come_from_its_mesh_on_torchs_own_objects(fake_world):
    """fsdp_groups reads FSDP2's private state (mesh_info, _spmd_mesh): this breaks first when torch changes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from distcheck.rank.autocheck.dp_inputs import fsdp_groups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    parallelize_module(tp_model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(tp_model, mesh=mesh["dp"])
    assert fsdp_groups(tp_model) == [[0, 2], [1, 3]]  # both dp groups, from the dp x tp mesh of its DTensors

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=hsdp)
    fully_shard(model, mesh=hsdp)  # a root with no parameters of its own: its layers' groups
    assert fsdp_groups(model) == [[0, 1, 2, 3]]
