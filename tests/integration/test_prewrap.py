"""Issue 27: the model compared before it is parallelized, one finding per cause, mixed meshes as a warning, a
frozen model. Each fixture is an unmodified script; its docstring holds the command and the expected report."""
from __future__ import annotations

import pytest
from launch_helpers import FIXTURES, distcheck, load_report


def run_fixture(tmp_path, fixture: str, nproc: int = 2):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", str(nproc), "--timeout", "90", "--report-dir", str(out), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out), out


@pytest.mark.parametrize("fixture,nproc,params", [
    ("zc_rank_seeded_fsdp2.py", 2, ["0.fc.weight", "0.fc.bias", "1.fc.weight", "1.fc.bias", "2.weight", "2.bias"]),
    ("zc_rank_seeded_2d.py", 4, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])])
def test_rank_seeded_init_is_one_finding_naming_the_seed_line(line_of, tmp_path, fixture, nproc, params):
    res, report, _ = run_fixture(tmp_path, fixture, nproc)
    assert res.returncode == 1, res.output
    [f] = report["findings"]
    assert f["kind"] == "tensor_divergence" and f["ranks"] == list(range(nproc))
    assert f["detail"]["params"] == params and f["detail"]["cause"] == "rank_seeded"
    seed = line_of(fixture, "torch.manual_seed(1234 + dist.get_rank())")
    assert f["detail"]["line"] == seed and f"{fixture}:{seed}" in f["message"]


def test_replicas_changed_after_ddp_say_where(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "zc_ddp_late_load.py")
    assert res.returncode == 1, res.output
    [f] = report["findings"]
    assert f["kind"] == "tensor_divergence" and f["detail"]["count"] == 4
    assert f["detail"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    built = line_of("zc_ddp_late_load.py", "model = DDP(")
    forward = line_of("zc_ddp_late_load.py", "model(torch.randn(4, 8))")
    assert f"identical at DistributedDataParallel's construction at zc_ddp_late_load.py:{built}" in f["message"]
    assert f"first forward at zc_ddp_late_load.py:{forward}" in f["message"]


def test_model_structure_is_named_before_torchs_size_error(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "zc_vocab_mismatch.py")
    assert res.returncode == 1, res.output
    [f] = [f for f in report["findings"] if f["kind"] == "tensor_divergence"]  # the RNG consequence is not another
    assert f["detail"]["cause"] == "structure" and f["detail"]["params"] == ["embed.weight"]
    line = line_of("zc_vocab_mismatch.py", "self.embed = nn.Embedding")
    assert f"embed.weight [39, 16] float32 on rank 0, [42, 16] float32 on rank 1, built at zc_vocab_mismatch.py:{line}" \
        in f["message"] and f["detail"]["line"] == line


def test_gradient_sync_never_switched_on_is_a_frozen_model(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "zc_fsdp2_sync_never_on.py")
    assert res.returncode == 1, res.output
    [f] = report["findings"]
    assert f["kind"] == "bad_values" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "gradient_sync_off"
    line = line_of("zc_fsdp2_sync_never_on.py", "model.set_requires_gradient_sync(False)")
    assert f["detail"]["line"] == line and f"zc_fsdp2_sync_never_on.py:{line}" in f["message"]


def test_mixed_meshes_in_a_correct_model_are_a_warning(tmp_path):
    res, report, out = run_fixture(tmp_path, "zc_tp_head_left_out_ok.py", 4)
    assert res.returncode == 0, res.output
    assert report["findings"] == []
    # once, though every rank found it; a straggler warning may join it when 4 ranks share 2 loaded cores
    [note] = [w for w in report["warnings"] if w["kind"] != "straggler"]
    assert note["kind"] == "mixed_meshes" and note["detail"]["params"] == ["head.weight", "head.bias"]
    assert "clip_grad_norm_" in note["message"] and "head.weight" in (out / "report.txt").read_text()


@pytest.mark.parametrize("fixture", [
    "zc_meta_rank0_load_ok.py",  # meta on rank 1 at fully_shard: structure only, never "missing"
    "zc_ddp_rank0_load_ok.py",  # values differ before DDP(...), whose construction broadcast makes them equal
    "zc_fsdp2_load_after_shard_ok.py"])  # rank-seeded init overwritten by a load after fully_shard
def test_correct_loading_patterns_pass(tmp_path, fixture):
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 0, res.output
    assert report["findings"] == []
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model_check"]["ok"]  # the model was checked (at the first forward), and found right


@pytest.mark.parametrize("fixture,params,cause,line_text,why", [
    # the plan scatters rank 0's fc1/fc2: only the head it leaves plain is per rank
    ("tp_seeded_head_left_plain.py", ["head.weight", "head.bias"], "rank_seeded",
     "torch.manual_seed(1234 + dist.get_rank())", "no ParallelStyle of the plan converts them"),
    ("tp_style_src_none.py", ["0.weight", "0.bias", "2.weight", "2.bias"], "src_data_rank_none",
     "parallelize_module(model, mesh, plan, src_data_rank=None)",
     "parallelize_module(..., src_data_rank=None) keeps each rank's local values")])
def test_tensor_parallel_init_follows_src_data_rank(line_of, tmp_path, fixture, params, cause, line_text, why):
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    [f] = report["findings"]  # the replicas' later drift follows from it: not a second finding
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1]
    assert f["detail"]["params"] == params and f["detail"]["cause"] == cause
    line = line_of(fixture, line_text)
    assert f["detail"]["line"] == line and f"{fixture}:{line}" in f["message"]
    call = line_of(fixture, "parallelize_module(model, mesh")
    assert f"parallelize_module at {fixture}:{call}" in f["message"] and why in f["message"]


def test_distribute_tensor_without_src_rank_of_different_tensors_is_caught_at_its_line(line_of, tmp_path):
    fixture = "dtensor_src_none_differs.py"
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    [f] = report["findings"]  # the second call's tensor (ones on every rank) agrees
    line = line_of(fixture, "proj = distribute_tensor(")
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1]
    assert f["detail"]["cause"] == "src_data_rank_none" and f["detail"]["line"] == line
    assert f"distribute_tensor(..., src_data_rank=None) at {fixture}:{line}" in f["message"]


def test_rank_seeded_fully_shard_says_why_fully_shard_does_not_fix_it(tmp_path):
    res, report, _ = run_fixture(tmp_path, "zc_rank_seeded_fsdp2.py")
    [f] = report["findings"]
    assert "fully_shard broadcasts nothing" in f["message"], f["message"]


def test_tp_ranks_fed_different_batches_are_named_at_the_forward_call(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "tp_input_per_rank.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("tp_input_per_rank.py", "model(inp).sum().backward()")
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "tp_input_differs"
    assert f["detail"]["line"] == line and f["detail"]["module"] == "in_proj" and f["detail"]["group"] == [0, 1]
    assert f["message"].startswith(f"ranks 0-1 (one TP group) fed 'in_proj' (ColwiseParallel, input Replicate) "
                                   f"different inputs at its first forward at tp_input_per_rank.py:{line}")
