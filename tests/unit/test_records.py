"""Unit tests of distcheck.record (the per-rank writer) and the comparison (analysis/record_values.py, record_resolve.py, record_compare.py, record_explain.py,
compare_to_reference.py).

Nothing is launched: the writer runs in this process with DISTCHECK_REPORT_DIR set, the analysis on records
built in memory or read back from those files.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import distcheck
from distcheck.rank import records
from distcheck.analysis.compare_to_reference import compare_runs
from distcheck.analysis.record_compare import (STATUS_DIFF, STATUS_MISSING_REF, STATUS_MISSING_RUN, STATUS_OK,
                                               Tolerances)
from distcheck.analysis.record_explain import render_table
from distcheck.analysis.record_resolve import resolve_run
from distcheck.analysis.record_values import Part, Record, load_rank, load_run
from distcheck.contract.records_file import index_path


@pytest.fixture
def recording(tmp_path, monkeypatch):
    """distcheck.record writing as rank 0 of a run into tmp_path."""
    monkeypatch.setenv("DISTCHECK_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    records.reset()
    yield tmp_path
    records.reset()


def test_noop_outside_distcheck(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTCHECK_REPORT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    records.reset()
    distcheck.record("loss", torch.tensor(1.0))
    assert not records.active() and list(tmp_path.iterdir()) == []
    # The decision is cached: setting the variable later does not turn recording on in this process.
    monkeypatch.setenv("DISTCHECK_REPORT_DIR", str(tmp_path))
    distcheck.record("loss", torch.tensor(1.0))
    assert list(tmp_path.iterdir()) == []
    records.reset()


def test_writes_tensors_numbers_modules(recording):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model(torch.randn(4, 3)).sum().backward()
    distcheck.record("loss", torch.tensor(0.5, dtype=torch.bfloat16))
    distcheck.record("lr", 0.1)
    distcheck.record("steps_done", 7)
    distcheck.record("model", model, step=5)
    distcheck.record("loss", torch.tensor(0.25, dtype=torch.bfloat16))  # auto step counter per name: 1
    got = load_rank(recording, 0)
    assert [(r.name, r.step, r.kind) for r in got] == [("loss", 0, "tensor"), ("lr", 0, "number"),
                                                       ("steps_done", 0, "number"), ("model", 5, "module"),
                                                       ("loss", 1, "tensor")]
    assert got[0].parts[0].value.dtype == torch.bfloat16 and float(got[4].parts[0].value) == 0.25
    assert got[2].parts[0].value.dtype == torch.int64
    mod = got[3]
    keys = [(p.key, p.role) for p in mod.parts]
    assert ("0.weight", "parameter") in keys and ("1.running_mean", "buffer") in keys
    assert ("0.weight.grad", "gradient") in keys and mod.replicated is True
    assert torch.equal(dict((p.key, p.value) for p in mod.parts)["0.weight.grad"], model[0].weight.grad)
    # the site is the line of the distcheck.record call in this file
    assert got[0].file == __file__ and got[0].site.startswith("test_records.py:")


def test_wrapper_prefixes_are_stripped(recording):
    class Wrapper(nn.Module):  # stands in for DDP / torch.compile, which exist only at some world sizes
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    distcheck.record("model", Wrapper())
    assert [p.key for p in load_rank(recording, 0)[0].parts] == ["weight", "bias"]


def test_per_record_and_per_name_tolerance(recording):
    records.tolerance("act", rtol=0.5)
    records.record("act", torch.ones(2))
    records.record("act", torch.ones(2), atol=0.1, rtol=0.2)
    a, b = load_rank(recording, 0)
    assert (a.rtol, a.atol) == (0.5, None) and (b.rtol, b.atol) == (0.2, 0.1)
    with pytest.raises(ValueError):
        records.tolerance("act", rtol=-1)


def test_the_public_record_takes_the_tolerances_and_replicated(recording):
    """distcheck.record is all a user needs: no import of distcheck.rank.records for a tolerance."""
    distcheck.record("logits", torch.ones(2), 0, rtol=1e-2, atol=1e-3)
    distcheck.record("lr", 0.1, 0, replicated=True)
    distcheck.record("loss", 1.5, 0)
    logits, lr, loss = load_rank(recording, 0)
    assert (logits.rtol, logits.atol) == (1e-2, 1e-3) and (loss.rtol, loss.atol) == (None, None)
    assert lr.replicated is True and loss.replicated is not True


def test_crash_keeps_written_records(recording):
    distcheck.record("a", torch.arange(4.0))
    distcheck.record("b", torch.arange(3.0))
    # Nothing is buffered: the files are complete while the writer is still open (a SIGKILL keeps them).
    assert [r.name for r in load_rank(recording, 0)] == ["a", "b"]
    with open(index_path(recording, 0), "a") as fh:  # a crash in the middle of an index line
        fh.write('{"name": "c", "st')
    assert [r.name for r in load_rank(recording, 0)] == ["a", "b"]


def test_rejects_other_types(recording):
    with pytest.raises(TypeError, match="takes a tensor"):
        distcheck.record("x", "text")


# -- analysis on in-memory records ------------------------------------------------------------------------------

def rec(name, step, value, rank=0, seq=0, replicated=None, role="tensor", key="", file="train.py", line=10, **kw):
    t = torch.as_tensor(value, dtype=torch.float32)
    return Record(name, step, seq, rank, "tensor", [Part(key, role, t, t.dtype)], replicated, file=file, line=line,
                  **kw)


def module(step, weight, grad, rank=0, seq=1):
    w, g = torch.tensor(weight), torch.tensor(grad)
    return Record("model", step, seq, rank, "module",
                  [Part("w", "parameter", w, w.dtype), Part("w.grad", "gradient", g, g.dtype)], True,
                  file="train.py", line=20)


def test_equal_runs_compare_ok():
    ref = {0: [rec("loss", 0, 1.0), module(0, [1.0, 2.0], [0.1, 0.2])]}
    run = {r: [rec("loss", 0, 1.0 + 1e-7, rank=r), module(0, [1.0, 2.0], [0.1, 0.2], rank=r)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.ok and [row.status for row in result.rows] == [STATUS_OK, STATUS_OK]


def test_sum_vs_mean_hint_and_site():
    ref = {0: [rec("loss", 0, 0.8), rec("loss", 1, 0.7, seq=1)]}
    run = {r: [rec("loss", 0, 1.6, rank=r, line=33), rec("loss", 1, 1.4, rank=r, seq=1, line=33)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    (f,) = result.findings
    assert f.kind == "reference_mismatch" and f.ranks == [0, 1]
    assert f.detail["step"] == 0 and f.detail["line"] == 33 and "train.py:33" in f.message
    assert "2x the reference" in f.message and f.detail["abs_err"] == pytest.approx(0.8)
    assert f.detail["rel_err"] == pytest.approx(1.0)


def test_one_over_n_hint():
    ref = {0: [rec("x", 0, [2.0, 4.0])]}
    run = {0: [rec("x", 0, [0.5, 1.0])]}
    (f,) = compare_runs(ref, run, 4).findings
    assert "1/4 of the reference" in f.message


def test_gradient_differs_but_loss_matches():
    ref = {0: [rec("loss", 0, 1.0), module(0, [1.0, 2.0], [0.1, 0.2])]}
    run = {r: [rec("loss", 0, 1.0, rank=r), module(0, [1.0, 2.0], [0.2, 0.4], rank=r)] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.detail["part"] == "w.grad" and f.detail["part_role"] == "gradient" and f.detail["line"] == 20
    assert "loss matches the reference at step 0 but the gradients do not" in f.message
    assert f.detail["index"] == [1]  # worst element


def test_no_gradient_hint_when_loss_differs_too():
    ref = {0: [module(0, [1.0], [0.1], seq=0), rec("loss", 0, 1.0, seq=1)]}
    run = {0: [module(0, [1.0], [0.3], seq=0), rec("loss", 0, 1.5, seq=1)]}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.detail["part_role"] == "gradient" and "gradients do not" not in f.message


def test_first_mismatch_is_first_step_then_record_order():
    ref = {0: [rec("a", 0, 1.0, seq=0), rec("b", 0, 1.0, seq=1), rec("a", 1, 1.0, seq=2), rec("b", 1, 1.0, seq=3)]}
    run = {0: [rec("a", 0, 1.0, seq=0), rec("b", 0, 1.0, seq=1), rec("a", 1, 9.0, seq=2), rec("b", 1, 9.0, seq=3)]}
    result = compare_runs(ref, run, 2)
    assert [(row.name, row.step, row.status) for row in result.rows] == [
        ("a", 0, STATUS_OK), ("b", 0, STATUS_OK), ("a", 1, STATUS_DIFF), ("b", 1, STATUS_DIFF)]
    assert [f.detail["name"] for f in result.findings] == ["a"]
    assert len(compare_runs(ref, run, 2, steps=1).findings) == 0  # --steps 1 stops before the difference


def test_forward_hint_for_a_loss_differing_at_its_first_step():
    ref = {0: [rec("loss", 0, 0.70)]}
    run = {0: [rec("loss", 0, 0.83)]}
    (f,) = compare_runs(ref, run, 2).findings
    assert "forward pass differs" in f.message and "x the reference" not in f.message


def test_per_rank_values_compare_as_their_mean():
    ref = {0: [rec("loss", 0, 1.0)]}
    run = {0: [rec("loss", 0, 0.8)], 1: [rec("loss", 0, 1.2, rank=1)]}
    result = compare_runs(ref, run, 2)
    assert result.ok and result.rows[0].mode == "mean of 2 ranks"


def test_replicated_record_disagreeing_is_tensor_divergence():
    ref = {0: [module(0, [1.0, 2.0], [0.1, 0.2])]}
    run = {0: [module(0, [1.0, 2.0], [0.1, 0.2])], 1: [module(0, [1.0, 2.0], [0.1, 0.5], rank=1)],
           2: [module(0, [1.0, 2.0], [0.1, 0.2], rank=2)]}
    result = compare_runs(ref, run, 3)
    (div,) = [f for f in result.findings if f.kind == "tensor_divergence"]
    assert div.ranks == [1] and div.detail["name"] == "w.grad" and div.detail["line"] == 20
    assert "train.py:20" in div.message and div.detail["diffs"]["1"]["first_index"] == [1]
    # the majority's value is the one compared with the reference: it matches
    assert result.rows[0].status == STATUS_OK and "majority" in result.rows[0].mode
    # explicit replicated=True on a plain tensor makes disagreement a divergence instead of a mean
    run2 = {0: [rec("loss", 0, 1.0, replicated=True)], 1: [rec("loss", 0, 2.0, rank=1, replicated=True)]}
    assert [f.kind for f in compare_runs({0: [rec("loss", 0, 1.0)]}, run2, 2).findings] == ["tensor_divergence"]


def test_missing_records_both_ways():
    ref = {0: [rec("loss", 0, 1.0), rec("loss", 1, 1.0, seq=1), rec("loss", 2, 1.0, seq=2)]}
    run = {0: [rec("loss", 0, 1.0), rec("extra", 0, 3.0, seq=1)], 1: [rec("loss", 0, 1.0, rank=1)]}
    result = compare_runs(ref, run, 2)
    statuses = {(row.name, row.step): row.status for row in result.rows}
    assert statuses[("loss", 1)] == STATUS_MISSING_RUN and statuses[("extra", 0)] == STATUS_MISSING_REF
    by_name = {f.detail["name"]: f for f in result.findings}
    assert by_name["loss"].detail["steps"] == [1, 2] and "not in the 2-rank run" in by_name["loss"].message
    assert by_name["extra"].ranks == [0] and "not in the 1-rank reference" in by_name["extra"].message


def test_module_part_missing_is_a_mismatch():
    ref = {0: [module(0, [1.0], [0.1])]}
    w = torch.tensor([1.0])
    run = {0: [Record("model", 0, 0, 0, "module", [Part("w", "parameter", w, w.dtype)], True)]}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.detail["part"] == "w.grad" and "not in the N-rank run" in f.message


def test_tolerances_precedence():
    ref = {0: [rec("x", 0, 1.0)]}
    run = {0: [rec("x", 0, 1.01)]}
    assert not compare_runs(ref, run, 2).ok  # float32 default rtol 1e-4
    assert compare_runs(ref, run, 2, Tolerances(rtol=0.05)).ok  # --rtol
    strict = {0: [rec("x", 0, 1.01, rtol=1e-6, atol=0.0)]}
    assert not compare_runs(ref, strict, 2, Tolerances(rtol=0.05)).ok  # the record's own tolerance wins
    b16 = torch.tensor(1.0, dtype=torch.bfloat16)
    bref = {0: [Record("x", 0, 0, 0, "tensor", [Part("", "tensor", b16, b16.dtype)])]}
    b16b = torch.tensor(1.0078125, dtype=torch.bfloat16)  # one bf16 ulp: fine for bfloat16 tolerances
    brun = {0: [Record("x", 0, 0, 0, "tensor", [Part("", "tensor", b16b, b16b.dtype)])]}
    assert compare_runs(bref, brun, 2).ok


def test_table_lists_every_record(tmp_path, monkeypatch):
    ref = {0: [rec("loss", 0, 1.0), module(0, [1.0, 2.0], [0.1, 0.2])]}
    run = {0: [rec("loss", 0, 1.0), module(0, [1.0, 2.0], [0.2, 0.4])]}
    text = render_table(compare_runs(ref, run, 2).rows)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].split()[:3] == ["0", "loss", "ok"]
    assert "MISMATCH" in lines[2] and "first differing gradient 'w.grad'" in lines[2]
    assert lines[3] == "tolerance: rtol 0.0001, atol 1e-05 (float32 defaults)"  # which tolerance, and why


def test_round_trip_through_files(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCHECK_REPORT_DIR", str(tmp_path))
    for rank, scale in ((0, 1.0), (1, 1.0)):
        monkeypatch.setenv("RANK", str(rank))
        records.reset()
        distcheck.record("act", torch.linspace(0, 1, 5) * scale)
    records.reset()
    run = load_run(tmp_path)
    assert sorted(run) == [0, 1]
    resolved, findings = resolve_run(run, 2)
    assert not findings and resolved[("act", 0, 0)].mode == "replicated"
    assert json.loads(index_path(tmp_path, 1).read_text().splitlines()[0])["rank"] == 1


# -- automatic records (zero-code compare) ----------------------------------------------------------------------

def test_auto_records_carry_the_flag_and_the_given_site(recording):
    w = nn.Linear(2, 1)
    records.record_auto(records.AUTO_LOSS, torch.tensor(0.5), 0, "/src/train.py", 41, replicated=False)
    records.record_auto(records.AUTO_PARAMS, [("module.weight", w.weight), ("module.bias", w.bias)], 0,
                        "/src/train.py", 42)
    distcheck.record("loss", torch.tensor(0.5))
    lines = [json.loads(x) for x in index_path(recording, 0).read_text().splitlines()]
    assert [x.get("auto") for x in lines] == [True, True, None]  # explicit index lines are unchanged
    loss, params, explicit = load_rank(recording, 0)
    assert loss.auto and params.auto and not explicit.auto
    assert (loss.site, params.site) == ("train.py:41", "train.py:42") and loss.replicated is False
    assert params.kind == "module" and [(p.key, p.role) for p in params.parts] == [("weight", "parameter"),
                                                                                   ("bias", "parameter")]
    assert torch.equal(params.parts[0].value, w.weight.detach())


@pytest.mark.parametrize("text, steps", [("3", 3), ("", 0), ("x", 0), ("-1", 0)])
def test_auto_steps_from_the_environment(monkeypatch, text, steps):
    monkeypatch.setenv(records.ENV_AUTO_STEPS, text)
    assert records.auto_steps() == steps


def auto(name, step, value, rank=0, seq=0, line=41):
    return rec(name, step, value, rank=rank, seq=seq, line=line, auto=True)


def test_auto_records_are_compared_and_marked_when_nothing_is_recorded_explicitly():
    ref = {0: [auto("auto/loss", 0, 1.0), auto("auto/params", 0, [1.0, 2.0], seq=1, line=42)]}
    run = {r: [auto("auto/loss", 0, 1.0 + 0.2 * (1 - 2 * r), rank=r),
               auto("auto/params", 0, [1.0, 2.0], rank=r, seq=1, line=42)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.ok and [(row.name, row.auto) for row in result.rows] == [("auto/loss", True), ("auto/params", True)]
    assert result.rows[0].mode == "mean of 2 ranks"
    js = result.rows[0].to_json()
    assert js["auto"] is True and js["recorded"] == "recorded automatically" and js["site"] == "train.py:41"
    table = render_table(result.rows).splitlines()
    assert table[1].endswith("mean of 2 ranks, recorded automatically") and table[2].endswith(
        "recorded automatically")
    assert table[-2].startswith("recorded automatically (the script records nothing itself): auto/loss = the loss")


def test_explicit_records_take_precedence_over_auto_ones():
    # Explicit records only in the reference (the N-rank run crashed before its first): auto ones are dropped in
    # both runs, so the N-rank run is reported as missing 'loss', not compared on values the reference lacks.
    ref = {0: [auto("auto/loss", 0, 1.0), rec("loss", 0, 1.0, seq=1)]}
    run = {0: [auto("auto/loss", 0, 5.0)]}
    result = compare_runs(ref, run, 2)
    assert [(row.name, row.status) for row in result.rows] == [("loss", STATUS_MISSING_RUN)]
    assert [f.detail["name"] for f in result.findings] == ["loss"]
    # Same records without the explicit one: the automatic loss is compared, and differs.
    (f,) = compare_runs({0: [auto("auto/loss", 0, 1.0)]}, run, 2).findings
    assert f.detail["name"] == "auto/loss" and f.detail["auto"] is True
    assert "recorded automatically" not in render_table(result.rows)
    assert "auto" not in result.rows[0].to_json()


def test_auto_loss_one_over_n_names_the_loss_reduction_and_the_backward_line():
    ref = {0: [auto("auto/loss", 0, 6.0)]}
    run = {r: [auto("auto/loss", 0, 3.0, rank=r)] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.kind == "reference_mismatch" and f.ranks == [0, 1] and f.detail["line"] == 41
    assert f.message.startswith("step 0: the loss passed to backward() at train.py:41 (recorded automatically as "
                                "'auto/loss') differs")
    assert "the loss is 1/2 of the reference" in f.message and "reduction='sum'" in f.message
    assert "divided by the world size once too often" not in f.message
    # an explicitly recorded loss at 1/N (a logged copy) keeps the generic hint
    (g,) = compare_runs({0: [rec("loss", 0, 6.0)]}, {0: [rec("loss", 0, 3.0)]}, 2).findings
    assert "1/2 of the reference" in g.message and "reduction='sum'" not in g.message


def test_auto_params_mismatch_names_the_parameter_and_the_step_line():
    def params(rank, bias):
        w, b = torch.tensor([1.0, 2.0]), torch.tensor([bias])
        return Record("auto/params", 0, 0, rank, "module", [Part("0.weight", "parameter", w, w.dtype),
                                                            Part("0.bias", "parameter", b, b.dtype)],
                      True, file="/src/train.py", line=43, auto=True)

    (f,) = compare_runs({0: [params(0, 0.5)]}, {r: [params(r, 1.0)] for r in (0, 1)}, 2).findings
    assert f.detail["part"] == "0.bias" and f.detail["line"] == 43 and f.detail["auto"] is True
    assert f.message.startswith("step 0: parameter '0.bias' after optimizer.step() at train.py:43 (recorded "
                                "automatically as 'auto/params') differs")
    assert "2x the reference" in f.message


# -- the loss convention, judged by the parameters ----------------------------------------------------------------

def params_rec(step, weight, rank=0, seq=1):
    w = torch.tensor(weight)
    return Record("auto/params", step, seq, rank, "module", [Part("0.weight", "parameter", w, w.dtype)], True,
                  file="/src/train.py", line=43, auto=True)


def dp_loss(step, value, rank, dp, seq=0):
    return rec("auto/loss", step, value, rank=rank, seq=seq, line=41, auto=True, dp=dp)


def test_a_global_token_count_loss_matches_as_the_sum_when_the_parameters_match():
    # Each rank: its own token-loss sum over the global token count, so the ranks' losses add up to the reference's.
    ref = {0: [auto("auto/loss", 0, 3.0), params_rec(0, [1.0, 2.0]),
               auto("auto/loss", 1, 2.0, seq=2), params_rec(1, [0.9, 1.8], seq=3)]}
    run = {r: [dp_loss(0, [1.25, 1.75][r], r, (r, 2)), params_rec(0, [1.0, 2.0], rank=r),
               dp_loss(1, [0.5, 1.5][r], r, (r, 2), seq=2), params_rec(1, [0.9, 1.8], rank=r, seq=3)]
           for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.ok and result.findings == [], [f.message for f in result.findings]
    losses = [row for row in result.rows if row.name == "auto/loss"]
    assert [(row.status, row.mode, row.convention) for row in losses] == [
        (STATUS_OK, "sum over the 2 data-parallel ranks", "sum")] * 2
    assert losses[0].to_json()["convention"] == "sum"
    c = result.conventions["auto/loss"]
    assert (c.how, c.step, c.proven_by) == ("sum", 0, ["auto/params"])
    assert c.to_json() == {"convention": "sum", "mode": "sum over the 2 data-parallel ranks", "step": 0,
                           "proven_by": ["auto/params"]}
    table = render_table(result.rows, result.conventions)
    assert ("loss convention: 'auto/loss' matches the reference as the sum over the 2 data-parallel ranks, not as "
            "their mean: each rank's loss is normalized by the global batch or token count, and 'auto/params' "
            "matches the reference at step 0") in table


def test_a_loss_summing_to_the_reference_is_still_explained_when_the_parameters_differ():
    # reduction="sum" over each rank's local batch under gradient averaging: the ranks' losses add up to the
    # reference's too, but every update is 1/2: the parameters say it is a bug, and the loss row explains it.
    ref = {0: [auto("auto/loss", 0, 6.0), params_rec(0, [1.0, 2.0])]}
    run = {r: [dp_loss(0, [2.0, 4.0][r], r, (r, 2)), params_rec(0, [1.5, 2.5], rank=r)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    f = result.findings[0]
    assert f.kind == "reference_mismatch" and f.detail["name"] == "auto/loss" and f.detail["mode"] == "mean of 2 ranks"
    assert "the loss is 1/2 of the reference" in f.message
    assert result.conventions == {} and "loss convention:" not in render_table(result.rows, result.conventions)
    assert [row.convention for row in result.rows] == ["", ""]


def test_the_mean_convention_is_named_and_wins_when_it_matches():
    ref = {0: [auto("auto/loss", 0, 1.5), params_rec(0, [1.0])]}
    run = {r: [dp_loss(0, [1.0, 2.0][r], r, (r, 2)), params_rec(0, [1.0], rank=r)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.ok and result.conventions["auto/loss"].how == "mean"
    assert result.rows[0].mode == "mean of 2 ranks" and result.rows[0].convention == "mean"
    assert ("loss convention: 'auto/loss' matches the reference as the mean of 2 ranks (each rank's loss is the mean "
            "over its own batch)") in render_table(result.rows, result.conventions)


def test_without_parameter_records_a_sum_proves_nothing():
    ref = {0: [auto("auto/loss", 0, 3.0)]}
    run = {r: [dp_loss(0, [1.0, 2.0][r], r, (r, 2))] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.detail["name"] == "auto/loss" and f.detail["mode"] == "mean of 2 ranks"


def grads_rec(grad, rank=0, seq=1):
    g = torch.tensor(grad)
    return Record("auto/grads", 0, seq, rank, "module", [Part("0.weight", "gradient", g, g.dtype)], True,
                  file="/src/train.py", line=43, auto=True)


def test_a_sum_is_proven_by_the_gradients_too():
    ref = {0: [auto("auto/loss", 0, 3.0), grads_rec([0.5, -1.0]), params_rec(0, [1.0, 2.0], seq=2)]}
    run = {r: [dp_loss(0, [1.25, 1.75][r], r, (r, 2)), grads_rec([0.5, -1.0], rank=r),
               params_rec(0, [1.0, 2.0], rank=r, seq=2)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.ok, [f.message for f in result.findings]
    assert result.conventions["auto/loss"].proven_by == ["auto/grads", "auto/params"]
    assert [(row.name, row.status) for row in result.rows] == [
        ("auto/loss", STATUS_OK), ("auto/grads", STATUS_OK), ("auto/params", STATUS_OK)]
    assert "auto/grads = every parameter's gradient at the first optimizer.step()" in render_table(result.rows)


def test_a_loss_divided_twice_under_adam_is_found_by_the_gradients():
    # loss = local mean / world size under gradient averaging: the ranks' losses add up to the reference's and Adam
    # makes the same updates from 1/2 of the gradients, so only the gradients show the bug.
    ref = {0: [auto("auto/loss", 0, 3.0), grads_rec([0.5, -1.0]), params_rec(0, [1.0, 2.0], seq=2)]}
    run = {r: [dp_loss(0, [1.25, 1.75][r], r, (r, 2)), grads_rec([0.25, -0.5], rank=r),
               params_rec(0, [1.0, 2.0], rank=r, seq=2)] for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.conventions == {} and "loss convention:" not in render_table(result.rows, result.conventions)
    assert [(row.name, row.status) for row in result.rows] == [
        ("auto/loss", STATUS_DIFF), ("auto/grads", STATUS_DIFF), ("auto/params", STATUS_OK)]
    (f,) = result.findings
    assert f.kind == "reference_mismatch" and f.ranks == [0, 1]
    assert (f.detail["name"], f.detail["part"], f.detail["part_role"], f.detail["line"]) == (
        "auto/grads", "0.weight", "gradient", 43)
    assert f.message.startswith("step 0: the gradient of parameter '0.weight' at the first optimizer.step() at "
                                "train.py:43 (recorded automatically as 'auto/grads') differs")
    assert "the gradients are 1/2 of the reference: they were divided twice" in f.message
    assert ("the ranks' losses match the reference as their sum over the 2 data-parallel ranks and the parameters "
            "match too, but the gradients do not") in f.message
    # the parameters differing too (SGD): the loss row explains it, as without gradient records
    run = {r: [dp_loss(0, [1.25, 1.75][r], r, (r, 2)), grads_rec([0.25, -0.5], rank=r),
               params_rec(0, [1.5, 2.5], rank=r, seq=2)] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert f.detail["name"] == "auto/loss" and "but the parameters do not" in f.message


def test_the_mean_convention_needs_the_gradients_to_match():
    ref = {0: [auto("auto/loss", 0, 1.5), grads_rec([0.5]), params_rec(0, [1.0], seq=2)]}
    run = {r: [dp_loss(0, [1.0, 2.0][r], r, (r, 2)), grads_rec([1.0], rank=r), params_rec(0, [1.0], rank=r, seq=2)]
           for r in (0, 1)}
    result = compare_runs(ref, run, 2)
    assert result.conventions == {}
    (f,) = result.findings
    assert f.detail["name"] == "auto/grads" and "2x the reference" in f.message
    assert "the loss matches the reference at step 0 but the gradients do not" in f.message
    run = {r: [dp_loss(0, [1.0, 2.0][r], r, (r, 2)), grads_rec([0.5], rank=r), params_rec(0, [1.0], rank=r, seq=2)]
           for r in (0, 1)}
    assert compare_runs(ref, run, 2).conventions["auto/loss"].how == "mean"


def test_on_a_2d_mesh_the_sum_is_over_the_data_parallel_ranks_only():
    # dp=2 x tp=2: ranks 0-1 (dp index 0) hold loss a, ranks 2-3 (dp index 1) loss b; the reference's is a + b.
    ref = {0: [auto("auto/loss", 0, 3.0), params_rec(0, [1.0])]}
    values, dps = [1.25, 1.25, 1.75, 1.75], [(0, 2), (0, 2), (1, 2), (1, 2)]
    run = {r: [dp_loss(0, values[r], r, dps[r]), params_rec(0, [1.0], rank=r)] for r in range(4)}
    result = compare_runs(ref, run, 4)
    assert result.ok, [f.message for f in result.findings]
    assert result.rows[0].mode == "sum over the 2 data-parallel ranks (mean of each one's 2 ranks)"
    # Without the coordinates the 4 values would sum to twice the reference: no convention fits, a finding.
    run = {r: [dp_loss(0, values[r], r, None), params_rec(0, [1.0], rank=r)] for r in range(4)}
    assert [f.detail["name"] for f in compare_runs(ref, run, 4).findings] == ["auto/loss"]


def test_the_data_parallel_coordinate_round_trips_through_the_files(recording):
    records.record_auto(records.AUTO_LOSS, torch.tensor(0.5), 0, "/src/train.py", 41, replicated=False, dp=(1, 2))
    records.record_auto(records.AUTO_LOSS, torch.tensor(0.5), 1, "/src/train.py", 41, replicated=False)
    with_dp, without = load_rank(recording, 0)
    assert with_dp.dp == (1, 2) and without.dp is None


# -- complex tensors ----------------------------------------------------------------------------------------------

def test_complex_records_compare_both_parts_without_a_warning():
    import warnings

    freqs = torch.polar(torch.ones(4, 3), torch.arange(12.0).reshape(4, 3))  # a RoPE buffer
    conj = freqs.conj().resolve_conj()  # the same real parts: a real-only comparison would call it equal

    def model(rank, buf):
        return Record("model", 0, 0, rank, "module", [Part("freqs_cis", "buffer", buf, buf.dtype)], True,
                      file="train.py", line=20)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards the imaginary part"
        assert compare_runs({0: [model(0, freqs)]}, {r: [model(r, freqs)] for r in (0, 1)}, 2).ok
        result = compare_runs({0: [model(0, freqs)]}, {r: [model(r, conj)] for r in (0, 1)}, 2)
        (f,) = result.findings
        assert f.detail["part"] == "freqs_cis" and f.detail["index"] == [3, 2]  # angle 11: |2 sin| is largest
        assert f.detail["value_imag"] == pytest.approx(-f.detail["reference_imag"])
        assert "j vs reference" in f.message
        json.dumps(f.detail)  # JSON numbers only
        # per-rank complex values are averaged as complex numbers; a replica that differs is named
        mean = compare_runs({0: [rec("z", 0, 0.0)]}, {0: [model(0, freqs)], 1: [model(1, conj)]}, 2)
        (div,) = [f for f in mean.findings if f.kind == "tensor_divergence"]
        assert div.ranks == [0, 1] and div.detail["name"] == "freqs_cis"


def test_a_sum_that_matches_while_the_parameters_differ_says_the_gradients_must_be_summed():
    ref = {0: [auto("auto/loss", 0, 6.0), params_rec(0, [1.0, 2.0])]}
    run = {r: [dp_loss(0, [2.0, 4.0][r], r, (r, 2)), params_rec(0, [1.5, 2.5], rank=r)] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert ("the ranks' losses match the reference as their sum over the 2 data-parallel ranks, but the parameters "
            "do not") in f.message and "set_gradient_divide_factor(1.0)" in f.detail["hints"][-1]
    run = {r: [dp_loss(0, [2.0, 3.0][r], r, (r, 2)), params_rec(0, [1.5, 2.5], rank=r)] for r in (0, 1)}
    (f,) = compare_runs(ref, run, 2).findings
    assert "match the reference as their sum" not in f.message


def test_parameter_names_a_wrapper_prefixed_on_one_side_are_matched():
    """Lightning: the N-rank run names parameters from the LightningModule ('net.0.weight'), the reference from the
    module that ran ('0.weight'); a prefix on every name of one side is no difference, a real difference still is."""
    from distcheck.analysis.record_compare import aligned_parts

    ref, run = {"0.weight": 1, "0.bias": 2}, {"net.0.weight": 1, "net.0.bias": 2}
    assert aligned_parts(ref, run) == (ref, {"0.weight": 1, "0.bias": 2})
    assert aligned_parts(run, ref) == ({"0.weight": 1, "0.bias": 2}, ref)
    other = {"net.0.weight": 1, "net.1.bias": 2}
    assert aligned_parts(ref, other) == (ref, other)  # not only a prefix: reported as today
    assert aligned_parts({"a.x": 1, "b.x": 2}, {"x": 1}) == ({"a.x": 1, "b.x": 2}, {"x": 1})


def test_accumulated_micro_batch_losses_compare_as_the_steps_sum():
    """Gradient accumulation: the micro-batches hold other rows at each world size, so each one's loss differs;
    the step's sum is the same computation in both runs (fixtures/ok/ddp_no_sync_accumulation.py)."""
    def auto_loss(step, value, rank=0, seq=0):
        return rec("auto/loss", step, value, rank=rank, seq=seq, auto=True)

    ref = {0: [auto_loss(0, 0.30, seq=0), auto_loss(0, 0.34, seq=1)]}  # rows 0-3, rows 4-7 (each / 2)
    run = {0: [auto_loss(0, 0.31, 0, 0), auto_loss(0, 0.30, 0, 1)],  # rank 0: rows 0-1, 2-3
           1: [auto_loss(0, 0.35, 1, 0), auto_loss(0, 0.32, 1, 1)]}  # rank 1: rows 4-5, 6-7
    result = compare_runs(ref, run, 2)
    assert result.findings == [] and [r.key for r in result.rows] == [("auto/loss", 0, 0)]
    assert compare_runs(ref, {0: run[0], 1: [auto_loss(0, 0.7, 1, 0), auto_loss(0, 0.7, 1, 1)]}, 2).findings


def test_initial_parameters_that_differ_say_where_the_runs_start_and_name_shards_drawn_alike():
    from types import SimpleNamespace

    from distcheck.analysis.record_explain import init_hints

    torch.manual_seed(0)
    ref = torch.randn(8, 4)
    alike = torch.cat([ref[:4], ref[:4]])  # both ranks drew their shard from the same state
    [said, dtensor] = init_hints(SimpleNamespace(part="w", actual=alike, expected=ref), 2)
    assert said.startswith("the runs start from different parameters: parameter 'w' already differs before the "
                           "first optimizer.step()")
    assert dtensor.startswith("its 2 shards along dim 0 hold the same values") and "CPU mesh" in dtensor
    other = torch.randn(8, 4)  # another seed: differs, shards unlike
    assert len(init_hints(SimpleNamespace(part="w", actual=other, expected=ref), 2)) == 1
    zeros = torch.zeros(8, 4)  # zero-initialized shards are alike in either run: no random state to blame
    assert len(init_hints(SimpleNamespace(part="w", actual=zeros, expected=ref), 2)) == 1
