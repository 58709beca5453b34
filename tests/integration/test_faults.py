"""Fault injection on real ranks: signals to the launcher, killed ranks, a killed launcher, a segfault, a report dir
that disappears midway, py-spy missing. Each test asserts the report (or the stated fallback), the exit code, a
bounded time and that no rank outlives the run."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_helpers import FIXTURES, FRESH, env_for_ranks, load_report

from distcheck.analysis.trace_events import load_traces


def rank_pids(report_dir: Path) -> dict[int, int]:
    out = {}
    for path in report_dir.glob("trace-rank*.jsonl"):
        for line in path.read_text().splitlines():
            data = json.loads(line)
            if data.get("ev") == "meta":
                out[int(data["rank"])] = int(data["pid"])
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Launch:
    """A launcher (``python -m distcheck ARGS`` or torchrun) in its own session, so that signals reach only it.

    ``output=subprocess.DEVNULL`` where nothing reads it: a report printed into an unread pipe could block."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, output: int = subprocess.PIPE):
        self.proc = subprocess.Popen(cmd, stdout=output, stderr=output, text=True, env=env_for_ranks(env),
                                     start_new_session=True)

    def wait_until(self, condition, limit: float = 90) -> None:
        deadline = time.monotonic() + limit
        while not condition():
            assert self.proc.poll() is None, f"the launcher ended early: {self.proc.communicate()}"
            assert time.monotonic() < deadline, "the ranks never got where the test needs them"
            time.sleep(0.1)

    def finish(self, limit: float) -> tuple[int, str, str, float]:
        t0 = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,args"], capture_output=True, text=True).stdout
            ps = "\n".join(line[:160] for line in ps.splitlines() if "distcheck" in line or "tee" in line)
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            raise AssertionError(f"the launcher did not end within {limit}s:\n{out}\n{err}\n{ps}") from None
        return self.proc.returncode, out, err, time.monotonic() - t0

    def cleanup(self, report_dir: Path | None = None) -> None:
        """End the launcher's process group and, given its report dir, every rank it names (torchrun starts its
        ranks in sessions of their own, out of the group's reach)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        for pid in rank_pids(report_dir).values() if report_dir is not None else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stuck(out: Path) -> bool:
    """hang_python.py's ranks are in place: rank 1 sleeps in load_shard (its all_reduce #1 ended: under load rank 0
    can be in #2 while rank 1 is still in #1, and a stop then found both in collectives), rank 0 waits in
    all_reduce #2."""
    traces = load_traces(out)
    first, second = traces.get(0), traces.get(1)
    return (first is not None and len(first.events) >= 2 and second is not None and len(second.events) >= 1
            and second.events[0].completed and len(rank_pids(out)) == 2)


def hanging(tmp_path: Path, timeout: str = "300", env: dict[str, str] | None = None) -> tuple[Launch, Path]:
    """hang_python.py under run --nproc 2, once its ranks are stuck."""
    out = tmp_path / "report"
    launch = Launch([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", timeout,
                     "--report-dir", str(out), "--", str(FIXTURES / "hang_python.py")], env)
    _wait_until_stuck(launch, out)
    return launch, out


def _wait_until_stuck(launch: Launch, out: Path) -> None:
    try:
        launch.wait_until(lambda: stuck(out))
    except BaseException:  # the test never gets the launch: end it here
        launch.cleanup(out)
        raise
    time.sleep(0.2)  # rank 1's step from its ended all_reduce into load_shard's sleep, on a loaded machine


def torchrun_hanging(tmp_path: Path, timeout: str, output: int = subprocess.PIPE,
                     env: dict[str, str] | None = FRESH) -> tuple[Launch, Path]:
    """hang_python.py under ``torchrun -m distcheck run`` (signals reach the agent only), once its ranks are stuck.

    The ranks are fresh interpreters, torchrun's own children; ``env=None``: forked by the session's zygote, with
    torchrun's children standing in for them (distcheck/supervise/zygote.py, stand_in)."""
    from launch_helpers import BIN

    out = tmp_path / "report"
    launch = Launch([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "distcheck", "run",
                     "--timeout", timeout, "--report-dir", str(out), "--", str(FIXTURES / "hang_python.py")],
                    env, output=output)
    _wait_until_stuck(launch, out)
    return launch, out


