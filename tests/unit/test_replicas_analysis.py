"""Pure replica comparison: majority, blame, structural differences, element diffs and messages."""
import pytest
import torch

from distcheck.analysis.replicas import (Entry, diff_chunk, divergence_finding, find_divergences,
                                         merge_summaries, unravel)
from distcheck.rank.checks.fingerprint import fingerprint


def entries(tensors, role="parameter", key=None):
    return [Entry(name, role, key, fingerprint(t)) for name, t in tensors.items()]


def test_no_divergence_when_equal():
    t = torch.randn(4, 4)
    assert find_divergences({0: entries({"w": t}), 1: entries({"w": t.clone()})}) == []


def test_majority_blames_the_odd_rank():
    t = torch.randn(4, 4)
    odd = t.clone()
    odd[1, 2] += 1
    per_rank = {r: entries({"w": t}) for r in (0, 1, 2, 4)}
    per_rank[3] = entries({"w": odd})
    [div] = find_divergences(per_rank)
    assert div.name == "w" and div.blamed == [3] and div.reference == 0 and list(div.odd) == [3]


def test_no_majority_blames_everyone():
    [div] = find_divergences({0: entries({"w": torch.zeros(3)}), 1: entries({"w": torch.ones(3)})})
    assert div.blamed == [0, 1]


def test_replica_keys_partition_ranks():
    # Shards (different keys) may differ; replicas of the same shard (same key) must not.
    a, b = torch.zeros(2), torch.ones(2)
    per_rank = {0: [Entry("w", "parameter", ("shard", 0), fingerprint(a))],
                1: [Entry("w", "parameter", ("shard", 1), fingerprint(b))],
                2: [Entry("w", "parameter", ("shard", 0), fingerprint(a))],
                3: [Entry("w", "parameter", ("shard", 1), fingerprint(b))]}
    assert find_divergences(per_rank) == []
    per_rank[3] = [Entry("w", "parameter", ("shard", 1), fingerprint(a))]
    [div] = find_divergences(per_rank)
    assert div.ranks == [1, 3] and div.blamed == [1, 3]


def test_structural_and_missing():
    [div] = find_divergences({0: entries({"w": torch.zeros(2, 3)}), 1: entries({"w": torch.zeros(3, 2)})})
    assert "float32[2, 3] on rank 0" in div.structural
    [div] = find_divergences({0: entries({"w": torch.zeros(2), "extra": torch.zeros(1)}),
                              1: entries({"w": torch.zeros(2)})})
    assert div.name == "extra" and div.blamed == [1] and "missing on rank 1" in div.structural


def test_diff_chunk_names_first_index_and_max():
    ref = torch.zeros(6)
    other = ref.clone()
    other[2] = 0.5
    other[4] = -2.0
    s = diff_chunk(1, ref, other, offset=6, shape=(3, 4))
    assert s.first_index == [2, 0] and s.value == 0.5 and s.max_abs_diff == 2.0 and s.num_different == 2
    assert diff_chunk(1, ref, ref.clone(), 0, (6,)) is None
    merged = merge_summaries([s, diff_chunk(1, torch.zeros(1), torch.full((1,), 7.0), 0, (1,))])
    assert merged.max_abs_diff == 7.0 and merged.first_index == [2, 0]
    assert unravel(7, (2, 2, 2)) == [1, 1, 1]


def test_divergence_finding_message():
    t = torch.zeros(4)
    u = t.clone()
    u[3] = 1
    [div] = find_divergences({0: entries({"layer.w": t}), 1: entries({"layer.w": u})})
    s = diff_chunk(1, t, u, 0, (4,))
    f = divergence_finding(div, {1: s}, "before parallelizing")
    assert f.kind == "tensor_divergence" and f.ranks == [0, 1]
    assert "'layer.w'" in f.message and "max abs diff 1" in f.message and "[3]" in f.message


def test_diff_chunk_of_complex_tensors_measures_in_the_complex_plane_without_a_warning():
    import warnings

    ref = torch.tensor([1 + 1j, 2 + 0j, 0 + 3j], dtype=torch.complex64)
    other = ref.clone()
    other[2] = 0 + 7j  # only the imaginary part differs: a cast to real would see no difference
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = diff_chunk(1, ref, other, offset=0, shape=(3,))
    assert s.first_index == [2] and s.max_abs_diff == pytest.approx(4.0) and s.num_different == 1
