"""The first divergent module from per-sample summaries, without launching ranks (analysis/module_diff.py)."""
from __future__ import annotations

import torch

from distcheck.analysis.module_diff import (describe, element_error, explain_mismatch, first_divergent_module,
                                            search_modules)
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck.module_summaries import summarize


def _row(name, order, out, inp=None, grad=None, grad_order=None, cls="Linear", line=10):
    row = {"name": name, "order": order, "cls": cls, "file": "/w/model.py", "line": line, "site_kind": "forward",
           "out": summarize(out), "in": summarize(inp) if inp is not None else None}
    if grad is not None:
        row.update(grad_in=summarize(grad), grad_order=grad_order)
    return row


def _state(*rows):
    return {"modules": list(rows)}


def test_data_parallel_slices_concatenate_and_a_batch_statistic_is_named():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    lin = torch.nn.Linear(4, 6)
    h = lin(x).detach()
    norm = (h - h.mean(0)) / h.std(0)
    ref = {0: _state(_row("fc", 0, h, x), _row("norm", 1, norm, h, cls="BatchStatNorm", line=21))}
    halves = [slice(0, 4), slice(4, 8)]
    local = [(h[s] - h[s].mean(0)) / h[s].std(0) for s in halves]
    nrank = {r: _state(_row("fc", 0, h[s], x[s]), _row("norm", 1, local[r], h[s], cls="BatchStatNorm", line=21))
             for r, s in enumerate(halves)}
    diff, notes = first_divergent_module(ref, nrank)
    assert notes == [] and (diff.name, diff.side, diff.how, diff.line, diff.matched_before) == ("norm", "forward",
                                                                                                "cat", 21, 1)
    assert diff.input_matches is True and diff.ranks == [0, 1] and diff.max_rel > 0.01
    assert "'norm' (BatchStatNorm, forward at model.py:21)" in describe(diff)
    assert "its input matches the reference, so this module itself computes something else" in describe(diff)
    # The same slices through a per-sample layer: nothing differs.
    nrank_ok = {r: _state(_row("fc", 0, h[s], x[s])) for r, s in enumerate(halves)}
    assert first_divergent_module({0: _state(_row("fc", 0, h, x))}, nrank_ok) == (None, [])


def test_tensor_parallel_shards_add_up_and_replicated_values_must_match_on_every_rank():
    torch.manual_seed(1)
    full = torch.randn(3, 8)
    out = torch.randn(3, 5)
    ref = {0: _state(_row("up", 0, full), _row("down", 1, out))}
    nrank = {0: _state(_row("up", 0, full[:, :4]), _row("down", 1, out)),
             1: _state(_row("up", 0, full[:, 4:]), _row("down", 1, out))}
    assert first_divergent_module(ref, nrank) == (None, [])
    nrank[1]["modules"][1] = _row("down", 1, out * 1.5)
    diff, _ = first_divergent_module(ref, nrank)
    assert (diff.name, diff.how, diff.ranks) == ("down", "same", [1])


def test_backward_side_after_the_loss_scale_and_ambiguous_shapes_are_said():
    torch.manual_seed(2)
    x, g_embed, g_col = torch.randn(4, 3), torch.randn(4, 6), torch.randn(4, 6)
    ref = {0: _state(_row("embed", 0, x, grad=g_embed, grad_order=1), _row("col", 1, x, grad=g_col, grad_order=0))}
    # Per-rank mean losses: every gradient is twice the reference's; col's input gradient is partial on each rank.
    nrank = {r: _state(_row("embed", 0, x, grad=2 * g_embed, grad_order=1),
                       _row("col", 1, x, grad=2 * g_col, grad_order=0)) for r in (0, 1)}
    assert first_divergent_module(ref, nrank) == (None, [])
    nrank = {r: _state(_row("embed", 0, x, grad=2 * g_embed, grad_order=1),
                       _row("col", 1, x, grad=2 * g_col, grad_order=0)) for r in (0, 1)}
    nrank[0]["modules"][0] = _row("embed", 0, x, grad=2 * g_embed * torch.tensor([1.0, 0.3, 1.0, 1.0])[:, None],
                                  grad_order=1)
    diff, _ = first_divergent_module(ref, nrank)
    assert (diff.name, diff.side, diff.matched_before, diff.ranks) == ("embed", "backward", 1, [0])
    assert abs(diff.scale - 0.5) < 1e-9 and "after scaling by 0.5" in describe(diff)
    odd = {0: _state(_row("fc", 0, torch.randn(3, 2))), 1: _state(_row("fc", 0, torch.randn(2, 2)))}
    diff, notes = first_divergent_module({0: _state(_row("fc", 0, torch.randn(4, 2)))}, odd)
    assert diff is None and "not a split of its batch" in notes[0]