def assert_ranks_started_as(launch: Launch, pids: dict[int, int], env: dict[str, str] | None) -> None:
    """Fresh ranks are the agent's children; forked ones are the zygote's, and the agent's children stand in."""
    parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids.values()}
    if env is FRESH:
        assert parents == {launch.proc.pid}, parents
    else:
        assert len(parents) == 1 and launch.proc.pid not in parents, parents
        assert "distcheck.supervise.zygote" in Path(f"/proc/{parents.pop()}/cmdline").read_text()


def processes_of(report_dir: Path) -> list[int]:
    """Live processes started for this report dir: ranks, and rank 0's store host (rank/store_host.py), which
    inherits rank 0's environment."""
    needle = f"DISTCHECK_REPORT_DIR={report_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def assert_no_rank_left(pids: dict[int, int], report_dir: Path) -> None:
    deadline = time.monotonic() + 10
    while (any(alive(p) for p in pids.values()) or processes_of(report_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids.values()), f"ranks left behind: {pids}"
    assert not processes_of(report_dir), f"processes left behind: {processes_of(report_dir)}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_launcher_leaves_a_complete_report(tmp_path, line_of, sig):
    launch, out = hanging(tmp_path)
    try:
        pids = rank_pids(out)
        launch.proc.send_signal(sig)
        code, stdout, stderr, seconds = launch.finish(60)
        assert code == 1, stderr
        assert seconds < 10 + 8  # 10 s plus the stack dump's own bound
        report = load_report(out)
        assert not report["ok"]
        (f,) = [f for f in report["findings"] if f["kind"] == "hang"]
        assert f["detail"]["stopped_by"] == sig.name and f["ranks"] == [1]
        assert f["message"].startswith(f"the run was stopped from outside by {sig.name} after ")
        assert f"rank 1 is in load_shard (hang_python.py:{line_of('hang_python.py', '# HANG')})" in f["message"]
        assert set(f["detail"]["stacks"]) == {"0", "1"} and f["detail"]["last_collectives"]["0"]["last_started"]
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["ranks_completed"]["note"] == f"stopped from outside by {sig.name}"
        assert "distcheck FAILED" in stdout and (out / "stacks.txt").exists()
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup()


def test_a_second_signal_stops_at_once(tmp_path):
    launch, out = hanging(tmp_path, env={"DISTCHECK_PYSPY": "/nonexistent/py-spy"})
    try:
        pids = rank_pids(out)
        launch.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        launch.proc.send_signal(signal.SIGTERM)
        code, _, stderr, seconds = launch.finish(30)
        assert code == 1 and seconds < 10 and "stopped at once by a second SIGTERM" in stderr
        assert (out / "trace-rank0.jsonl").exists()  # what was written stays
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup()


def test_sigkill_of_one_rank_is_a_rank_failure_naming_it(tmp_path):
    """The report's content is the subject: the ranks fork from the session's zygote (fresh ranks' deaths under
    the launcher and under torchrun are the SIGKILL tests' [fresh] cases)."""
    launch, out = hanging(tmp_path, env=None)
    try:
        pids = rank_pids(out)
        os.kill(pids[1], signal.SIGKILL)
        code, _, stderr, seconds = launch.finish(60)
        assert code == 1 and seconds < 30, stderr
        report = load_report(out)
        first = report["findings"][0]  # the cause first; rank 0's connection error is its consequence
        assert first["kind"] == "rank_failure" and first["ranks"] == [1]
        assert first["message"].startswith("rank 1 died from SIGKILL") and "rank 0 failed in all_reduce" in \
            first["message"] and "0" in first["detail"].get("consequences", {})
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup()


@pytest.mark.parametrize("env", [FRESH, None], ids=["fresh", "zygote"])
def test_sigkill_of_the_launcher_takes_the_ranks_along(tmp_path, env):
    launch, out = hanging(tmp_path, env=env)
    try:
        pids = rank_pids(out)
        launch.proc.send_signal(signal.SIGKILL)
        launch.finish(10)
        # Fresh ranks die with their parent (PR_SET_PDEATHSIG); the shared zygote of the test session ends the
        # ranks of a connection that closes; the store host sees end-of-file on its lifeline either way.
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup()


def test_a_segfaulting_rank_is_named_with_its_line_and_stderr(tmp_path, line_of):
    """A forked rank dies of SIGSEGV as a fresh one does: its own faulthandler prints the stack to its stderr."""
    out = tmp_path / "report"
    launch = Launch([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "60", "--report-dir",
                     str(out), "--", str(FIXTURES / "fault_segfault.py")], None)
    try:
        code, _, stderr, seconds = launch.finish(120)
        assert code == 1, stderr
        report = load_report(out)
        (f,) = [f for f in report["findings"] if f["kind"] == "rank_failure"]
        bug = line_of("fault_segfault.py", "# BUG")
        assert f["ranks"] == [1] and f["detail"]["signal"] == "SIGSEGV" and f["detail"]["line"] == bug
        assert f"rank 1 died from SIGSEGV (exit code -11) in native_op at fault_segfault.py:{bug}" in f["message"]
        tail = f["detail"]["stderr_tail"]["1"]
        assert 0 < len(tail) <= 40 and any("fault_segfault.py" in line for line in tail)
    finally:
        launch.cleanup()


def test_a_report_dir_that_disappears_midway_sends_the_report_to_stderr(tmp_path):
    launch, out = hanging(tmp_path, timeout="4")
    try:
        pids = rank_pids(out)
        out.rename(tmp_path / "moved")
        out.write_text("not a directory any more")
        code, _, stderr, seconds = launch.finish(60)
        assert code == 1 and seconds < 40
        assert "could not write the report into" in stderr
        document = json.loads(stderr[stderr.index("\n{") + 1:])
        assert document["tool"] == "distcheck" and not document["ok"]
        assert [f["kind"] for f in document["findings"]] == ["hang"]
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup()


def test_py_spy_missing_falls_back_to_faulthandler(tmp_path, line_of):
    launch, out = hanging(tmp_path, timeout="4", env={"DISTCHECK_PYSPY": "/nonexistent/py-spy"})
    try:
        code, _, stderr, seconds = launch.finish(60)
        assert code == 1, stderr
        (f,) = [f for f in load_report(out)["findings"] if f["kind"] == "hang"]
        assert set(f["detail"]["methods"].values()) == {"faulthandler"}
        assert f["ranks"] == [1] and f["detail"]["line"] == line_of("hang_python.py", "# HANG")
    finally:
        launch.cleanup()


# Each signal once, each way of starting ranks once: a stand-in passes SIGINT on to its rank as it does SIGTERM.
@pytest.mark.parametrize("sig, env", [(signal.SIGTERM, FRESH), (signal.SIGINT, None)],
                         ids=["SIGTERM", "SIGINT-stand-in"])
def test_a_stop_signal_to_torchrun_leaves_the_report(tmp_path, line_of, sig, env):
    """torchrun's agent passes the signal on: each rank dumps its own stacks, the node watcher writes the report.
    A stand-in passes it on to its rank."""
    launch, out = torchrun_hanging(tmp_path, "300", env=env)
    try:
        pids = rank_pids(out)
        assert_ranks_started_as(launch, pids, env)
        launch.proc.send_signal(sig)
        _, stdout, stderr, seconds = launch.finish(60)
        assert seconds < 10 + 8
        deadline = time.monotonic() + 10  # the node watcher writes right after the ranks are gone
        while not (out / "report.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        report = load_report(out)
        (f,) = report["findings"]
        assert f["kind"] == "hang" and f["ranks"] == [1] and f["detail"]["stopped_by"] == sig.name
        assert f"rank 1 is in load_shard (hang_python.py:{line_of('hang_python.py', '# HANG')})" in f["message"]
        assert report["command"].startswith("distcheck run --timeout 300")
        assert "distcheck FAILED" in stdout + stderr  # printed to the job's console
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup(out)


def test_a_stop_signal_that_reaches_one_rank_first_names_where_the_other_waited(tmp_path, line_of):
    """Stop signals reach the ranks one by one: rank 1 gets SIGTERM alone and dies (dumping where it was), and rank
    0's all_reduce then fails with gloo's "Connection closed by peer" before anything signals it. The report is
    the stop's, with rank 0 placed in the all_reduce it waited in: its lost peer is the consequence, never the
    cause (it was named as the rank that failed first, or as a second hung rank; 1 in 27 loop runs of the SIGINT
    test below under load)."""
    launch, out = torchrun_hanging(tmp_path, "300")
    try:
        pids = rank_pids(out)
        os.kill(pids[1], signal.SIGTERM)
        _, stdout, stderr, _ = launch.finish(60)
        deadline = time.monotonic() + 10  # the node watcher writes right after the ranks are gone
        while not (out / "report.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        report = load_report(out)
        (f,) = report["findings"]
        assert f["kind"] == "hang" and f["ranks"] == [1] and f["detail"]["stopped_by"] == "SIGTERM", f
        assert f["detail"]["failed_first"] == [] and f["detail"]["died_first"] == []
        hang, wait = line_of("hang_python.py", "# HANG"), line_of("hang_python.py", "# WAIT")
        assert f["message"] == ("the run was stopped from outside by SIGTERM (torchrun passed it on to the ranks): "
                                f"rank 1 is in load_shard (hang_python.py:{hang}) while rank 0 waits in "
                                f"all_reduce #2 (hang_python.py:{wait})"), f["message"]
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup(out)


def test_the_rendezvous_store_dying_with_torchruns_agent(tmp_path, line_of):
    """torchrun's agent hosts the rendezvous store: SIGKILL it. The node watcher, outside the agent, still
    diagnoses the hang, writes the report and ends the orphaned ranks."""
    launch, out = torchrun_hanging(tmp_path, "4", output=subprocess.DEVNULL, env=None)  # stand-ins: cheaper
    try:
        pids = rank_pids(out)
        launch.proc.kill()  # the agent and its store are gone; the ranks are orphans now
        launch.proc.wait(timeout=10)
        t0 = time.monotonic()
        while not (out / "report.json").exists() and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert time.monotonic() - t0 < 4 + 30, "no report after the store died"
        (f,) = [f for f in load_report(out)["findings"] if f["kind"] == "hang"]
        assert f["ranks"] == [1] and f["detail"]["line"] == line_of("hang_python.py", "# HANG")
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup(out)


@pytest.mark.parametrize("env", [FRESH, None], ids=["fresh", "stand-in"])
def test_sigkill_of_a_rank_under_torchrun_still_yields_a_report_naming_it(tmp_path, env):
    """torchrun then stops rank 0 before it writes the report: the node watcher writes it from the files. A rank's
    stand-in dies of the rank's signal, so torchrun sees the same death."""
    launch, out = torchrun_hanging(tmp_path, "300", output=subprocess.DEVNULL, env=env)
    try:
        pids = rank_pids(out)
        assert_ranks_started_as(launch, pids, env)
        os.kill(pids[1], signal.SIGKILL)
        launch.proc.wait(timeout=60)
        t0 = time.monotonic()
        while not (out / "report.json").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        report = load_report(out)
        (f,) = [f for f in report["findings"] if f["kind"] == "rank_failure"]
        assert f["ranks"] == [1] and f["message"].startswith(
            "rank 1 ended without finishing its script: os._exit or a signal (SIGKILL, the OOM killer, a hard crash; "
            "only torchrun's agent saw its exit code)")
        assert report["command"].startswith("distcheck run --timeout 300")
        assert_no_rank_left(pids, out)
    finally:
        launch.cleanup(out)


def test_a_stand_in_ranks_output_arrives_as_it_is_written(tmp_path):
    """torchrun starts `python -u`: a rank forked for a stand-in writes through too, so what a rank printed before it
    hung is on the job's console while it hangs (here: one rank, asleep after an unflushed print)."""
    from launch_helpers import BIN

    script = tmp_path / "talk.py"
    script.write_text("import time\nprint('before the sleep')\ntime.sleep(300)\n")
    out = tmp_path / "report"
    launch = Launch([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=1", "-m", "distcheck", "run",
                     "--timeout", "300", "--report-dir", str(out), "--", str(script)],
                    {"PYTHONUNBUFFERED": ""})  # unset (empty is unset for Python): only torchrun's -u counts
    try:
        seen, deadline = "", time.monotonic() + 90
        while "before the sleep" not in seen:
            assert time.monotonic() < deadline, f"the rank's line never arrived: {seen!r}"
            if select.select([launch.proc.stdout], [], [], 1.0)[0]:
                seen += launch.proc.stdout.readline()
        assert_ranks_started_as(launch, rank_pids(out), None)
    finally:
        launch.cleanup(out)
