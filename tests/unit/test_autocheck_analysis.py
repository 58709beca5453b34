"""bad_values analysis without launching ranks: value classification, uninitialized-parameter findings, first NaN."""
from __future__ import annotations

import torch

from distcheck.analysis.bad_values import (HUGE, BadEvent, FlaggedTensor, ValueStats, classify, first_bad_finding,
                                           fold_first_bad, tensor_stats, uninitialized_findings)
from distcheck.contract.findings import Finding


def test_initializers_are_never_flagged():
    torch.manual_seed(0)
    for t in (torch.nn.Linear(256, 256).weight, torch.nn.init.normal_(torch.empty(512, 64), std=0.02),
              torch.nn.init.trunc_normal_(torch.empty(128, 128)), torch.zeros(64), torch.ones(64),
              torch.nn.init.xavier_uniform_(torch.empty(64, 64)).bfloat16(), torch.randn(1000).half()):
        assert classify(tensor_stats(t), str(t.dtype)) == [], t


def test_leftover_memory_is_flagged_for_what_it_is():
    t = torch.tensor([1e38, -3e31, 1e-40, 0.0, 0.5, float("nan"), float("inf")])
    stats = tensor_stats(t)
    assert (stats.nan, stats.inf, stats.huge, stats.denormal, stats.zeros) == (1, 1, 2, 1, 1)
    assert stats.min == torch.tensor(-3e31).item() and stats.max == torch.tensor(1e38).item()
    assert classify(stats, "float32") == ["1 NaN", "1 Inf", f"2 with |x| > {HUGE:.0e} (max 1e+38)", "1 denormal"]
    # float16's denormals are ordinary small values; buffers may hold -inf masks and big constants, only NaN counts.
    assert classify(tensor_stats(torch.tensor([1e-6, 0.1]).half()), "float16") == []
    assert classify(stats, "float32", role="buffer") == ["1 NaN"]
    assert classify(tensor_stats(torch.tensor([float("-inf"), 1e9])), "float32", role="buffer") == []


def test_dtensor_like_uses_local_values():
    class Fake:
        def to_local(self):
            return torch.tensor([2e7])

    assert tensor_stats(Fake()).huge == 1


def _flag(name: str, rank_max: float) -> FlaggedTensor:
    stats = ValueStats(numel=10, huge=3, denormal=2, min=-5.0, max=rank_max, max_abs=rank_max)
    return FlaggedTensor(name, "parameter", "float32", "blocks.0.fc1", "nn.Linear", stats,
                         classify(stats, "float32"), "/src/model.py", 29, (-0.18, 0.18), "nn.Linear.reset_parameters()")


def test_uninitialized_findings_merge_ranks_and_show_the_initializer():
    [f] = uninitialized_findings({0: [_flag("blocks.0.fc1.weight", 1e38)], 1: [_flag("blocks.0.fc1.weight", 2e31)]})
    assert f.kind == "bad_values" and f.ranks == [0, 1]
    assert "'blocks.0.fc1.weight' of nn.Linear 'blocks.0.fc1' (model.py:29)" in f.message
    assert "finite range [-5, 1e+38]" in f.message and "nn.Linear.reset_parameters() gives [-0.18, 0.18]" in f.message
    assert "differ between world sizes and runs" in f.message
    assert f.detail["file"] == "/src/model.py" and f.detail["line"] == 29 and f.detail["range"] == [-5.0, 1e38]
    assert uninitialized_findings({0: [], 1: []}) == []


def test_one_cause_behind_many_tensors_is_one_finding():
    """Uninitialized parameters in many layers are one finding (every one in its detail); NaN/Inf is another cause."""
    names = [f"blocks.{b}.fc{i}.weight" for b in range(4) for i in (1, 2)]
    per_rank = {r: [_flag(n, 1e38) for n in names] for r in (0, 1)}
    nan = ValueStats(numel=10, nan=2, min=-1.0, max=1.0, max_abs=1.0)
    per_rank[1].append(FlaggedTensor("head.weight", "parameter", "float32", "head", "nn.Linear", nan,
                                     classify(nan, "float32"), "/src/model.py", 40))
    per_rank[1].append(FlaggedTensor("head.bias", "parameter", "float32", "head", "nn.Linear", nan,
                                     classify(nan, "float32"), "/src/model.py", 40))
    uninit, nonfinite = uninitialized_findings(per_rank)
    assert uninit.ranks == [0, 1] and uninit.detail["params"] == names and uninit.detail["count"] == 8
    assert len(uninit.detail["tensors"]) == 8 and uninit.detail["line"] == 29 and uninit.detail["cause"] == "uninitialized"
    assert uninit.message.startswith("8 parameters of nn.Linear layers hold values no initializer produces")
    assert "'blocks.0.fc1.weight', 'blocks.0.fc2.weight', 'blocks.1.fc1.weight' (+5 more)" in uninit.message
    assert "Created at model.py:29" in uninit.message and len(uninit.message) < 800
    assert nonfinite.ranks == [1] and nonfinite.detail["params"] == ["head.weight", "head.bias"]
    assert "turns every loss and gradient that touches them into NaN/Inf" in nonfinite.message


