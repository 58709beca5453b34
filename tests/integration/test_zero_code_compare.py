"""Zero-code compare: ``distcheck compare`` on scripts with no ``distcheck.record`` call, on real gloo ranks (1,
then 2 or 4) on the zc_cmp_* fixtures (the hooks in-process: tests/unit/test_auto_records.py)."""
from __future__ import annotations

import pytest
from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.analysis.module_diff import search_modules
from distcheck.analysis.record_values import load_rank
from distcheck.contract.autocheck_file import read_all as load_autocheck_states


def compare(tmp_path, fixture: str, extra: list[str] | None = None, nproc: int = 2):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", str(nproc), "--timeout", "60", "--report-dir", str(out), *(extra or []),
                     "--", str(FIXTURES / fixture)], timeout=300)
    return res, load_report(out), out


def test_unmodified_fsdp2_script_compares_equal(line_of, tmp_path):
    res, report, out = compare(tmp_path, "zc_cmp_fsdp2_ok.py")
    assert res.returncode == 0, res.output
    assert report["ok"] and report["findings"] == []
    rows = report["records"]["2"]
    # 4 training steps, the default K = 3 recorded; the initial parameters and the gradients at the first step only
    assert [(r["name"], r["step"]) for r in rows] == [("auto/loss", 0), ("auto/init", 0), ("auto/grads", 0),
                                                      ("auto/params", 0)] + [
        (n, s) for s in (1, 2) for n in ("auto/loss", "auto/params")]
    assert all(r["status"] == "ok" and r["auto"] and r["recorded"] == "recorded automatically" for r in rows)
    backward, step = line_of("zc_cmp_fsdp2_ok.py", "loss.backward()"), line_of("zc_cmp_fsdp2_ok.py", "opt.step()")
    assert {r["site"] for r in rows if r["name"] == "auto/loss"} == {f"zc_cmp_fsdp2_ok.py:{backward}"}
    assert {r["site"] for r in rows if r["name"] in ("auto/params", "auto/grads", "auto/init")} == \
        {f"zc_cmp_fsdp2_ok.py:{step}"}
    assert {r["mode"] for r in rows if r["name"] == "auto/loss"} == {"mean of 2 ranks"}  # each rank's own loss
    assert {r["convention"] for r in rows if r["name"] == "auto/loss"} == {"mean"}
    assert report["loss_conventions"]["2"]["auto/loss"]["convention"] == "mean"
    assert report["recorded_automatically"] == {"2": ["auto/grads", "auto/init", "auto/loss", "auto/params"]}
    # Parameters are FSDP2 shards in the ranks: recorded gathered to full tensors, under the model's names.
    for rank in (0, 1):
        params = [r for r in load_rank(out / "nproc2", rank) if r.name == "auto/params"]
        assert [r.step for r in params] == [0, 1, 2] and all(r.auto for r in params)
        assert [(p.key, tuple(p.value.shape)) for p in params[0].parts] == [
            ("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (1, 16)), ("2.bias", (1,))]
        (grads,) = [r for r in load_rank(out / "nproc2", rank) if r.name == "auto/grads"]
        assert [(p.key, p.role, tuple(p.value.shape)) for p in grads.parts] == [
            (p.key, "gradient", tuple(p.value.shape)) for p in params[0].parts]
    text = (out / "report.txt").read_text()
    assert "auto/loss = the loss passed to backward()" in text and "recorded automatically" in text
    assert "the script recorded nothing" not in text and "nothing was recorded" not in text


def test_loss_summed_over_local_batch_is_reference_mismatch(line_of, tmp_path):
    res, report, out = compare(tmp_path, "zc_cmp_loss_sum.py", ["--steps", "2"])
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("zc_cmp_loss_sum.py", "loss.backward()")
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1]
    detail = f["detail"]
    assert detail["name"] == "auto/loss" and detail["step"] == 0 and detail["auto"] is True
    assert detail["line"] == line and detail["file"].endswith("zc_cmp_loss_sum.py")
    assert f["message"].startswith(f"step 0: the loss passed to backward() at zc_cmp_loss_sum.py:{line} "
                                   f"(recorded automatically as 'auto/loss') differs")
    assert "the loss is 1/2 of the reference" in f["message"] and detail["rel_err"] == pytest.approx(0.5, rel=1e-3)
    rows = report["records"]["2"]
    assert [(r["name"], r["step"]) for r in rows] == [("auto/loss", 0), ("auto/init", 0), ("auto/grads", 0),
                                                      ("auto/params", 0), ("auto/loss", 1), ("auto/params", 1)]
    params = [r for r in rows if r["name"] == "auto/params"]
    step = line_of("zc_cmp_loss_sum.py", "opt.step()")
    assert [r["status"] for r in params] == ["MISMATCH"] * 2 and params[0]["site"] == f"zc_cmp_loss_sum.py:{step}"
    assert "reference_mismatch" in res.stdout
    # The ranks' losses add up to the reference's, but the parameters differ: no convention excuses the loss.
    assert report["loss_conventions"] == {} and "loss convention:" not in (out / "report.txt").read_text()
    assert ("the ranks' losses match the reference as their sum over the 2 data-parallel ranks, but the parameters "
            "do not") in f["message"]


def test_a_loss_over_the_global_token_count_is_judged_by_the_parameters(line_of, tmp_path):
    res, report, out = compare(tmp_path, "zc_cmp_global_tokens.py")
    assert res.returncode == 0, res.output
    assert report["ok"] and report["findings"] == []
    losses = [r for r in report["records"]["2"] if r["name"] == "auto/loss"]
    assert [(r["status"], r["mode"], r["convention"]) for r in losses] == [
        ("ok", "sum over the 2 data-parallel ranks", "sum")] * 3
    assert losses[0]["site"] == f"zc_cmp_global_tokens.py:{line_of('zc_cmp_global_tokens.py', 'loss.backward()')}"
    assert report["loss_conventions"] == {"2": {"auto/loss": {
        "convention": "sum", "mode": "sum over the 2 data-parallel ranks", "step": 0,
        "proven_by": ["auto/grads", "auto/params"]}}}
    assert ("loss convention: 'auto/loss' matches the reference as the sum over the 2 data-parallel ranks, not as "
            "their mean") in (out / "report.txt").read_text()


def test_a_loss_divided_twice_under_adam_is_found_by_the_gradients(line_of, tmp_path):
    """Adam makes the 1-rank updates from 1/2 of the gradients: the parameters match, the gradients do not."""
    fixture = "zc_cmp_adam_divided_twice.py"
    res, report, out = compare(tmp_path, fixture)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    step = line_of(fixture, "opt.step()")
    detail = f["detail"]
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1]
    assert (detail["name"], detail["step"], detail["part_role"], detail["line"]) == ("auto/grads", 0, "gradient", step)
    assert detail["file"].endswith(fixture) and detail["rel_err"] == pytest.approx(0.5, rel=1e-3)
    assert f["message"].startswith(f"step 0: the gradient of parameter '{detail['part']}' at the first "
                                   f"optimizer.step() at {fixture}:{step} (recorded automatically as 'auto/grads')")
    assert "the gradients are 1/2 of the reference: they were divided twice" in f["message"]
    assert ("the ranks' losses match the reference as their sum over the 2 data-parallel ranks and the parameters "
            "match too") in f["message"]
    rows = report["records"]["2"]
    assert [(r["name"], r["status"]) for r in rows if r["step"] == 0] == [
        ("auto/loss", "MISMATCH"), ("auto/init", "ok"), ("auto/grads", "MISMATCH"), ("auto/params", "ok")]
    assert report["loss_conventions"] == {} and "loss convention:" not in (out / "report.txt").read_text()


