"""Zero-code checks under `distcheck run` and the pytest marker: models found by themselves, bad_values.

Each fixture is an unmodified script (no distcheck call); see its docstring for the command and the expected report.
"""
from __future__ import annotations

import pytest
from launch_helpers import FIXTURES, distcheck, load_report, run_pytest


def run_fixture(tmp_path, fixture: str, *args: str):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), "--",
                     str(FIXTURES / fixture), *args], timeout=150)
    return res, load_report(out)


def test_meta_init_leaves_block_params_uninitialized(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "zc_meta_init.py")
    assert res.returncode == 1, res.output
    # One finding for one cause, however many parameters it left uninitialized.
    [group] = [f for f in report["findings"] if f["kind"] == "bad_values" and f["detail"].get("when") == "first forward"]
    # Only the blocks' parameters: init_weights() did initialize the embedding and the head.
    blocks = [f"blocks.{b}.{fc}.{p}" for b in (0, 1) for fc in ("fc1", "fc2") for p in ("weight", "bias")]
    # All 8: the fixture makes every allocation of to_empty() hold leftover bytes (glibc's M_PERTURB).
    params = group["detail"]["params"]
    assert params == blocks and group["detail"]["count"] == 8
    assert [t["param"] for t in group["detail"]["tensors"]] == params and group["ranks"] == [0, 1]
    fc1, fc2 = line_of("zc_meta_init.py", "self.fc1 = nn.Linear"), line_of("zc_meta_init.py", "self.fc2 = nn.Linear")
    assert group["detail"]["line"] == fc1 and group["detail"]["file"].endswith("zc_meta_init.py")
    message = group["message"]
    assert message.startswith(f"{len(params)} parameters of nn.Linear layers hold values no initializer produces")
    assert ", ".join(f"'{p}'" for p in params[:3]) + f" (+{len(params) - 3} more)" in message
    assert f"Created at zc_meta_init.py:{fc1}, zc_meta_init.py:{fc2}" in message
    assert "nn.Linear.reset_parameters() gives [-0.17" in message and "differ between world sizes and runs" in message
    assert "Error" not in message  # no internal exception text
    # The NaN loss of the first step is this cause's consequence: told in the same finding, not a second one.
    assert len(report["findings"]) == 1 and group["detail"]["first_bad"]["step"] == 0
    backward = line_of("zc_meta_init.py", ".backward()")
    assert f"Training went NaN/Inf at once: the first bad optimizer.step is step 0 (zc_meta_init.py:{backward})" \
        in message
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["model_check"]["ok"] and checks["model_check"]["seconds"] > 0


def test_nan_in_one_ranks_batch_names_step_and_rank(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "zc_nan_batch.py")
    assert res.returncode == 1, res.output
    [finding] = report["findings"]
    assert finding["kind"] == "bad_values" and finding["ranks"] == [1]
    detail = finding["detail"]
    assert detail["step"] == 2 and detail["loss_ranks"] == [1] and detail["grad_ranks"] == [0, 1]
    line = line_of("zc_nan_batch.py", "        loss.backward()")
    assert detail["line"] == line and f"zc_nan_batch.py:{line}" in finding["message"]
    assert finding["message"].startswith("first NaN/Inf at step 2 ")
    assert "Rank 0 had a finite loss at that step" in finding["message"]
    assert "only points to that rank's data" in finding["message"]
    assert detail["first_param"] == "2.bias"  # the last layer: the first gradient backward produces
    assert "on rank 1 the batch itself already holds nan: input args[0] of Sequential.forward at index [3, 5]" \
        in finding["message"]
    assert detail["origin"]["where"] == "batch" and detail["origin"]["rank"] == 1


@pytest.mark.parametrize("step, checker, extra", [(3, 1, ()), (2, 0, ()), (3, 1, ("--accumulate",))],
                         ids=["rank-1s-turn", "rank-0s-turn", "accumulated-under-no_sync"])
def test_a_nan_gradient_of_ddp_is_named_at_its_step_whichever_rank_checked_it(line_of, tmp_path, step, checker,
                                                                              extra):
    """Every loss finite, a NaN gradient from backward at ``step`` on rank 1, spread by DDP's all-reduce. In the
    first 50 steps one rank of the DDP group checks each step's (identical) gradients, in turn
    (rank/autocheck/ddp_grad_share.py): the report still names the step, both ranks and the backward line."""
    res, report = run_fixture(tmp_path, "zc_nan_backward.py", "--step", str(step), *extra)
    assert res.returncode == 1, res.output
    [finding] = [f for f in report["findings"] if f["kind"] == "bad_values"]
    assert finding["ranks"] == [0, 1]
    detail = finding["detail"]
    assert detail["step"] == step and detail["loss_ranks"] == [] and detail["grad_ranks"] == [0, 1]
    assert detail["first_param"] == "weight"
    # every loss finite: the step's first backward() line (with accumulation, the micro-batch's under no_sync)
    first = ".sqrt().mean().backward()" if extra else "        loss.backward()"
    assert detail["line"] == line_of("zc_nan_backward.py", first)
    assert "Every loss was finite: the NaN/Inf arose in backward" in finding["message"]
    other = 1 - checker  # it did not look at this step's gradients: the checker's event is its own
    events = detail["events"]
    assert events[str(other)]["checked_on"] == checker and events[str(checker)]["replicated"] == [0, 1]