def test_nan_left_over_memory_joins_the_uninitialized_layers():
    """pytorch/examples' FSDP2 example without init: some LayerNorm/Linear shards hold NaN bit patterns, all NaN on
    one rank, huge on another: the same never-run initializer, so one finding, not one per value class."""
    names = [f"layers.{b}.fc.weight" for b in range(3)]
    per_rank = {r: [_flag(n, 1e38) for n in names] for r in (0, 1)}
    all_nan = ValueStats(numel=8, nan=8)
    leftover = ValueStats(numel=8, huge=1, denormal=2, zeros=5, min=0.0, max=1.4e16, max_abs=1.4e16)
    per_rank[0].insert(1, FlaggedTensor("layers.0.norm.bias", "parameter", "float32", "layers.0", "nn.Linear",
                                        all_nan, classify(all_nan, "float32"), "/src/model.py", 80))
    per_rank[1].insert(1, FlaggedTensor("layers.0.norm.bias", "parameter", "float32", "layers.0", "nn.Linear",
                                        leftover, classify(leftover, "float32"), "/src/model.py", 80))
    [one] = uninitialized_findings(per_rank)
    assert one.detail["params"] == ["layers.0.fc.weight", "layers.0.norm.bias", "layers.1.fc.weight",
                                    "layers.2.fc.weight"]
    assert "; 1 of them NaN/Inf;" in one.message and one.detail["cause"] == "uninitialized"


def test_the_first_nan_of_uninitialized_parameters_is_told_in_their_finding():
    names = [f"blocks.{b}.fc1.weight" for b in range(3)]
    [uninit] = uninitialized_findings({r: [_flag(n, 1e38) for n in names] for r in (0, 1)})
    first = first_bad_finding({r: BadEvent(0, "optimizer.step", True, "nan", ["head.bias"], "/src/train.py", 50)
                               for r in (0, 1)}, {0: 1, 1: 1})
    other = Finding("hang", [1], "no progress")
    assert fold_first_bad([uninit, first, other]) == [uninit, other]
    assert uninit.detail["first_bad"]["step"] == 0 and uninit.message.endswith(
        "Training went NaN/Inf at once: the first bad optimizer.step is step 0 (train.py:50), on ranks 0-1")
    assert fold_first_bad([first, other]) == [first, other]  # a NaN with no uninitialized parameter stays itself


def test_first_nan_on_one_rank_points_to_its_data():
    events = {0: BadEvent(2, "optimizer.step", False, None, ["2.bias", "2.weight"]),
              1: BadEvent(2, "optimizer.step", True, "nan", ["2.bias"], "/src/train.py", 40)}
    f = first_bad_finding(events, {0: 4, 1: 4})
    assert f.kind == "bad_values" and f.ranks == [1]
    assert f.message.startswith("first NaN/Inf at step 2 ")
    assert "the loss passed to backward() at train.py:40 was nan on rank 1" in f.message
    assert "first non-finite gradient in backward order: '2.bias'" in f.message
    assert "Rank 0 had a finite loss at that step" in f.message and "through the gradient reduction" in f.message
    assert "only points to that rank's data" in f.message
    assert f.detail["step"] == 2 and f.detail["clean_ranks"] == [] and f.detail["line"] == 40