def test_a_2d_mesh_compares_equal_with_the_sum_over_data_parallel_ranks(tmp_path):
    """dp=2 x tp=2: the losses are [a, a, b, b] with a + b the reference's; the modules map slice by slice."""
    res, report, out = compare(tmp_path, "zc_cmp_2d_ok.py", nproc=4)
    assert res.returncode == 0, res.output
    assert report["ok"] and report["findings"] == [] and report["world_size"] == 4
    rows = report["records"]["4"]
    assert all(r["status"] == "ok" for r in rows) and len(rows) == 8
    assert {r["mode"] for r in rows if r["name"] == "auto/loss"} == {
        "sum over the 2 data-parallel ranks (mean of each one's 2 ranks)"}
    assert "loss convention: 'auto/loss' matches the reference as the sum over the 2 data-parallel ranks" in \
        (out / "report.txt").read_text()
    ref, nrank = load_autocheck_states(out / "reference"), load_autocheck_states(out / "nproc4")
    assert [row.get("dp") for row in nrank[2]["modules"]] == [[1, 2]] * len(nrank[2]["modules"])
    found = search_modules(ref, nrank)  # every module mapped (batch slices along dp, TP shards by placements)
    assert (found.diff, found.notes) == (None, []) and found.compared == 8


def test_a_2d_mesh_bug_names_the_module(line_of, tmp_path):
    fixture = "zc_cmp_2d_norm_on_shard.py"
    res, report, out = compare(tmp_path, fixture, ["--steps", "1"], nproc=4)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1, 2, 3]
    assert f["detail"]["name"] == "auto/loss" and f["detail"]["line"] == line_of(fixture, "loss.backward()")
    m = f["detail"]["module"]
    assert (m["name"], m["class"], m["side"], m["mapping"], m["ranks"]) == ("norm", "HiddenNorm", "forward",
                                                                           "cat/sum", [0, 1, 2, 3])
    assert m["line"] == line_of(fixture, "# NORM") and m["file"].endswith(fixture) and m["input_matches"] is True
    assert f"'norm' (HiddenNorm, forward at {fixture}:{m['line']})" in f["message"]
    assert "compared as the data-parallel ranks' batch slices in order, each slice its tensor-parallel shards " \
        "added up" in f["message"] and "Every module" not in f["message"]
    assert "module_notes" not in f["detail"]
    assert m["element"]["max_abs"] > 0.01  # the second look reassembled the 2-D shards


def test_runs_that_start_from_different_parameters_say_so_and_name_dtensors_cpu_init(line_of, tmp_path):
    """Sharded on the meta device, then initialized: on a CPU mesh both shards of each weight hold the same values.
    The finding is the initial parameters, before the first step, not the loss or the gradient reduction."""
    fixture = "cmp_meta_init_cpu_mesh.py"
    res, report, _ = compare(tmp_path, fixture)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    detail = f["detail"]
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1]
    assert (detail["name"], detail["step"], detail["part"]) == ("auto/init", 0, "embed.weight")
    assert detail["file"].endswith(fixture) and detail["line"] == line_of(fixture, "opt.step()")
    assert f["message"].startswith(f"step 0: parameter 'embed.weight' before the first optimizer.step() at "
                                   f"{fixture}:{detail['line']} (recorded automatically as 'auto/init')")
    assert "the runs start from different parameters" in f["message"]
    assert "its 2 shards along dim 0 hold the same values in the 2-rank run" in f["message"]
    assert "DTensor's random init on a CPU mesh" in f["message"]
    assert "gradient reduction" not in f["message"]