def test_a_ddp_model_called_through_module_has_its_gradients_checked_on_every_rank(line_of, tmp_path):
    """``model.module(x)`` skips DDP's all-reduce: the ranks' gradients differ, so no rank checks for another; the
    NaN gradient at step 2 (rank 0's turn, were they shared) is named on rank 1, the rank that holds it."""
    res, report = run_fixture(tmp_path, "zc_nan_backward.py", "--step", "2", "--bypass")
    assert res.returncode == 1, res.output
    [finding] = [f for f in report["findings"] if f["kind"] == "bad_values"]
    assert finding["ranks"] == [1] and finding["detail"]["step"] == 2 and finding["detail"]["grad_ranks"] == [1]
    assert finding["detail"]["line"] == line_of("zc_nan_backward.py", "        loss.backward()")
    assert "Rank 0 stayed finite at that step" in finding["message"]
    assert not finding["detail"]["events"]["1"]["replicated"]


def test_the_first_module_whose_output_overflows_is_named_with_its_line(line_of, tmp_path):
    """DDP; rank 1's batch is finite but large at step 2: the inf comes from Gate's exp, not from the data."""
    res, report = run_fixture(tmp_path, "zc_nan_module.py")
    assert res.returncode == 1, res.output
    [finding] = report["findings"]
    assert finding["kind"] == "bad_values" and finding["ranks"] == [1]
    detail = finding["detail"]
    assert detail["step"] == 2 and detail["loss_ranks"] == [1]
    line = line_of("zc_nan_module.py", "# BUG")
    assert detail["line"] == line and detail["file"].endswith("zc_nan_module.py")
    assert detail["origin"] == {"where": "module", "module": "gate", "type": "Gate", "op": "aten.exp",
                                "value": "inf", "file": detail["file"], "line": line, "rank": 1}
    assert (f"on rank 1 the first module in forward order whose output is not finite (its inputs were) is 'gate' "
            f"(Gate): its torch.exp at zc_nan_module.py:{line} made inf from finite values") in finding["message"]
    backward = line_of("zc_nan_module.py", "        loss.backward()")
    assert detail["backward_site"] == f"zc_nan_module.py:{backward}"


def test_unwrapped_root_is_found_without_any_distcheck_call(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "zc_unwrapped_root.py")
    assert res.returncode == 1, res.output
    [f] = report["findings"]  # one cause: the root has no fully_shard
    assert f["kind"] == "uncovered_param" and f["detail"]["params"] == ["head.weight", "head.bias"]
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line_of("zc_unwrapped_root.py", "self.head = nn.Linear")


# train_fsdp2.py and train_tp.py run in tests/test_run.py::test_non_bugs_have_no_findings, which asserts these
# checks on the same run; zc_meta_init_ok.py is the meta-init FSDP2 variant.
@pytest.mark.parametrize("fixture,root", [("zc_meta_init_ok.py", "FixedModel")])
def test_correct_scripts_have_no_findings(tmp_path, fixture, root):
    res, report = run_fixture(tmp_path, fixture)
    assert res.returncode == 0, res.output
    assert report["findings"] == []
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model_check"]["ok"] and root in checks["model_check"]["note"]
    assert checks["bad_values"]["ok"]


MARKER_TESTS = '''
import pytest, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard


def train(dist_ctx, nan_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8)
        if step == nan_step and dist_ctx.rank == 1:
            x[0, 0] = float("nan")
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_clean(dist_ctx):
    train(dist_ctx, nan_step=None)


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_nan_but_no_assert(dist_ctx):
    train(dist_ctx, nan_step=1)
'''


def test_marker_fails_a_passing_test_that_trips_bad_values(pytester):
    pytester.makepyfile(test_marker_nan=MARKER_TESTS)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", timeout=180)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    assert "test_clean PASSED" in out and "test_nan_but_no_assert FAILED" in out
    assert "distcheck's automatic checks found what the test's asserts did not" in out
    assert "[bad_values] rank 1: first NaN/Inf at step 1" in out


PIPELINE_MARKER_TESTS = '''
import pytest, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def run_stage(dist_ctx, n_microbatches):
    torch.manual_seed(0)
    stage_model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()) if dist_ctx.rank == 0 else nn.Linear(8, 1)
    stage = PipelineStage(stage_model, dist_ctx.rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=nn.functional.mse_loss)  # SCHEDULE
    if dist_ctx.rank == 0:
        schedule.step(torch.randn(8, 8))
    else:
        schedule.step(target=torch.randn(8, 1), losses=[])


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_pipeline_agrees(dist_ctx):
    run_stage(dist_ctx, 2)


@pytest.mark.distributed(nprocs=2, timeout=8)  # stage 0 then waits for a microbatch stage 1 never sends
def test_pipeline_stages_disagree(dist_ctx):
    run_stage(dist_ctx, 4 if dist_ctx.rank == 0 else 2)
'''