def test_first_nan_earliest_step_wins_and_all_ranks_bad_is_not_a_data_hint():
    events = {0: BadEvent(5, "optimizer.step", True, "inf"), 1: BadEvent(3, "optimizer.step", True, "nan"),
              2: None}
    f = first_bad_finding(events, {0: 6, 1: 6, 2: 6})
    assert f.ranks == [1] and f.detail["step"] == 3 and f.detail["clean_ranks"] == [0, 2]
    assert "Ranks 0,2 stayed finite at that step" in f.message
    both = first_bad_finding({0: BadEvent(0, "backward", True, "nan"), 1: BadEvent(0, "backward", True, "nan")},
                             {0: 1, 1: 1})
    assert both.ranks == [0, 1] and "points to" not in both.message
    grads_only = first_bad_finding({0: BadEvent(1, "optimizer.step", False, None, ["w"])}, {0: 3})
    assert "Every loss was finite" in grads_only.message and grads_only.detail["first_param"] == "w"
    assert first_bad_finding({0: None, 1: None}, {0: 3, 1: 3}) is None


def test_fast_path_agrees_with_classify():
    from distcheck.analysis.bad_values import plausible

    cases = [torch.randn(100), torch.zeros(10), torch.tensor([1e38, 0.1]), torch.tensor([1e-40, 0.1]),
             torch.tensor([float("nan")]), torch.tensor([float("-inf"), 0.0]), torch.randn(50).half(),
             torch.tensor([1e-6]).half(), torch.tensor([2e6]).bfloat16()]
    for t in cases:
        for role in ("parameter", "buffer"):
            assert plausible(t, role) == (classify(tensor_stats(t), str(t.dtype), role) == []), (t, role)


def test_a_gradient_found_bad_by_a_sparse_check_says_since_when_it_can_be():
    """Past the dense steps gradients are checked every GRAD_EVERY steps: the finding bounds the first bad step."""
    from distcheck.rank.autocheck.nan_watch import GRAD_DENSE_STEPS, GRAD_EVERY, grads_checked

    assert all(grads_checked(s) for s in range(GRAD_DENSE_STEPS))
    assert [s for s in range(GRAD_DENSE_STEPS, GRAD_DENSE_STEPS + 2 * GRAD_EVERY) if grads_checked(s)] == [
        GRAD_DENSE_STEPS, GRAD_DENSE_STEPS + GRAD_EVERY]
    events = {0: BadEvent(70, "optimizer.step", False, None, ["fc.weight"], last_clean_grads=60), 1: None}
    f = first_bad_finding(events, {0: 71, 1: 71})
    assert f is not None and f.ranks == [0]
    assert "last finite at step 60, so the first bad one lies in steps 61-70" in f.message
    dense = first_bad_finding({0: BadEvent(3, "optimizer.step", False, None, ["fc.weight"])}, {0: 4})
    assert "last finite" not in dense.message


def test_a_ddp_groups_gradients_checked_by_one_rank_read_as_if_every_rank_had():
    """One rank of a DDP group checks a step's gradients for all (rank/autocheck/ddp_grad_share.py): the finding is
    the one every rank's own check gave. Rank 1 found the bad gradients at step 3 with a bad loss; rank 0's own first
    event came a step later (its NaN parameters)."""
    from distcheck.analysis.bad_values import spread_replicated

    full = {0: BadEvent(3, "optimizer.step", False, None, ["2.bias", "2.weight"], "/src/train.py", 40),
            1: BadEvent(3, "optimizer.step", True, "nan", ["2.bias", "2.weight"], "/src/train.py", 40)}
    shared = {0: BadEvent(4, "optimizer.step", True, "nan", [], "/src/train.py", 40),
              1: BadEvent(3, "optimizer.step", True, "nan", ["2.bias", "2.weight"], "/src/train.py", 40,
                          replicated=[0, 1])}
    want, got = first_bad_finding(full, {0: 6, 1: 6}), first_bad_finding(shared, {0: 6, 1: 6})
    assert got.message == want.message and got.ranks == want.ranks == [1]
    assert got.detail["grad_ranks"] == [0, 1] and got.detail["events"]["0"]["checked_on"] == 1
    # rank 0's own event at that step (its own bad loss, on rank 1's turn) gets the gradients added
    same_step = spread_replicated({0: BadEvent(3, "optimizer.step", True, "inf", []), 1: shared[1]})
    assert same_step[0].loss_value == "inf" and same_step[0].grad_params == ["2.bias", "2.weight"]
    # a rank that checked for itself keeps its own event; a rank outside the group gets nothing
    kept = spread_replicated({0: full[0], 1: shared[1], 2: None})
    assert kept[0] is full[0] and kept[2] is None
    # without gradients found there is nothing to give: a rank with no event stays clean
    loss_only = spread_replicated({0: None, 1: BadEvent(3, "optimizer.step", True, "nan", [], replicated=[0, 1])})
    assert loss_only[0] is None
