"""The consistency command on real gloo ranks: a clean run passes, each fixture bug gives its finding."""

import pytest
from launch_helpers import FIXTURES, distcheck, load_report, torchrun


def consistency_run(tmp_path, *extra, nproc=2, env=None):
    """Ranks forked by the session's zygote (torchrun's processes stand in for them); a hang of fresh interpreters
    under torchrun is test_faults.py's (SIGTERM)."""
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "consistency", "--report-dir", str(out), "--timeout", "60", *extra],
                   nproc=nproc, timeout=240, env=env)
    return res, load_report(out)


def test_builtin_passes_and_prints_verdict(tmp_path):
    res, report = consistency_run(tmp_path)  # fresh interpreters: the crash and hang tests below, and make check
    assert res.returncode == 0, res.output
    assert report["ok"] is True and report["findings"] == [] and report["world_size"] == 2
    names = [c["name"] for c in report["checks"]]
    assert names == ["environment", "collectives", "model_consistency", "parallel_vs_reference", "placements",
                     "replicated_state"]
    assert all(c["ok"] and c["seconds"] >= 0 for c in report["checks"])
    assert "distcheck PASSED" in res.stdout and res.stdout.count("distcheck PASSED") == 1  # rank 0 only
    assert report["reference_steps"] and len(report["reference_steps"]) == 3
    managed = {row["name"]: row["fsdp"] for row in report["placements"] if row["role"] == "parameter"}
    assert managed["blocks.0.attn.q.weight"] == "blocks.0" and managed["head.weight"] == "<root>"
    assert "placements:" in res.stdout
    # Progress counters are no artifacts: each rank removes its own at its end, and the list leaves them out.
    assert not [a for a in report["artifacts"] if a.endswith(".status")], report["artifacts"]
    assert not list((tmp_path / "report").glob("*.status"))