def test_element_error_reassembles_as_the_summaries_mapped():
    torch.manual_seed(3)
    ref = torch.randn(4, 6)
    cap = lambda t, placements=None: {"tensor": t, "placements": placements}  # noqa: E731
    exact = element_error(cap(ref), {0: cap(ref[:2]), 1: cap(ref[2:])}, "cat")
    assert exact["max_abs"] == 0.0
    wrong = ref.clone()
    wrong[3, 5] += 0.5
    e = element_error(cap(ref), {0: cap(wrong[:2]), 1: cap(wrong[2:])}, "cat")
    assert e["index"] == [3, 5] and abs(e["max_abs"] - 0.5) < 1e-6 and e["rank"] is None
    e = element_error(cap(ref), {0: cap(ref[:, :3]), 1: cap(wrong[:, 3:])}, "sum")  # a column shard: cat on dim 1
    assert e["index"] == [3, 5]
    e = element_error(cap(ref), {0: cap(ref), 1: cap(wrong)}, "same")
    assert e["rank"] == 1 and e["index"] == [3, 5]
    assert element_error(cap(ref), {0: cap(ref / 2), 1: cap(ref / 2)}, "partial")["max_abs"] < 1e-12
    seq = element_error(cap(ref), {0: cap(ref, ["Shard(dim=0)"]), 1: cap(ref, ["Shard(dim=0)"])}, "sum")
    assert seq == "the reassembled [8, 6] does not have the reference's shape [4, 6]"


# -- meshes of several dims: batch slices along the data-parallel ranks only -------------------------------------

def _rms(t):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)


def _mesh_2d(norm_on_shard=False):
    """dp=2 x tp=2 (ranks [[0, 1], [2, 3]]): up column-sharded, a norm over the hidden features, down row-wise."""
    torch.manual_seed(4)
    x, w1, w2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 3)
    h = torch.tanh(x @ w1)
    ref = {0: _state(_row("up", 0, h, x), _row("norm", 1, _rms(h), h, cls="HiddenNorm", line=34),
                     _row("down", 2, _rms(h) @ w2, _rms(h)))}
    nrank = {}
    for r in range(4):
        dp, tp = divmod(r, 2)
        rows, cols = slice(4 * dp, 4 * dp + 4), slice(3 * tp, 3 * tp + 3)
        local = h[rows, cols]
        normed = _rms(local) if norm_on_shard else _rms(h[rows])[:, cols]
        down = _row("down", 2, normed @ w2[cols], normed)
        down["out"]["how"] = "partial"  # a RowwiseParallel output before its all-reduce, as its DTensor says
        state = _state(_row("up", 0, local, x[rows]), _row("norm", 1, normed, local, cls="HiddenNorm", line=34), down)
        for row in state["modules"]:
            row["dp"] = [dp, 2]
        nrank[r] = state
    return ref, nrank


def test_a_2d_mesh_maps_data_parallel_slices_and_tensor_parallel_shards():
    ref, nrank = _mesh_2d()
    found = search_modules(ref, nrank)
    assert (found.diff, found.notes, found.compared) == (None, [], 3)


