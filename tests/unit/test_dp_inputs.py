"""The data-parallel same-batch warning (rank/autocheck/dp_inputs.py): which loaders split by rank, and what the
warning blames."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distcheck.rank.autocheck.dp_inputs import _is_distributed, same_batch_note
from distcheck.rank.usersite import Site


def test_a_loader_splits_by_rank_with_a_distributed_sampler_only():
    data = TensorDataset(torch.zeros(8, 2))
    plain = DataLoader(data, batch_size=2)
    split = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert not _is_distributed(plain.sampler) and not _is_distributed(plain.batch_sampler)
    assert _is_distributed(split.sampler) and _is_distributed(split.batch_sampler)


def test_the_warning_names_the_loader_else_the_seed():
    at = Site("/w/train.py", 40)
    note = same_batch_note([0, 1], at, Site("/w/train.py", 30), (0, Site("/w/train.py", 12)))
    assert note.kind == "same_batches" and note.ranks == [0, 1] and note.detail["loader"] == ["/w/train.py", 30]
    assert note.message.startswith("ranks 0-1 (data parallel) fed the same batch at their first forward at "
                                   "train.py:40: every rank trains on the same data, so 2 ranks do the work of one")
    assert "the DataLoader built at train.py:30 has no DistributedSampler" in note.message
    seeded = same_batch_note([0, 1], at, None, (0, Site("/w/train.py", 12)))
    assert "torch.manual_seed(0) at train.py:12" in seeded.message
