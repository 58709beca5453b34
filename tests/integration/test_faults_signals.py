"""Stop signals at every moment of a ``run --nproc`` launcher (issue 25, item 5): 0.1 s after the start, while the
ranks import the script's modules, right after the ranks finished, and while the report is being built.

The rule (docs/hangs-and-faults.md#signals): a stop signal that arrives while a rank still runs, or before any started,
stops the run: a ``hang`` finding with ``detail.stopped_by``, FAILED, exit 1; before any collective completed it is
a stop "during start-up" that names no line of the script. One that arrives after every rank has finished stops
nothing: the verdict is the run's own and ``warnings`` says the signal came. Each test asserts the report, the exit
code, a bounded time and that no process is left, found by an environment tag set on the launch (never by name).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from launch_helpers import FRESH, TAG, env_for_ranks, kill_tagged, load_report, tagged

CORRECT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range({n}):
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def caught(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler installed for ``sig`` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def exited_scripts(out: Path) -> int:
    """How many ranks wrote their exit line."""
    count = 0
    for path in out.glob("trace-rank*.jsonl"):
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - 512))
                count += b'"ev":"exit"' in fh.read()
        except OSError:
            pass
    return count


def rank_pids(out: Path) -> list[int]:
    pids = []
    for path in out.glob("trace-rank*.jsonl"):
        try:
            pids.append(json.loads(path.read_text().splitlines()[0])["pid"])
        except (OSError, IndexError, ValueError, KeyError):
            pass
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Launcher:
    """``python -m distcheck run --nproc 2`` as users start it (a fresh interpreter, its own session), tagged."""

    def __init__(self, tmp_path: Path, script: str, timeout: str = "30", env: dict[str, str] | None = None):
        self.tag = uuid.uuid4().hex
        self.out = tmp_path / "report"
        path = tmp_path / "train.py"
        path.write_text(textwrap.dedent(script))
        self.script = path
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", timeout,
             "--report-dir", str(self.out), "--", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env=env_for_ranks({TAG: self.tag, **(env or {})}))

    def signal_when(self, condition, limit: float = 60.0, sig: int = signal.SIGTERM) -> float:
        """Send ``sig`` to the launcher (only) as soon as ``condition()`` holds; returns when, since the start."""
        deadline = time.monotonic() + limit
        while not condition():
            assert self.proc.poll() is None, f"the launcher ended before the moment: {self.proc.communicate()}"
            assert time.monotonic() < deadline, "the run never got to the moment the test needs"
            time.sleep(0.002)
        assert self.proc.poll() is None, "the launcher ended before the signal"
        self.proc.send_signal(sig)
        return time.monotonic() - self.started

    def finish(self, limit: float) -> tuple[int, str, str, float]:
        t0 = time.monotonic()
        try:
            out, err = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            self.cleanup()
            out, err = self.proc.communicate()
            raise AssertionError(f"the launcher did not end within {limit}s:\n{out}\n{err}") from None
        return self.proc.returncode, out, err, time.monotonic() - t0

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in tagged(self.tag)
                if Path(f"/proc/{pid}").exists()}
        assert not left, f"processes left behind: {left}"

    def cleanup(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tagged(self.tag)
        self.proc.wait(timeout=10)


def stop_finding(report: dict) -> dict:
    (f,) = [f for f in report["findings"] if f["kind"] == "hang"]
    return f


@pytest.mark.parametrize("env", [None, FRESH], ids=["forked-ranks", "fresh-ranks"])
def test_sigterm_0_1s_after_the_start_is_a_stop_during_start_up(tmp_path, env):
    """The handlers are installed before anything heavy is imported: the signal gives a report, not exit -15.
    Ranks forked from the session's zygote may already run the script; fresh ones still import torch."""
    # The ranks wait before their first collective: forked ones reach the script in milliseconds, and three
    # all_reduces would then end inside the dump, where the signal rightly stops nothing (CI saw it once).
    launch = Launcher(tmp_path, CORRECT.replace("t = torch.ones(4)", "t = torch.ones(4)\nimport time\n"
                                                "time.sleep(20)").format(n=3), env=env)
    try:
        # 0.1 s after the start; on a machine so loaded that the interpreter itself is not up by then, the moment
        # the handler exists (the first thing `python -m distcheck run` does).
        def moment() -> bool:
            return time.monotonic() - launch.started >= 0.1 and caught(launch.proc.pid, signal.SIGTERM)

        launch.signal_when(moment, limit=5)
        sent = time.monotonic() - launch.started
        code, stdout, stderr, seconds = launch.finish(30)
        assert code == 1, (sent, stdout, stderr)
        assert seconds < 15
        report = load_report(launch.out)
        assert not report["ok"] and report["world_size"] == 2
        f = stop_finding(report)
        assert f["detail"]["stopped_by"] == "SIGTERM" and f["detail"]["phase"] == "start-up"
        assert f["message"].startswith("the run was stopped from outside by SIGTERM during start-up"), f["message"]
        # Forked ranks may already run the script (then a rank may wait in its first collective), but no line of
        # the script's imports is ever named.
        imports = [n for n, line in enumerate(launch.script.read_text().splitlines(), 1) if line.startswith("import")]
        assert not any(f"train.py:{n}" in f["message"] for n in imports) and "<module>" not in f["message"]
        assert "distcheck FAILED" in stdout and "Traceback" not in stderr
        assert (launch.out / "report.txt").exists()
        launch.assert_nothing_left()
    finally:
        launch.cleanup()