def test_a_2d_mesh_names_the_module_that_computes_something_else():
    ref, nrank = _mesh_2d(norm_on_shard=True)
    diff, notes = first_divergent_module(ref, nrank)
    assert notes == [] and (diff.name, diff.side, diff.how, diff.line) == ("norm", "forward", "cat/sum", 34)
    assert diff.ranks == [0, 1, 2, 3] and diff.matched_before == 1 and diff.input_matches is True
    assert ("compared as the data-parallel ranks' batch slices in order, each slice its tensor-parallel shards "
            "added up") in describe(diff)


def test_unmapped_modules_are_said_and_never_reported_as_matching():
    # The 2x2 mesh read without data-parallel coordinates: shards of [4, 4, 4, 4] samples, reference 8.
    ref, nrank = _mesh_2d()
    for state in nrank.values():
        for row in state["modules"]:
            del row["dp"]
    found = search_modules(ref, nrank)
    assert found.diff is None and found.compared == 0 and len(found.notes) == 3
    assert "have [4, 4, 4, 4] samples" in found.notes[0] and "the reference 8" in found.notes[0]
    finding = Finding("reference_mismatch", [0, 1, 2, 3], "step 0: the loss differs", {})
    explain_mismatch(finding, ref, nrank)
    assert "Every module" not in finding.message and "No module's output or input gradient could be mapped onto " \
        "the 1-rank reference, so no module is named" in finding.message
    assert finding.detail["module_notes"] == found.notes and finding.detail["modules_compared"] == 0
    # Some mapped and matching, one not: the message says how many could not be mapped.
    ref, nrank = _mesh_2d()
    del nrank[3]["modules"][1]  # 'norm' did not run on rank 3
    finding = Finding("reference_mismatch", [0, 1, 2, 3], "step 0: the loss differs", {})
    explain_mismatch(finding, ref, nrank)
    assert "No module differs among the 2 module outputs and input gradients that could be mapped onto the 1-rank " \
        "reference, but 1 could not be mapped" in finding.message and "Every module" not in finding.message
    assert "'norm'" in finding.detail["module_notes"][0]
    # Everything mapped and matching: then, and only then, every module matched.
    ref, nrank = _mesh_2d()
    finding = Finding("reference_mismatch", [0, 1, 2, 3], "step 0: the loss differs", {})
    explain_mismatch(finding, ref, nrank)
    assert "Every module's output and input gradient in the first step match" in finding.message


def test_element_error_reassembles_a_2d_mesh():
    torch.manual_seed(5)
    ref = torch.randn(4, 6)
    parts = {r: {"tensor": ref[2 * (r // 2):2 * (r // 2) + 2, 3 * (r % 2):3 * (r % 2) + 3], "placements": None,
                 "dp": [r // 2, 2]} for r in range(4)}
    assert element_error({"tensor": ref}, parts, "cat/sum")["max_abs"] == 0.0
    parts[3]["tensor"] = parts[3]["tensor"] + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.7, 0.0]])
    e = element_error({"tensor": ref}, parts, "cat/sum")
    assert e["index"] == [3, 4] and abs(e["max_abs"] - 0.7) < 1e-6


def test_a_module_whose_line_is_unknown_is_named_without_a_question_mark():
    """A library module (torchtitan's FSDPEmbedding) has no user line: the class is named, never 'forward at ?'."""
    from distcheck.analysis.module_diff import ModuleDiff

    known = ModuleDiff("embed", "Embedding", "/x/train.py", 12, "forward", "cat", 1.0, 0.5, [0, 1], 0)
    unknown = ModuleDiff("embed", "FSDPEmbedding", None, None, "forward", "cat", 1.0, 0.5, [0, 1], 0)
    assert "(Embedding, forward at train.py:12)" in describe(known)
    assert "(FSDPEmbedding)" in describe(unknown) and "?" not in describe(unknown)