def test_rank_seeded_factory_gives_tensor_divergence(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_rank_seeded.py:build")
    assert res.returncode != 0
    # One cause (the rank's seed), one finding: every parameter listed, the first one's site named.
    div = [f for f in report["findings"] if f["kind"] == "tensor_divergence" and "before parallelizing" in f["message"]]
    assert len(div) == 1 and div[0]["detail"]["name"] == "0.weight", report["findings"]
    f = div[0]
    assert f["detail"]["count"] == len(f["detail"]["params"]) > 1 and "0.weight" in f["detail"]["params"]
    assert f["ranks"] == [0, 1]
    assert "'0.weight'" in f["message"] and "max abs diff" in f["message"]
    assert "model_rank_seeded.py:20" in f["message"] and f["detail"]["line"] == 20
    assert report["checks"][2] == {"name": "model_consistency", "ok": False, "seconds": report["checks"][2]["seconds"]}


def test_rank_dependent_forward_gives_reference_mismatch(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_rank_dependent.py:build")
    assert res.returncode != 0
    [f] = report["findings"]
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [1]
    assert f["detail"]["step"] == 0 and f["detail"]["quantity"] == "loss"
    assert "model_rank_dependent.py:23" in f["message"] and f["detail"]["line"] == 23


def test_broken_all_reduce_names_op_dtype_rank(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/broken_allreduce.py:build",
                                  "--parallel", "ddp", "--steps", "1")
    kinds = {f["kind"] for f in report["findings"]}
    assert kinds == {"collective_mismatch"}, report["findings"]
    ops = {(f["detail"]["op"], f["detail"]["dtype"], f["detail"]["group"]) for f in report["findings"]}
    assert ("all_reduce(sum)", "float32", "world") in ops
    assert all(dtype == "float32" and op.startswith("all_reduce") for op, dtype, _ in ops)
    assert all(f["ranks"] == [1] for f in report["findings"])


def test_env_mismatch_and_user_model_ddp(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/env_rank_dependent.py:build", "--steps", "1")
    [f] = report["findings"]
    assert f["kind"] == "env_mismatch" and f["detail"]["key"] == "NCCL_ALGO" and "'Ring'" in f["message"]


def test_clean_user_model_ddp_and_tp_builtin(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_mlp.py:build", "--parallel", "ddp")
    assert res.returncode == 0 and report["ok"], report["findings"]
    res, report = consistency_run(tmp_path, "--parallel", "tp", "--steps", "2")
    assert res.returncode == 0 and report["ok"], report["findings"]


@pytest.mark.parametrize("spec, message", [
    ("no_such_pkg.model:build", "no module named 'no_such_pkg'"),
    ("fixtures/missing.py:build", "does not exist"),
    ("FIX/model_mlp.py:nope", "has no attribute 'nope'"),
    ("FIX/model_mlp.py", "expected MODULE:FACTORY"),
    ("FIX/factory_errors.py:raises", "the factory raised RuntimeError"),
    ("FIX/factory_errors.py:not_a_module", "not an nn.Module"),
])
def test_bad_model_exit_2_one_line(tmp_path, capsys, spec, message):
    # In-process through cli.main (the same code path as the command line, without paying for a torch import
    # per case); test_bad_parallel_and_report_dir proves the real subprocess prints no traceback.
    from distcheck.cli import main

    spec = spec.replace("FIX", str(FIXTURES))
    code = main(["consistency", "--model", spec, "--report-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_parallel_and_report_dir(tmp_path):
    res = distcheck(["consistency", "--parallel", "zero3"], timeout=60)
    assert res.returncode == 2 and "zero3" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    blocker = tmp_path / "f"
    blocker.write_text("")
    res = distcheck(["consistency", "--report-dir", str(blocker / "x")], timeout=60)
    assert res.returncode == 2 and "not writable" in res.stderr and "Traceback" not in res.output
    res = distcheck(["consistency", "--model", f"{FIXTURES}/factory_errors.py:raises",
                     "--report-dir", str(tmp_path / "r")], timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.output
    assert res.stderr.strip() == (f"distcheck: error: --model {FIXTURES}/factory_errors.py:raises: the factory "
                                  f"raised RuntimeError: cannot build")
    assert not (tmp_path / "r" / "report.json").exists()  # no partial report claiming the run was killed


def test_bad_model_under_torchrun_shows_message(tmp_path):
    res = torchrun(["-m", "distcheck", "consistency", "--model", "no_such_pkg.model:build"], timeout=120)
    assert res.returncode != 0
    assert "distcheck: error: --model no_such_pkg.model:build: no module named 'no_such_pkg'" in res.stderr


def test_world_size_1_runs_and_says_what_means_nothing(tmp_path):
    res = distcheck(["consistency", "--report-dir", str(tmp_path), "--steps", "1"], timeout=120)
    assert res.returncode == 0, res.output
    report = load_report(tmp_path)
    notes = {c["name"]: c.get("note", "") for c in report["checks"]}
    assert report["world_size"] == 1 and "1 rank" in notes["model_consistency"]
    assert "1 rank" in notes["parallel_vs_reference"]


def test_ddp_unused_head_is_one_translated_failure(tmp_path, line_of):
    """The issue's example: two 12-line DDP messages with indices before; one finding with names and a line now."""
    res, report = consistency_run(tmp_path, "--parallel", "ddp", "--model", f"{FIXTURES}/model_unused_head.py:build",
                                  "--steps", "2")
    assert res.returncode == 1
    [f] = report["findings"]
    unused = line_of("model_unused_head.py", "# UNUSED")
    assert f["kind"] == "rank_failure" and f["ranks"] == [0, 1] and f["detail"]["check"] == "parallel_vs_reference"
    assert f["detail"]["unused_params"] == ["aux_head.weight", "aux_head.bias"]
    assert f"'aux_head.weight', 'aux_head.bias' (created at model_unused_head.py:{unused})" in f["message"]
    assert "Parameter indices" not in f["message"] and "Parameter indices" in f["detail"]["error"]


@pytest.mark.parametrize("slow_rank0", [False, True], ids=["rank0-waits", "rank0-not-there-yet"])
def test_rank_crash_keeps_the_report(tmp_path, slow_rank0):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_rank_crash.py:build", "--timeout", "30",
                                  env={"SLOW_RANK0": "1"} if slow_rank0 else None)
    assert res.returncode != 0
    [f] = report["findings"]
    assert f["kind"] == "rank_failure" and f["ranks"] == [1], f
    # Rank 0 waited for rank 1 in the check's exchange, or (a slow rank 0 on a loaded machine) had not reached it
    # yet: then rank 1's stack-hook file, left by a rank that died, names it.
    assert f["detail"]["check"] == "model_consistency" and f["detail"]["suspect_ranks"] == [1]
    assert ("rank 0 was waiting for rank(s) 1" in f["message"] and not slow_rank0
            or "rank(s) 1 on this host had exited before rank 0 reached" in f["message"]), f["message"]
    status = {c["name"]: c["ok"] for c in report["checks"]}
    assert status["environment"] and status["collectives"] and not status["model_consistency"]


def test_a_sigkilled_rank_0_leaves_the_report_of_what_completed(tmp_path):
    """Rank 0 is SIGKILLed while it builds the model: the report it handed its node watcher before that check
    (contract/report_handoff.py) is the run's report, published by the watcher, and names the check it died in."""
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_rank_crash.py:build", "--timeout", "30",
                                  env={"KILL_RANK0": "1"})
    assert res.returncode != 0
    [f] = report["findings"]
    assert f["kind"] == "rank_failure" and f["ranks"] == [0, 1] and f["detail"]["check"] == "model_consistency", f
    assert "the process was killed before it finished" in f["message"], f["message"]
    status = {c["name"]: (c["ok"], c.get("note")) for c in report["checks"]}
    assert status["environment"][0] and status["collectives"][0]
    assert status["model_consistency"] == (False, "interrupted")
    assert not list((tmp_path / "report").glob(".report-*"))  # no offer left unpublished


def test_rank_hang_is_diagnosed_by_the_watchdog(tmp_path):
    res, report = consistency_run(tmp_path, "--model", f"{FIXTURES}/model_rank_hang.py:build", "--timeout", "6")
    assert res.returncode != 0
    [f] = report["findings"]
    assert f["kind"] == "hang" and f["ranks"] == [1], f
    if "1" in f["detail"]["stacks"]:
        assert "model_rank_hang.py:25" in f["message"] and f["detail"]["line"] == 25
    else:  # py-spy could not dump rank 1 in time on a loaded host: its absence from rank 0's collective names it
        assert "rank 1 never arrived in all_gather" in f["message"], f["message"]
    assert "rank 0 waits in all_gather" in f["message"]
    names = [c["name"] for c in report["checks"]]
    assert names[:3] == ["environment", "collectives", "model_consistency"] and names[-1] == "watchdog"
    assert (tmp_path / "report" / "stacks.txt").exists() and report["artifacts"]["stacks.txt"] == "stacks.txt"
