"""Issue 31: under torchrun the ranks only write files. A rank whose script fails exits at once with its own code,
torchrun's agent stops the others, and the node watcher (a process outside the ranks) writes the report: the job
ends as it would without distcheck, not at the no-progress limit. (bench/bench_fail_fast.py times both ways.)"""
from __future__ import annotations

import socket
import time

from launch_helpers import FIXTURES, free_port, load_report, torchrun

FIXTURE = "torchrun_rank_fails.py"


def test_a_failing_rank_ends_the_torchrun_job_at_once_and_the_report_says_where_the_others_were(tmp_path, line_of):
    out = tmp_path / "report"
    started = time.monotonic()
    # --timeout 300: the old rank-0 monitor waited out this limit; the job must end long before it
    res = torchrun(["-m", "distcheck", "run", "--timeout", "300", "--report-dir", str(out), "--",
                    str(FIXTURES / FIXTURE)], timeout=200)
    assert time.monotonic() - started < 100, res.output
    assert res.returncode == 1, res.output
    report = load_report(out)  # there when torchrun returns: local rank 0 or the watcher wrote it before
    assert not report["ok"]
    failures = [f for f in report["findings"] if f["kind"] == "rank_failure"]
    assert [f["ranks"] for f in failures] == [[1]], report["findings"]
    assert failures[0]["detail"]["line"] == line_of(FIXTURE, 'open(f"/nonexistent/shard')
    assert not [f for f in report["findings"] if f["kind"] == "hang"], report["findings"]
    [stopped] = [w for w in report["warnings"] if w["kind"] == "stopped_by_torchrun"]
    sleep = line_of(FIXTURE, "time.sleep(30)")
    assert stopped["ranks"] == [0] and f"rank 0 is in load_batch ({FIXTURE}:{sleep})" in stopped["message"]
    assert "after rank 1 failed (FileNotFoundError" in stopped["message"]
    assert report["ranks"]["0"]["state"] == "stopped"


def test_a_passing_torchrun_job_has_its_report_when_torchrun_returns(tmp_path):
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "run", "--report-dir", str(out), "--", str(FIXTURES / "ok" / "ddp_unseeded.py")],
                   timeout=200)
    assert res.returncode == 0, res.output
    report = load_report(out)
    assert report["ok"] and report["findings"] == [] and "distcheck PASSED" in res.stdout


def test_a_restart_after_gloos_rendezvous_passes_its_second_attempt(tmp_path):
    """Attempt 0 fails after init_process_group and a DDP step, under --standalone: attempt 1 must not read attempt
    0's keys in the agent's shared store (gloo's dead addresses), and passes."""
    from launch_helpers import run_python

    out = tmp_path / "report"
    res = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "-m", "distcheck", "run", "--timeout", "60", "--report-dir", str(out), "--",
                      str(FIXTURES / "torchrun_restart_after_init.py")], timeout=200)
    assert res.returncode == 0, res.output
    report = load_report(out)
    assert report["ok"] and report["findings"] == []
    first, last = report["attempts"]
    assert first["ok"] is False and last["summary"] == "PASSED"
    earlier = load_report(out / "attempt-0")
    assert any(f["kind"] == "rank_failure" and f["message"].startswith("rank 1 raised OSError: shard-1.bin")
               for f in earlier["findings"]), earlier["findings"]


def test_a_job_that_passes_on_its_second_attempt_passes_and_the_report_lists_both(tmp_path, line_of):
    """Real torchrun restarts (a static rendezvous here; --standalone's in the test above)."""
    from launch_helpers import run_python

    out = tmp_path / "report"
    fixture = "torchrun_restart.py"
    # --timeout 60: were an attempt to hang (once, in a clean-clone suite run, both ranks of attempt 1 stopped after
    # their 3 steps and the test's own limit ended them undiagnosed), the watchdog's stacks would say where.
    res = run_python(["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-port",
                      str(free_port()), "--max-restarts", "1", "-m", "distcheck", "run", "--timeout", "60",
                      "--report-dir", str(out), "--", str(FIXTURES / fixture)], timeout=200)
    assert res.returncode == 0, res.output  # the verdict and the exit code follow the last attempt
    report = load_report(out)
    assert report["ok"] and report["findings"] == []
    first, last = report["attempts"]
    assert (first["attempt"], first["ok"], last["attempt"], last["summary"]) == (0, False, 1, "PASSED")
    line = line_of(fixture, 'open("/nonexistent/shard-0.bin"')
    assert first["summary"].startswith("rank 1 raised FileNotFoundError") and f"{fixture}:{line}" in first["summary"]
    assert "attempt 0: rank 1 raised FileNotFoundError" in res.stdout and "attempt 1: PASSED" in res.stdout
    earlier = out / "attempt-0"
    assert load_report(earlier)["ok"] is False and (earlier / "trace-rank1.jsonl").exists()
    assert "FileNotFoundError" not in (out / "trace-rank1.jsonl").read_text()  # the attempts' files never mix
    # One watcher for the agent's lifetime: the one attempt 0's local rank 0 started watched attempt 1 too, and
    # ended with the agent.
    from distcheck.contract import watcher_file
    from distcheck.processes import alive

    state = watcher_file.read(out)
    assert (state.watching, state.reported, state.code) == (1, 1, 0)
    log = (out / f"watcher-{socket.gethostname()}.log").read_text()
    assert log.count("attempt 1 of torchrun's ranks started: watching it") == 1, log
    deadline = time.monotonic() + 5.0
    while alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(state.pid)