def test_marker_names_pipeline_stages_whose_schedules_disagree(pytester, line_of):
    pytester.makepyfile(test_pp=PIPELINE_MARKER_TESTS)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", timeout=180)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1)
    assert "test_pipeline_agrees PASSED" in out and "test_pipeline_stages_disagree FAILED" in out
    line = line_of(None, "# SCHEDULE", text=PIPELINE_MARKER_TESTS.strip("\n"))
    # Named first, before the hang and torch's shape error that follow from it.
    assert "[collective_mismatch] ranks 0-1: the stages of the pipeline on ranks 0-1 built schedules that disagree " \
        "on n_microbatches" in out
    assert out.index("[collective_mismatch]") < out.index("distributed test hung")
    assert f"stage 0 splits the batch into 4 microbatches of 2 rows (ScheduleGPipe at test_pp.py:{line})" in out


@pytest.mark.parametrize("fixture, bug, reader, reader_name, what", [
    ("async_not_waited.py", "# the bug", "opt.step()", "SGD.step()",
     "reduces gradients that SGD.step() at {f}:{r} read"),
    ("async_read_before_wait.py", "async_op=True", "# the bug", "norm()",
     "reduces a tensor that norm() at {f}:{r} reached"),
], ids=["stepped-over", "read"])
def test_async_work_not_waited_is_named_at_both_lines(line_of, tmp_path, fixture, bug, reader, reader_name, what):
    """The optimizer stepping over gradients still being reduced, and an op reading a buffer still being reduced."""
    res, report = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line, read = line_of(fixture, bug), line_of(fixture, reader)
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "async_not_waited"
    assert f["detail"]["line"] == line and f["detail"]["reader_line"] == read and f["detail"]["reader"] == reader_name
    assert f["message"].startswith(f"all_reduce(..., async_op=True) at {fixture}:{line} "
                                   f"{what.format(f=fixture, r=read)} before its Work was waited")


def test_a_resume_that_loads_nothing_names_the_prefix_and_the_line(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "resume_loads_nothing.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("resume_loads_nothing.py", "# the bug")
    assert f["kind"] == "bad_values" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "state_dict_not_loaded"
    assert f["detail"]["line"] == line and f["detail"]["missing"] == ["weight", "bias"]
    assert f"load_state_dict(strict=False) at resume_loads_nothing.py:{line} left 2 of Linear's" in f["message"]
    assert "under the prefix 'module.'" in f["message"]


def test_ddp_ranks_fed_the_same_batches_get_a_warning_naming_the_loader(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "dp_same_batches.py")
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    (note,) = [w for w in report["warnings"] if w["kind"] == "same_batches"]
    call, loader = line_of("dp_same_batches.py", "model(x)"), line_of("dp_same_batches.py", "DataLoader(data")
    assert note["ranks"] == [0, 1] and note["detail"]["line"] == call and note["detail"]["loader"][1] == loader
    assert f"the DataLoader built at dp_same_batches.py:{loader} has no DistributedSampler" in note["message"]


def test_a_dcp_partial_load_of_a_ddp_checkpoint_names_the_prefix_and_the_line(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "dcp_partial_load_prefix.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("dcp_partial_load_prefix.py", "# the bug")
    assert f["kind"] == "bad_values" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "state_dict_not_loaded"
    assert f["detail"]["line"] == line and f["detail"]["missing"] == ["model.weight", "model.bias"]
    assert f"dcp.load(allow_partial_load=True) at dcp_partial_load_prefix.py:{line} left 2 of" in f["message"]
    assert "under the prefix 'module.'" in f["message"]


def test_a_dcp_resume_into_the_old_models_state_dict_names_the_load_and_the_save(line_of, tmp_path):
    res, report = run_fixture(tmp_path, "dcp_resume_mismatch.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    load, save = line_of("dcp_resume_mismatch.py", "# the bug"), line_of("dcp_resume_mismatch.py", "dcp.save(")
    assert f["kind"] == "bad_values" and f["ranks"] == [0, 1] and f["detail"]["why"] == "not_in_model"
    assert f["detail"]["line"] == load and f["detail"]["save"]["line"] == save
    assert f["detail"]["keys"] == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    assert (f"dcp.load at dcp_resume_mismatch.py:{load} read the checkpoint dcp.save at dcp_resume_mismatch.py:"
            f"{save} wrote into a state dict the model no longer uses") in f["message"]


def test_a_dcp_resume_into_the_rebuilt_model_with_a_partial_load_by_design_is_silent(tmp_path):
    res, report = run_fixture(tmp_path, "ok/dcp_resume_rebuilt.py")
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
