"""Integration tests of ``distcheck run``: real gloo ranks on the fixtures, both launch forms, exit codes."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch_helpers import FIXTURES, distcheck, load_report, torchrun

from distcheck.analysis.trace_events import load_traces


def run_fixture(tmp_path: Path, fixture: str, *args: str, nproc: int = 2, timeout: float = 30, limit: float = 150,
                env: dict[str, str] | None = None):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", str(nproc), "--timeout", str(timeout), "--report-dir", str(out), "--",
                     str(FIXTURES / fixture), *args], timeout=limit, env=env)
    return res, load_report(out), out


def only(report: dict, kind: str) -> dict:
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert len(found) == 1, json.dumps(report["findings"], indent=1)
    return found[0]


def test_op_mismatch(line_of, tmp_path):
    res, report, out = run_fixture(tmp_path, "coll_op_mismatch.py")
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    ar, bc = line_of("coll_op_mismatch.py", "rank 0 side"), line_of("coll_op_mismatch.py", "rank 1 side")
    assert f["ranks"] == [0, 1] and f["detail"]["position"] == 3 and "op" in f["detail"]["fields"]
    assert f"coll_op_mismatch.py:{ar}" in f["message"] and f"coll_op_mismatch.py:{bc}" in f["message"]
    assert f["detail"]["issued"]["0"]["op"] == "all_reduce" and f["detail"]["issued"]["1"]["op"] == "broadcast"
    assert f["detail"]["line"] == ar and f["detail"]["file"].endswith("coll_op_mismatch.py")
    assert [x["kind"] for x in report["findings"]] == ["collective_mismatch"]  # no hang, no failure noise
    assert (out / "trace-rank0.jsonl").exists() and (out / "trace-rank1.jsonl").exists()
    chrome = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in chrome["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert "collective_mismatch" in res.stdout


def test_extra_collective_keeps_backend_error(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "coll_extra.py")
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    line = line_of("coll_extra.py", "only on rank 0")
    assert f["ranks"] == [0] and f["detail"]["divergence"] == "extra"
    assert f"coll_extra.py:{line}" in f["message"] and f["detail"]["line"] == line
    assert "rank 1 issued no collective there (finished its script)" in f["message"]
    # the cryptic gloo error is kept as evidence, not reported as a separate failure
    assert f["detail"].get("backend_errors", {}).get("0") or not any(x["kind"] == "rank_failure" for x in report["findings"])
    assert not any(x["kind"] == "rank_failure" for x in report["findings"])


@pytest.mark.parametrize("fixture,field", [("coll_shape_mismatch.py", "shapes"), ("coll_dtype_mismatch.py", "dtypes")])
def test_shape_and_dtype_mismatch(line_of, tmp_path, fixture, field):
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    line = line_of(fixture, "# BUG")
    assert f["ranks"] == [0, 1] and f["detail"]["fields"] == [field] and f["detail"]["position"] == 2
    assert f"{fixture}:{line}" in f["message"] and f["detail"]["line"] == line
    assert not any(x["kind"] == "rank_failure" for x in report["findings"])  # a SIGABRT in gloo is evidence


def test_subgroup_mismatch_on_4_ranks(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "coll_subgroup_mismatch.py", nproc=4)
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    assert f["ranks"] == [2, 3] and f["detail"]["group"] == [2, 3] and f["detail"]["position"] == 2
    l2, l3 = line_of("coll_subgroup_mismatch.py", "rank 2 side"), line_of("coll_subgroup_mismatch.py", "rank 3 side")
    assert f"coll_subgroup_mismatch.py:{l2}" in f["message"] and f"coll_subgroup_mismatch.py:{l3}" in f["message"]


def test_rank_crash(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "coll_crash.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    line = line_of("coll_crash.py", "# BUG")
    assert f["ranks"] == [1] and f["detail"]["line"] == line and f"coll_crash.py:{line}" in f["message"]
    assert "ValueError: bad sample in batch 2" in f["detail"]["traceback"]
    assert f["detail"]["positions"]["0"]["last_started"]["op"] == "all_reduce"
    assert "rank 0 " in f["message"]  # the other rank's position is reported too
    assert not any(x["kind"] == "collective_mismatch" for x in report["findings"])
    # Rank 0's "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer", when it got that far, in words.
    assert ".cc:" not in f["message"] and ("gloo lost its connection" in f["message"] or "waits in" in f["message"])


def test_a_dataloader_workers_exception_is_named_at_the_workers_line(line_of, tmp_path):
    """torch re-raises the worker's IndexError at ``for x in loader``; the finding names the worker, its error and
    its own line (read from torch's re-raised message), and keeps the loop's line beside it."""
    res, report, _ = run_fixture(tmp_path, "loader_worker_raises.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    line, loop = line_of("loader_worker_raises.py", "# BUG: rank 1"), line_of("loader_worker_raises.py", "for x in")
    assert f["ranks"] == [1] and f["detail"]["line"] == line and f["detail"]["file"].endswith("loader_worker_raises.py")
    assert f["detail"]["worker"] == 0 and f["detail"]["loader_line"] == loop
    assert f["message"].startswith(
        f"rank 1's DataLoader worker 0 raised IndexError: list index out of range at loader_worker_raises.py:{line} "
        f"(in __getitem__), re-raised in the rank at loader_worker_raises.py:{loop}"), f["message"]


def test_ranks_that_save_different_contents_to_one_file_are_named_with_the_path_and_line(line_of, tmp_path):
    """Every FSDP2 rank torch.saves its shards to one path and resumes from it: silent without distcheck (the file
    holds the last writer's halves); a tensor_divergence naming the path, both ranks and the line."""
    res, report, out = run_fixture(tmp_path, "save_shards_one_file.py")
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("save_shards_one_file.py", "# BUG")
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1], report["findings"]
    assert f["detail"]["line"] == line and f["detail"]["file"].endswith("save_shards_one_file.py")
    assert f["detail"]["path"].endswith("/model.pt") and f["detail"]["save"] == 1
    assert f["message"].startswith(f"ranks 0-1 each torch.save different contents to the same file "
                                   f"{f['detail']['path']} at save_shards_one_file.py:{line} (2 different contents")
    assert "saves-rank0" in report["artifacts"]


def test_a_rank_that_skipped_a_step_is_named_with_each_ranks_backward_and_step_counts(line_of, tmp_path):
    """Rank 1 `continue`s past one step: DDP's all-reduces pair different steps until rank 0's last backward()
    waits for one rank 1 never issues. The hang gives each rank's counts and the waiting backward()'s line."""
    res, report, _ = run_fixture(tmp_path, "ddp_skipped_step.py", timeout=10)
    assert res.returncode == 1, res.output
    f = only(report, "hang")
    backward, barrier = line_of("ddp_skipped_step.py", "# BACKWARD"), line_of("ddp_skipped_step.py", "dist.barrier()")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == backward, f["message"]
    assert f["detail"]["step_counts"] == {"0": {"backward": 4, "optimizer_step": 3},
                                          "1": {"backward": 3, "optimizer_step": 3}}
    assert (f"rank 0 is in all_reduce #9 (DDP gradient bucket all-reduce at ddp_skipped_step.py:{backward}); rank 1 "
            f"is in barrier #1 (ddp_skipped_step.py:{barrier}); backward() ran 4 times on rank 0, 3 times on rank 1, "
            f"optimizer.step() 3 times on every rank: rank 1 ran 1 training step fewer than rank 0") in f["message"]
    assert f"rank 0's backward() #4 at ddp_skipped_step.py:{backward} waits for an all-reduce rank 1 never" in f["message"]


def test_hang_is_bounded_by_timeout(line_of, tmp_path):
    start = time.monotonic()
    res, report, _ = run_fixture(tmp_path, "coll_hang.py", timeout=4)
    assert time.monotonic() - start < 60
    assert res.returncode == 1, res.output
    f = only(report, "hang")
    # The watchdog names the odd rank and its line, and where the others wait (from stacks + traces).
    sleep_line, bug = line_of("coll_hang.py", "stuck data loader"), line_of("coll_hang.py", "# BUG")
    assert f["ranks"] == [1] and f["detail"]["line"] == sleep_line
    assert f"rank 1 is in main (coll_hang.py:{sleep_line}) while rank 0 waits in all_reduce #2 (coll_hang.py:{bug})" \
        in f["message"]
    assert f["detail"]["last_collectives"]["1"]["last_completed"]["op"] == "all_reduce"
    assert report["artifacts"]["stacks.txt"] == "stacks.txt"


@pytest.mark.parametrize("zygote", ["0", "1"], ids=["fresh", "private"])
def test_every_way_of_starting_ranks_gives_the_same_report(tmp_path, zygote):
    """Fresh interpreters (the default) and a private zygote; the shared one runs every other test here, and a
    missing one is tests/unit/test_zygote.py's."""
    res, report, out = run_fixture(tmp_path, "train_fsdp2.py", env={"DISTCHECK_ZYGOTE": zygote})
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    assert sorted(load_traces(out)) == [0, 1] and "PASSED" in res.stdout and "zygote" not in res.output


@pytest.mark.parametrize("fixture", ["coll_uneven_allgather.py", "train_fsdp2.py", "train_tp.py"])
def test_non_bugs_have_no_findings(line_of, tmp_path, fixture):
    res, report, out = run_fixture(tmp_path, fixture)
    assert res.returncode == 0, res.output + json.dumps(report["findings"], indent=1)
    assert report["ok"] and report["findings"] == []
    # A tidy report dir: no empty per-rank file, no stack-hook file (meaningful only while a rank runs), and
    # report files readable like every other file.
    assert not [p.name for p in out.iterdir() if p.is_file() and p.stat().st_size == 0]
    assert not list(out.glob("stackhook-pid*.json")) and (out / "report.json").stat().st_mode & 0o044
    events = load_traces(out)[1].events
    ops = {e.op for e in events}
    sites = {e.site for e in events}
    assert all(s and s.startswith(fixture + ":") for s in sites), sites
    if fixture == "train_fsdp2.py":  # FSDP2's own collectives, attributed to the forward and backward lines
        assert {"all_gather_single", "reduce_scatter_single"} <= ops
        assert f"{fixture}:{line_of(fixture, 'all-gathers here')}" in sites
        assert f"{fixture}:{line_of(fixture, 'reduce-scatters here')}" in sites
    if fixture == "train_tp.py":  # DTensor's functional collectives
        funcol = {e.op for e in events if e.extra.get("api") == "functional"}
        assert "all_reduce" in funcol and f"{fixture}:{line_of(fixture, 'all-reduces the output')}" in sites
    if fixture != "coll_uneven_allgather.py":  # the zero-code checks found the model by themselves and passed
        checks = {c["name"]: c for c in report["checks"]}
        root = "Sequential"  # both wrap an nn.Sequential
        assert checks["model_check"]["ok"] and root in checks["model_check"]["note"], checks["model_check"]
        assert checks["bad_values"]["ok"]


def test_every_op_is_recorded(tmp_path):
    res, report, out = run_fixture(tmp_path, "coll_all_ops.py")
    assert res.returncode == 0, res.output + json.dumps(report["findings"], indent=1)
    src = (FIXTURES / "coll_all_ops.py").read_text().splitlines()
    for rank in (0, 1):
        starts = load_traces(out)[rank].events
        assert all(e.completed for e in starts), "every collective completed"
        recorded = {(e.op, e.extra.get("api") == "functional") for e in starts}
        expected_c10d = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                         "reduce", "gather", "scatter", "all_to_all_single", "barrier", "batch_isend_irecv",
                         "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"}
        expected_c10d |= {"send", "isend", "send_object_list"} if rank == 0 else {"recv", "irecv", "recv_object_list"}
        expected_funcol = {"all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
        assert {(op, False) for op in expected_c10d} <= recorded, expected_c10d - {op for op, f in recorded if not f}
        assert {(op, True) for op in expected_funcol} <= recorded
        # internal calls (all_gather_object's all_gather, ...) are not traced: one event per user line
        assert len(starts) == len({e.line for e in starts})
        for e in starts:
            assert e.pg == (0, 1) and e.file.endswith("coll_all_ops.py")
            assert e.op.split("_")[0] in src[e.line - 1] or e.op in src[e.line - 1]
        mx = next(e for e in starts if e.reduce_op == "MAX")
        assert mx.op == "all_reduce" and mx.shapes == [[4]] and mx.dtypes == ["float32"]
        assert next(e for e in starts if e.op == "broadcast" and not e.extra.get("api")).root == 0
        p2p = next(e for e in starts if e.op in ("send", "recv"))
        assert p2p.peer == 1 - rank


def test_under_torchrun_rank0_writes_the_report(line_of, tmp_path):
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "run", "--timeout", "30", "--report-dir", str(out), "--",
                    str(FIXTURES / "coll_extra.py")], timeout=150)
    assert res.returncode != 0  # torchrun reports the failed rank; the report is the source of truth
    report = load_report(out)
    f = only(report, "collective_mismatch")
    assert f["ranks"] == [0] and f["detail"]["line"] == line_of("coll_extra.py", "only on rank 0")
    assert report["world_size"] == 2 and (out / "trace.json").exists()


