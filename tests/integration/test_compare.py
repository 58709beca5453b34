"""Integration tests of ``distcheck compare``: real gloo ranks (1 and 2) on the cmp_* fixtures, exit codes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distcheck.analysis.module_diff import first_divergent_module
from distcheck.contract.autocheck_file import read_all as load_autocheck_states
from launch_helpers import FIXTURES, distcheck, load_report


def compare(tmp_path: Path, fixture: str, nproc: str = "2", extra: list[str] | None = None):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", nproc, "--timeout", "60", "--report-dir", str(out), *(extra or []), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out), out


def kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


@pytest.mark.parametrize("fixture", ["cmp_ddp_ok.py", "cmp_fsdp2_ok.py", "cmp_tp_ok.py"])
def test_correct_scripts_compare_equal(tmp_path, fixture):
    res, report, out = compare(tmp_path, fixture)
    assert res.returncode == 0, res.output
    assert report["ok"] and report["findings"] == [] and report["world_size"] == 2
    rows = report["records"]["2"]
    assert [(r["name"], r["step"]) for r in rows] == [("loss", 0), ("model", 0), ("loss", 1), ("model", 1)]
    assert all(r["status"] == "ok" for r in rows)
    assert (out / "nproc2" / "records-rank1.jsonl").exists() and (out / "reference" / "trace-rank0.jsonl").exists()
    assert "records: 2 ranks vs the 1-rank reference" in (out / "report.txt").read_text()
    # The per-module summaries of the first step map onto the reference (DDP/FSDP2 batch slices, TP shards and
    # replicated outputs) and match: nothing to name, nothing ambiguous.
    diff, notes = first_divergent_module(load_autocheck_states(out / "reference"), load_autocheck_states(out / "nproc2"))
    assert diff is None and notes == [], (diff, notes)
    assert load_autocheck_states(out / "nproc2")[1]["modules"], "no module was summarized"


@pytest.mark.parametrize("fixture,side,module,cls,marker,how", [
    ("cmp_batch_stat_norm.py", "forward", "2", "BatchStatNorm", "# NORM", "cat"),
    ("cmp_tp_wrong_plan.py", "forward", "norm", "LayerNorm", "# PLANNED", "sum"),
    ("cmp_backward_skips_allreduce.py", "backward", "col", "ColumnParallelLinear", "# COL", "same"),
])
def test_the_first_divergent_module_is_named(line_of, tmp_path, fixture, side, module, cls, marker, how):
    """The loss differs from the reference: compare names the module whose output (or input gradient) first does."""
    res, report, _ = compare(tmp_path, fixture)
    assert res.returncode == 1, res.output
    [f] = [f for f in report["findings"] if f["kind"] == "reference_mismatch"]
    m = f["detail"]["module"]
    assert (m["name"], m["class"], m["side"], m["mapping"]) == (module, cls, side, how)
    assert m["line"] == line_of(fixture, marker) and m["file"].endswith(fixture)
    what = "output" if side == "forward" else "gradient w.r.t. its input"
    assert f"First module whose {what} differs from the 1-rank reference in the first step: '{module}' ({cls}, " \
           f"{m['site_kind']} at {fixture}:{m['line']})" in f["message"]
    if side == "forward":  # its input matched: the module itself computes something else
        assert m["input_matches"] is True and "this module itself computes something else" in f["message"]
    else:
        assert m["scale"] == 1.0 and "every module's output matched in forward" in f["message"]
    # The second look (one more run of each world size, saving only that module): the element-wise error.
    if fixture == "cmp_tp_wrong_plan.py":  # the DTensor says the norm's output is a sequence twice as long
        assert m["element"] is None and "the reassembled [2, 8, 16] does not have the reference's shape [2, 4, 16]" \
            in f["message"]
    else:
        e = m["element"]
        assert e["max_abs"] > 0.01 and len(e["index"]) == 2 and "element-wise (a second run" in f["message"]
        assert f"max abs error {e['max_abs']:.3g}" in f["message"]


def test_loss_summed_with_several_world_sizes(line_of, tmp_path):
    res, report, out = compare(tmp_path, "cmp_loss_sum.py", nproc="1,2")
    assert res.returncode == 1, res.output
    assert sorted(report["runs"]) == ["1", "2", "reference"] and report["world_size"] == 2
    # Every run completed (else no records to compare); once under load one did not, with nothing said why.
    assert sorted(report["records"]) == ["1", "2"], res.output + json.dumps(report["findings"], indent=1)
    assert [r["status"] for r in report["records"]["1"]] == ["ok"] * 4  # a second 1-rank run: deterministic
    assert kinds(report) == ["reference_mismatch"]
    (f,) = report["findings"]
    line = line_of("cmp_loss_sum.py", 'distcheck.record("loss"')
    assert f["ranks"] == [0, 1] and f["detail"]["name"] == "loss" and f["detail"]["step"] == 0
    assert f["detail"]["nproc"] == 2 and f["detail"]["line"] == line and f"cmp_loss_sum.py:{line}" in f["message"]
    assert "2x the reference" in f["message"] and f["detail"]["rel_err"] == pytest.approx(1.0, rel=1e-3)
    assert [r["status"] for r in report["records"]["2"] if r["name"] == "model"] == ["ok", "ok"]
    assert "reference_mismatch" in res.stdout


def test_gradients_summed_not_divided(line_of, tmp_path):
    res, report, _ = compare(tmp_path, "cmp_grad_sum.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("cmp_grad_sum.py", 'distcheck.record("model"')
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1]
    assert f["detail"]["name"] == "model" and f["detail"]["step"] == 0 and f["detail"]["line"] == line
    assert f["detail"]["part"] == "0.weight.grad" and f["detail"]["part_role"] == "gradient"
    assert "2x the reference" in f["message"] and "the loss matches the reference at step 0" in f["message"]


def test_whole_batch_with_per_rank_loss_scale(line_of, tmp_path):
    res, report, _ = compare(tmp_path, "cmp_whole_batch.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("cmp_whole_batch.py", 'distcheck.record("loss"')
    assert f["kind"] == "reference_mismatch" and f["detail"]["name"] == "loss" and f["detail"]["line"] == line
    assert "1/2 of the reference" in f["message"]


def test_dropout_rng_per_rank(line_of, tmp_path):
    res, report, _ = compare(tmp_path, "cmp_dropout_rng.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("cmp_dropout_rng.py", 'distcheck.record("loss"')
    assert f["kind"] == "reference_mismatch" and f["detail"]["name"] == "loss" and f["detail"]["step"] == 0
    assert f["detail"]["line"] == line and "forward pass differs" in f["message"]
    assert "x the reference" not in f["message"] and "of the reference" not in f["message"]


def test_unsynchronized_replicas_are_tensor_divergence(line_of, tmp_path):
    res, report, _ = compare(tmp_path, "cmp_no_grad_sync.py")
    assert res.returncode == 1, res.output
    (div,) = [f for f in report["findings"] if f["kind"] == "tensor_divergence"]
    line = line_of("cmp_no_grad_sync.py", 'distcheck.record("model"')
    assert div["ranks"] == [0, 1] and div["detail"]["name"] == "0.weight.grad" and div["detail"]["step"] == 0
    assert div["detail"]["line"] == line and f"cmp_no_grad_sync.py:{line}" in div["message"]
    assert "reference_mismatch" in kinds(report)


@pytest.mark.parametrize("args, message", [
    (["--nproc", "2,x", "--", str(FIXTURES / "cmp_ddp_ok.py")], "--nproc '2,x'"),
    (["--nproc", "0", "--", str(FIXTURES / "cmp_ddp_ok.py")], "--nproc '0'"),
    (["--nproc", "2", "--rtol", "-1", "--", str(FIXTURES / "cmp_ddp_ok.py")], "--rtol '-1'"),
    (["--nproc", "2", "--atol", "nan", "--", str(FIXTURES / "cmp_ddp_ok.py")], "--atol 'nan'"),
    (["--nproc", "2", "--steps", "0", "--", str(FIXTURES / "cmp_ddp_ok.py")], "--steps '0'"),
    (["--nproc", "2", "--", "no_such_script.py"], "does not exist"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    res = distcheck(["compare", "--report-dir", str(tmp_path / "r"), *args], timeout=60)
    assert res.returncode == 2, res.output
    assert message in res.stderr and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_hang_in_the_n_rank_run_names_the_odd_rank_and_its_line(line_of, tmp_path):
    """compare supervises its runs exactly like run: a hang is diagnosed from every rank's stack."""
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", "2", "--timeout", "5", "--report-dir", str(out), "--",
                     str(FIXTURES / "hang_python.py")], timeout=180)
    assert res.returncode == 1, res.output
    report = load_report(out)
    (f,) = [f for f in report["findings"] if f["kind"] == "hang"]
    sleep_line, wait_line = line_of("hang_python.py", "time.sleep(3600)"), line_of("hang_python.py", "dist.all_reduce")
    assert f["ranks"] == [1] and f["detail"]["line"] == sleep_line
    assert f["message"].startswith("2-rank run: no progress for 5s: ")
    assert (f"rank 1 is in load_shard (hang_python.py:{sleep_line}) while rank 0 waits in all_reduce #2 "
            f"(hang_python.py:{wait_line})") in f["message"]
    assert set(f["detail"]["stacks"]) == {"0", "1"}
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["reference run (1 rank)"]["ok"] and not checks["2-rank run"]["ok"]
    assert not checks["compare 2 ranks vs reference"]["ok"]
    assert "did not complete" in checks["compare 2 ranks vs reference"]["note"] and "records" not in checks
    assert report["artifacts"]["nproc2/stacks.txt"] == "nproc2/stacks.txt" and (out / "nproc2" / "stacks.txt").exists()


def test_a_script_that_records_nothing_is_bad_input(tmp_path):
    """No distcheck.record call, no backward() or optimizer.step() to record by itself: nothing to compare."""
    out = tmp_path / "report"
    script = tmp_path / "no_model.py"
    script.write_text("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "t = torch.ones(4)\ndist.all_reduce(t)\ndist.destroy_process_group()\n")
    res = distcheck(["compare", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), "--", str(script)],
                    timeout=240)
    assert res.returncode == 2, res.output
    assert res.stderr.strip().splitlines()[-1].startswith("distcheck: error: nothing to compare: nothing was recorded")
    assert "Traceback" not in res.stderr