def test_sigterm_while_the_script_imports_blames_no_import_line(tmp_path):
    """The ranks run the script, which is still importing its modules: a stop during start-up, not a hang at the
    script's import line."""
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(60)\n")
    launch = Launcher(tmp_path, """
        import torch
        import slow_module  # IMPORT
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(2))
        """)
    try:
        traced: dict[str, float] = {}

        def importing() -> bool:  # both ranks traced (the script runs), then a moment for the import to start
            if len(rank_pids(launch.out)) < 2:
                return False
            traced.setdefault("t", time.monotonic())
            return time.monotonic() - traced["t"] > 1.0

        launch.signal_when(importing, limit=60)
        code, stdout, stderr, seconds = launch.finish(30)
        assert code == 1, (stdout, stderr)
        assert seconds < 15
        report = load_report(launch.out)
        f = stop_finding(report)
        assert f["detail"]["stopped_by"] == "SIGTERM" and f["detail"]["phase"] == "start-up"
        assert "during start-up" in f["message"], f["message"]
        assert "train.py" not in f["message"] and "<module>" not in f["message"], f["message"]
        assert f["detail"].get("file") is None and f["ranks"] == [0, 1]
        assert f["detail"]["stacks"], "the ranks that ran the script are still dumped (stacks.txt)"
        assert not report["ok"] and "distcheck FAILED" in stdout
        launch.assert_nothing_left()
    finally:
        launch.cleanup()


def test_sigterm_right_after_the_ranks_finished_keeps_the_verdict(tmp_path):
    """Both ranks wrote their exit line: the signal stops nothing; PASSED, exit 0, and a warning that says so."""
    launch = Launcher(tmp_path, CORRECT.format(n=20))
    try:
        launch.signal_when(lambda: exited_scripts(launch.out) == 2, limit=90)
        code, stdout, stderr, seconds = launch.finish(30)
        assert seconds < 10
        report = load_report(launch.out)
        assert code == 0 and report["ok"], (stdout, stderr)
        assert not report["findings"]
        (w,) = [w for w in report.get("warnings", []) if w["kind"] == "stop_signal"]
        assert "SIGTERM" in w["message"] and "after every rank had finished" in w["message"], w["message"]
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["ranks_completed"]["ok"] and "stopped" not in checks["ranks_completed"].get("note", "")
        assert "distcheck PASSED" in stdout and "stop_signal" in (launch.out / "report.txt").read_text()
        launch.assert_nothing_left()
    finally:
        launch.cleanup()


def test_sigterm_while_the_report_is_built_keeps_the_verdict(tmp_path):
    """Every rank has exited and the launcher is building the report: a complete report, the run's own verdict."""
    launch = Launcher(tmp_path, CORRECT.format(n=1500))
    try:
        def ranks_gone() -> bool:
            pids = rank_pids(launch.out)
            return exited_scripts(launch.out) == 2 and len(pids) == 2 and not any(alive(p) for p in pids)

        launch.signal_when(ranks_gone, limit=120)
        code, stdout, stderr, seconds = launch.finish(30)
        assert seconds < 10
        report = load_report(launch.out)
        assert code == 0 and report["ok"], (stdout, stderr)
        (w,) = [w for w in report.get("warnings", []) if w["kind"] == "stop_signal"]
        assert "SIGTERM" in w["message"]
        assert report["artifacts"].get("trace.json") and (launch.out / "report.txt").exists()
        assert "distcheck PASSED" in stdout
        launch.assert_nothing_left()
    finally:
        launch.cleanup()