def test_under_torchrun_crash(line_of, tmp_path):
    out = tmp_path / "report"
    torchrun(["-m", "distcheck", "run", "--timeout", "30", "--report-dir", str(out), "--",
              str(FIXTURES / "coll_crash.py")], timeout=150)
    f = only(load_report(out), "rank_failure")
    assert f["ranks"] == [1] and f["detail"]["line"] == line_of("coll_crash.py", "# BUG")


def test_bad_scripts_exit_2(tmp_path):
    res = distcheck(["run", "--nproc", "2", "--", str(tmp_path / "missing.py")], timeout=60)
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    data = tmp_path / "data.csv"
    data.write_text("a,b\n1,2\n")
    res = distcheck(["run", "--", str(data)], timeout=60)
    assert res.returncode == 2 and "is not a Python file" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = distcheck(["run", "--nproc", "2"], timeout=60)
    assert res.returncode == 2 and "no script given" in res.stderr


def test_mesh_error_in_run_is_mesh_mismatch(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "mesh_2x2_on_2_ranks.py")
    assert res.returncode == 1, res.output
    f = only(report, "mesh_mismatch")
    line = line_of("mesh_2x2_on_2_ranks.py", "# BUG")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line and f"mesh_2x2_on_2_ranks.py:{line}" in f["message"]
    assert f["detail"]["shape"] == [2, 2] and "needs 4 ranks but the world has 2" in f["message"]
    assert "Mesh should not be bigger" in f["detail"]["torch_error"]
    assert not [g for g in report["findings"] if g["kind"] == "rank_failure"]  # explained by the mesh error


def test_ddp_unused_parameters_are_named_once_for_every_rank(line_of, tmp_path):
    """torch's "Parameter indices which did not receive grad: 2 3" on each rank -> one finding naming them."""
    res, report, _ = run_fixture(tmp_path, "ddp_unused_param.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    unused, raises = line_of("ddp_unused_param.py", "# UNUSED"), line_of("ddp_unused_param.py", "# RAISES")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == raises
    assert f["detail"]["unused_params"] == ["aux_head.weight", "aux_head.bias"]
    assert f"'aux_head.weight', 'aux_head.bias' (created at ddp_unused_param.py:{unused})" in f["message"]
    assert "find_unused_parameters=True" in f["message"] and "Parameter indices" not in f["message"]
    assert "Parameter indices which did not receive grad" in f["detail"]["error"]  # torch's own text, kept


def test_replicas_drifting_under_no_sync_are_one_finding_with_the_cause(line_of, tmp_path):
    """Every micro-step under no_sync(): PASSED before; now one tensor_divergence at the no_sync() line."""
    res, report, _ = run_fixture(tmp_path, "ddp_no_sync_drift.py")
    assert res.returncode == 1, res.output
    f = only(report, "tensor_divergence")
    bug, step = line_of("ddp_no_sync_drift.py", "# BUG"), line_of("ddp_no_sync_drift.py", "# STEP")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == bug and f["detail"]["step"] == 0
    assert f["detail"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert f"after the first optimizer.step() (ddp_no_sync_drift.py:{step})" in f["message"]
    assert f"ran under no_sync() at ddp_no_sync_drift.py:{bug}" in f["message"]
    assert [c["ok"] for c in report["checks"] if c["name"] == "replica_drift"] == [False]
    fixed, report, _ = run_fixture(tmp_path / "fixed", "ddp_no_sync_drift.py", "--fixed")
    assert fixed.returncode == 0 and report["findings"] == [], fixed.output
    assert [c["note"] for c in report["checks"] if c["name"] == "replica_drift"] == [
        "replicated parameters identical on every rank after 3 optimizer steps"]


def test_fsdp1_replicas_drifting_under_its_no_sync_name_the_no_sync_line(line_of, tmp_path):
    """FSDP1 NO_SHARD, every micro-step under its no_sync(): hooked as DDP's, so the cause is the no_sync() line."""
    res, report, _ = run_fixture(tmp_path, "fsdp1_no_sync_drift.py")
    assert res.returncode == 1, res.output
    f = only(report, "tensor_divergence")
    bug = line_of("fsdp1_no_sync_drift.py", "# BUG")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == bug and f["detail"]["cause"] == "no_sync"
    assert f"ran under no_sync() at fsdp1_no_sync_drift.py:{bug}" in f["message"]
    fixed, report, _ = run_fixture(tmp_path / "fixed", "fsdp1_no_sync_drift.py", "--fixed")
    assert fixed.returncode == 0 and report["findings"] == [], fixed.output


def test_plain_norm_of_a_sequence_parallel_model_drifts(line_of, tmp_path):
    """A LayerNorm left out of the SP plan: each rank its own gradient, nothing reduces it -> named, with the fix."""
    res, report, _ = run_fixture(tmp_path, "tp_norm_drift.py")
    assert res.returncode == 1, res.output
    f = only(report, "tensor_divergence")
    step = line_of("tp_norm_drift.py", "# STEP")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == step and f["detail"]["params"] == ["norm.weight", "norm.bias"]
    assert "plain (non-DTensor) parameter of a tensor-parallel model" in f["message"] and "SequenceParallel()" in f["message"]
    fixed, report, out = run_fixture(tmp_path / "fixed", "tp_norm_drift.py", "--fixed")
    assert fixed.returncode == 0 and report["findings"] == [], fixed.output
    assert not list(out.glob("stderr-rank*.txt"))  # a DTensor loss once broke the NaN/Inf check (a warning)


@pytest.mark.parametrize("fixture,exc,translated,expected", [
    ("fsdp2_mixed_mesh.py", "RuntimeError", "mixed_meshes",
     "got DTensors on two different device meshes, (2,) and (dp_replicate=2, dp_shard=1)"),
    ("fsdp2_unsharded_root.py", "RuntimeError", "fsdp_unsharded_params", "fully_shard(model) on the root module"),
    ("fsdp2_meta_no_to_empty.py", "RuntimeError", "fsdp_meta_params",
     "FSDP2: 4 parameters still on the meta device at the first forward"),
    ("dtensor_redistribute_mesh.py", "NotImplementedError", "redistribute_other_mesh",
     "only changes placements on the DTensor's own mesh"),
])
def test_fsdp2_and_dtensor_errors_are_translated_once(line_of, tmp_path, fixture, exc, translated, expected):
    """torch's FSDP2/DTensor errors, raised for real on every rank: one finding, torch's text kept in detail."""
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line_of(fixture, "# RAISES")
    assert f["detail"]["translated"] == translated and f["detail"]["exception"] == exc
    assert expected in f["message"] and "Fix: " in f["message"] and f["detail"]["error"] not in f["message"]
    if fixture == "fsdp2_unsharded_root.py":  # the first forward's check named the cause before the crash
        assert only(report, "uncovered_param")["detail"]["params"] == ["2.weight", "2.bias"]


@pytest.mark.parametrize("case,exc,expected", [
    ("count", "ValueError", "2 placements given for a 1-D device mesh"),
    ("partial", "RuntimeError", "redistribute() from S(0) to P(sum) is not allowed"),
    ("view", "RuntimeError", "aten.view.default cannot run on its DTensor input with placements S(0)"),
])
def test_dtensor_placement_errors_are_translated(line_of, tmp_path, case, exc, expected):
    res, report, _ = run_fixture(tmp_path, "dtensor_placement_errors.py", "--case", case)
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line_of("dtensor_placement_errors.py", f"# RAISES {case}")
    assert f["detail"]["exception"] == exc and expected in f["message"] and "Fix: " in f["message"]


def test_gloo_timeout_is_the_cause_and_the_lost_peer_its_consequence(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "gloo_timeout.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")  # rank 0's "Connection closed by peer" is folded in, not a second finding
    wait = line_of("gloo_timeout.py", "# WAIT")
    assert f["ranks"] == [1] and f["detail"]["line"] == wait and f["detail"]["translated"] == "gloo_timeout"
    assert f"gloo's timeout (2s, from init_process_group) expired in barrier #2 at gloo_timeout.py:{wait}" \
        in f["message"] and "init_process_group(timeout=...)" in f["message"]
    assert "Timed out waiting 2000ms" in f["detail"]["error"] and ".cc:" not in f["message"]


def test_ddp_ready_twice_names_the_parameter_and_the_fix(line_of, tmp_path):
    """Reentrant checkpoints running one block twice under DDP -> the parameter, its line and the fixes, once."""
    res, report, _ = run_fixture(tmp_path, "ddp_ready_twice.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    shared, raises = line_of("ddp_ready_twice.py", "# SHARED"), line_of("ddp_ready_twice.py", "# RAISES")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == raises and f["detail"]["params"] == ["block.bias"]
    assert f"DDP: parameter 'block.bias' (created at ddp_ready_twice.py:{shared}) got its gradient twice" in f["message"]
    assert "use_reentrant=False" in f["message"] and "marked as ready twice" in f["detail"]["error"]


def test_dtensor_mixed_with_a_plain_tensor_says_which_fix(line_of, tmp_path):
    res, report, _ = run_fixture(tmp_path, "dtensor_mixed_tensor.py")
    assert res.returncode == 1, res.output
    f = only(report, "rank_failure")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line_of("dtensor_mixed_tensor.py", "# BUG")
    assert "aten.add.Tensor was given a DTensor and a plain torch.Tensor" in f["message"]
    assert "DTensor.from_local" in f["message"] and "need to convert all torch.Tensor" in f["detail"]["error"]


def test_all_to_all_split_sizes_that_do_not_pair_up_name_the_pair_not_the_abort(line_of, tmp_path):
    """An MoE dispatch: rank 1's output_split_sizes disagree with what rank 0 sends it. gloo aborts a rank; the
    report names the pair, both sizes and the line, with the matrix of rows each rank sends each expert."""
    res, report, _ = run_fixture(tmp_path, "a2a_split_mismatch.py")
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    line = line_of("a2a_split_mismatch.py", "dist.all_to_all_single(out, x")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line and f["detail"]["position"] == 2
    assert f["detail"]["pairs"] == [{"src": 0, "dst": 1, "sent": [5, 4], "expected": [4, 4]}]
    assert (f"rank 0 sends 5 rows to rank 1 (a2a_split_mismatch.py:{line}), rank 1 expects 4 rows from rank 0 "
            f"(a2a_split_mismatch.py:{line})") in f["message"]
    assert "(input_split_sizes): rank 0 [3, 5]; rank 1 [4, 4]" in f["message"]
    assert not any(x["kind"] == "rank_failure" for x in report["findings"])  # the abort is evidence, not the cause


@pytest.mark.parametrize("fixture, rank, activity, places", [
    ("straggler_data_loading.py", 1, "in its own code", [("load_batch", "its own code", "time.sleep(DELAY)")]),
    ("straggler_compute.py", 1, "computing", [("forward", "forward", "torch.tanh(layer(x))"),
                                               ("main", "backward", "loss.backward()")]),
    ("straggler_host_sync.py", 0, "in host syncs", [("log_logits", "host sync", 'print(f"step {step}')]),
], ids=["data-loading", "compute", "host-sync"])
def test_a_slow_rank_is_named_with_what_it_was_doing_and_where(tmp_path, line_of, fixture, rank, activity, places):
    """The late rank, what kept it (data loading, compute, host syncs) and its lines, from its samples inside the
    gaps the others waited through (DDP's bucket all-reduces are untraced: their starts come from the process
    group's own record)."""
    res, report, _ = run_fixture(tmp_path, fixture)
    assert res.returncode == 0 and report["ok"], res.output
    notes = [w for w in report["warnings"] if w["kind"] == "straggler"]
    assert len(notes) == 1, (report.get("stragglers"), sorted(report["artifacts"]), res.output)
    (note,) = notes
    assert note["ranks"] == [rank] and report["stragglers"]["named"] == [rank]
    assert note["message"].startswith(f"rank {rank} arrived last at ")
    assert f"in those gaps it was mostly {activity}" in note["message"], note["message"]
    assert note["detail"]["where"]["activity"].startswith(activity)
    top = note["detail"]["where"]["samples"]
    for func, kind, marker in places:
        site = f"{fixture}:{line_of(fixture, marker)}"
        assert f"{func} ({site}, {kind})" in note["message"], note["message"]
        assert any(p["func"] == func and p["kind"] == kind and p["line"] == line_of(fixture, marker) for p in top)
    assert "stragglers (who held the others up at each collective)" in res.stdout


def test_the_supervisor_names_the_straggler_while_the_run_goes_on(tmp_path):
    """The live line: of 4 looks a second apart (DISTCHECK_STRAGGLER_LOOKS; 10 by default), 70% at which rank 1
    alone had not reached the all-reduce rank 0 waited in, printed by the launcher while the ranks still run. Rank 1
    sleeps 0.25 s a step here, so that it is behind at most looks even on a loaded machine."""
    res, report, _ = run_fixture(tmp_path, "straggler_data_loading.py", "--steps", "32", "--delay", "0.25",
                                 env={"DISTCHECK_STRAGGLER_LOOKS": "4"})
    assert res.returncode == 0 and report["ok"], res.output
    lines = [line for line in res.stderr.splitlines() if "is the straggler" in line]
    assert len(lines) == 1 and lines[0].startswith("distcheck: rank 1 is the straggler: at "), res.output
    assert "of the last 4 looks (1 s apart) it alone had not reached the collective rank 0 waited in" in lines[0]


def test_a_passing_run_whose_output_nobody_reads_exits_0_with_its_report(tmp_path):
    """`distcheck run ... | head` or `| grep -q PASSED`: stdout closes before the report is printed. The write's
    BrokenPipeError ended the launcher with a traceback and exit code 1 for a PASSED run; the verdict is the exit
    code, whoever reads the rest, and stderr says once that the console is gone."""
    import os
    import subprocess

    from launch_helpers import env_for_ranks

    from distcheck.supervise.zygote import start_process

    out = tmp_path / "report"
    stdout_r, stdout_w = os.pipe()
    os.close(stdout_r)  # nobody reads it
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = start_process(["-m", "distcheck", "run", "--nproc", "2", "--report-dir", str(out), "--",
                              str(FIXTURES / "hang_none.py"), "--steps", "2"], env_for_ranks(None), new_session=True,
                             stdout=stdout_w, stderr=err.fileno())
        os.close(stdout_w)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            raise
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 0 and load_report(out)["ok"], stderr
    assert "Traceback" not in stderr and stderr.count("the console is gone (BrokenPipeError on stdout)") == 1, stderr


def test_a_balanced_job_names_no_straggler(tmp_path):
    """Steps of 0.15 s on both ranks and a line after 3 of 4 looks: when the look compared the ranks' counts as their
    status threads had seen them, at the moment every file covered, one thread looking a few ms before the other
    showed its rank ahead at every look, and a run in three named a straggler here (tests/unit/
    test_live_stragglers.py has the same case as numbers)."""
    res, report, _ = run_fixture(tmp_path, "hang_none.py", "--read", "0.15", "--steps", "50", timeout=10,
                                 env={"DISTCHECK_STRAGGLER_LOOKS": "4"})
    assert "is the straggler" not in res.output, res.output
    assert report["ok"] and report["stragglers"]["named"] == [] and not any(
        w["kind"] == "straggler" for w in report.get("warnings", []))


def test_pipeline_stages_with_different_microbatch_counts_name_both_schedules_not_the_shape_error(line_of, tmp_path):
    """Stage 0's ScheduleGPipe splits the batch into 4 microbatches, stage 1's into 2: rank 1 fails inside
    pipelining's shape inference ("The size of tensor a (4) must match ..."). The report names both stages' counts
    and the schedule's line; torch's error stays in the finding as what followed. The correct twins (GPipe, 1F1B,
    interleaved: fixtures/ok/pipeline_*.py) are silent in tests/integration/test_correct_corpus.py."""
    res, report, _ = run_fixture(tmp_path, "pp_microbatch_mismatch.py")
    assert res.returncode == 1, res.output
    f = only(report, "collective_mismatch")
    line = line_of("pp_microbatch_mismatch.py", "# BUG")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line and f["detail"]["fields"] == ["n_microbatches"]
    assert (f"stage 0 splits the batch into 4 microbatches of 4 rows (ScheduleGPipe at pp_microbatch_mismatch.py:"
            f"{line}); stage 1 the targets into 2 of 8 (:{line})") in f["message"], f["message"]
    assert "The size of tensor a (4) must match the size of tensor b (8)" in f["detail"]["consequences"]["1"]
    assert not any(x["kind"] == "rank_failure" for x in report["findings"])  # the error is evidence, not the cause
    # the absorbed failure keeps its line: where rank 1 failed, its schedule.step(...)
    step = line_of("pp_microbatch_mismatch.py", "schedule.step(target=y")
    assert f["detail"]["failed"]["line"] == step and f["detail"]["failed"]["ranks"] == [1]
    assert f"Then, inside step() at pp_microbatch_mismatch.py:{step}, rank 1 failed with torch's" in f["message"]
