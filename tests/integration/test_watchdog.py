"""The watch loop on real gloo ranks: the four hang fixtures, the no-hang control, and the per-node watcher.

Ranks run the fixture through a small bootstrap (written to tmp_path) that calls ``rank_bootstrap``: stack hooks,
the collective tracer, and (for the torchrun test) the node watcher on local rank 0. The other tests launch the
ranks themselves (env:// rendezvous, no torchrun agent to import) and supervise them with the one watch loop in
this process, as the distcheck launcher does.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch_helpers import FIXTURES, env_for_ranks, free_port, torchrun

from distcheck.analysis.trace_events import load_traces
from distcheck.processes import terminate
from distcheck.supervise.watch import DONE, HUNG, HangDump, RankFunctions, WatchLoop
from distcheck.supervise.zygote import start_process

BOOTSTRAP = '''\
import os, runpy, sys
from distcheck.rank.bootstrap import rank_bootstrap
rank_bootstrap(os.environ["DISTCHECK_REPORT_DIR"], float(os.environ["WATCH_TIMEOUT"]),
               watcher=os.environ.get("NODE_WATCHER") == "1")
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''



class Ranks:
    """``nproc`` rank processes of a fixture, launched directly with env:// rendezvous; killed by pid at the end."""

    def __init__(self, tmp_path: Path, fixture: str, nproc: int, timeout: float):
        self.report_dir = tmp_path / "report"
        self.report_dir.mkdir()
        boot = tmp_path / "boot.py"
        boot.write_text(BOOTSTRAP)
        port = free_port()
        self.procs = []
        for r in range(nproc):
            env = env_for_ranks({"RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r),
                                 "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                 "DISTCHECK_REPORT_DIR": str(self.report_dir), "WATCH_TIMEOUT": str(timeout)})
            # Forked by the session's zygote (tests/integration/conftest.py), as `run --nproc` ranks are here.
            with open(tmp_path / f"rank{r}.log", "w") as log:
                self.procs.append(start_process([str(boot), str(FIXTURES / fixture)], env, new_session=True,
                                        stdout=log.fileno(), stderr=log.fileno()))

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs) if p.poll() is None}

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                # The watchdog may have ended the rank a moment ago, before the zygote's notice of its exit came.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def supervise(tmp_path: Path, fixture: str, nproc: int, timeout: float, limit: float = 90):
    ranks = Ranks(tmp_path, fixture, nproc, timeout)
    deadline = time.monotonic() + limit
    # Short test timeouts count from the moment every rank has issued its first collective: importing torch and
    # the gloo rendezvous on 2 busy cores can take longer than the timeout itself.
    def started(r: int) -> bool:
        trace = load_traces(ranks.report_dir).get(r)
        return trace is not None and bool(trace.events)

    while time.monotonic() < deadline and not all(started(r) for r in range(nproc)):
        if any(p.poll() is not None for p in ranks.procs):
            break
        time.sleep(0.05)
    source = RankFunctions(ranks.pids, lambda: {r for r, p in enumerate(ranks.procs) if p.poll() is not None})
    loop = WatchLoop(ranks.report_dir, timeout, source=source, expected=nproc,
                     dump=HangDump(world_size=nproc), poll=0.1)
    try:
        result = loop.run()
        if result.state == HUNG:
            terminate(list(ranks.pids().values()))
        ended_at = time.monotonic()
        assert ended_at < deadline, f"{fixture}: neither finished nor declared hung within {limit}s"
        return result, ranks, ended_at
    finally:
        ranks.kill()


def test_native_fixture_really_holds_the_gil():
    """While hold_gil runs, a Python thread of the same process gets (almost) no time: the GIL is held."""
    # Stub torch out: hold_gil only needs ctypes, and importing torch would cost seconds on 2 busy cores.
    code = ("import sys, types; sys.modules['torch'] = t = types.ModuleType('torch')\n"
            "sys.modules['torch.distributed'] = t.distributed = types.ModuleType('torch.distributed')\n"
            "import threading, time, hang_native_gil as f\n"
            "n = 0\n"
            "def tick():\n"
            "    global n\n"
            "    while True:\n"
            "        n += 1; time.sleep(0.005)\n"
            "threading.Thread(target=tick, daemon=True).start(); time.sleep(0.3)\n"
            "before = n; f.hold_gil(1); during = n - before\n"
            "time.sleep(0.3); after = n - before - during\n"
            "print(during, after)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env_for_ranks())
    during, after = map(int, out.stdout.split())
    # A thread that ticks every 5 ms gets ~200 ticks in a free second. A tick or two on each side of the C call
    # (the GIL passes between the two threads just before and after it) is not the GIL being free: 3 was seen
    # with 4 test workers on 2 cores.
    assert during <= 5 and after >= 10, (during, after)


def test_watch_loop_fires_only_after_progress_stops(tmp_path):
    """A live process whose trace grows every 0.2 s never trips a 1 s timeout; when the writes stop, it fires."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    trace = tmp_path / "trace-rank0.jsonl"
    last_write = [time.monotonic()]

    def writer():
        for i in range(15):
            with open(trace, "a") as fh:
                fh.write(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0", "op": "all_reduce",
                                     "site": "t.py:1", "file": "/t.py", "line": 1, "t": time.time()}) + "\n")
                fh.write(json.dumps({"ev": "end", "id": i, "t": time.time()}) + "\n")
            last_write[0] = time.monotonic()
            time.sleep(0.2)

    loop = WatchLoop(tmp_path, 1.0, source=RankFunctions(lambda: {0: sleeper.pid}), expected=1,
                     dump=HangDump(world_size=1), poll=0.05)
    w = threading.Thread(target=writer)
    try:
        w.start()
        started = time.monotonic()
        result = loop.run()
        w.join()
        assert result.state == HUNG
        assert result.declared_at - started >= 2.8  # 3 s of steady progress with a 1 s timeout
        assert result.declared_at - last_write[0] >= 1.0
        (f,) = result.hang_findings
        assert f.kind == "hang" and f.ranks == [0]
        assert f.detail["last_collectives"]["0"]["last_completed"]["seq"] == 14
        assert (tmp_path / "stacks.txt").exists() and json.loads((tmp_path / "stacks.json").read_text())["ranks"]
    finally:
        w.join()
        sleeper.kill()
        sleeper.wait()


def test_terminate_escalates_to_sigkill(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    terminate([p.pid], grace=0.5)
    assert p.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - t0 < 5


@pytest.mark.parametrize("fixture,nproc,odd,odd_marker,waiting,wait_marker,message", [
    ("hang_native_gil.py", 2, [1], "# HANG", [0], "# WAIT",
     "rank 1 is in hold_gil (hang_native_gil.py:{odd}) holding the GIL while rank 0 waits in all_reduce #2 "
     "(hang_native_gil.py:{wait})"),
    # Async collectives return at once (as every NCCL one does): rank 0's stack is in its poll loop, and the
    # collective it is stuck on is the earliest whose Work never completed, not the last one it issued.
    ("hang_async.py", 2, [1], "# HANG", [0], "# FIRST",
     "rank 1 is in load_shard (hang_async.py:{odd}) while rank 0 waits in all_reduce #3 (hang_async.py:{wait})"),
    ("hang_missing_barrier.py", 3, [1], "# ODD", [0, 2], "# WAIT",
     "rank 1 is in all_reduce #2 (hang_missing_barrier.py:{odd}) while ranks 0,2 wait in barrier #2 "
     "(hang_missing_barrier.py:{wait})"),
    ("hang_subgroup.py", 4, [0], "# ODD", [1, 2, 3], "# WAIT",
     "rank 0 is in all_reduce #1 on group 0,1 (hang_subgroup.py:{odd}) where rank 1 never arrived while ranks 1-3 "
     "wait in all_reduce #2 (hang_subgroup.py:{wait})"),
])
def test_hang_fixture_is_diagnosed(line_of, tmp_path, fixture, nproc, odd, odd_marker, waiting, wait_marker, message):
    timeout = 3.0
    result, ranks, ended_at = supervise(tmp_path, fixture, nproc, timeout)
    assert result.state == HUNG, [p.returncode for p in ranks.procs]
    (f,) = result.hang_findings
    odd_line, wait_line = line_of(fixture, odd_marker), line_of(fixture, wait_marker)
    assert f.kind == "hang" and f.ranks == odd
    assert f.message == "no progress for 3s: " + message.format(odd=odd_line, wait=wait_line)
    assert f.detail["waiting_ranks"] == waiting
    assert f.detail["file"] == str(FIXTURES / fixture) and f.detail["line"] == odd_line
    assert set(f.detail["stacks"]) == {str(r) for r in range(nproc)}
    assert set(f.detail["methods"].values()) == {"py-spy"}
    # ends in time: the dump took well under the 10 s budget and every rank is gone
    assert result.diagnosed_at - result.declared_at < 10
    assert ended_at - result.declared_at < 15 and all(p.poll() is not None for p in ranks.procs)
    text = (ranks.report_dir / "stacks.txt").read_text()
    assert "MINORITY" in text and "last collectives (from the trace):" in text


def test_no_hang_control_runs_past_the_timeout_without_firing(tmp_path):
    result, ranks, _ = supervise(tmp_path, "hang_none.py", 2, timeout=3.0)
    assert result.state == DONE and result.hang_findings == []
    assert [p.returncode for p in ranks.procs] == [0, 0]


def test_node_watcher_under_torchrun_ends_the_job_and_writes_the_report(line_of, tmp_path):
    """No supervisor: local rank 0 starts the watcher process, which dumps, reports and ends the ranks."""
    report_dir = tmp_path / "report"
    boot = tmp_path / "boot.py"
    boot.write_text(BOOTSTRAP)
    t0 = time.monotonic()
    res = torchrun([str(boot), str(FIXTURES / "hang_python.py")], nproc=2, timeout=90,
                   env={"DISTCHECK_REPORT_DIR": str(report_dir), "WATCH_TIMEOUT": "6", "NODE_WATCHER": "1"})
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    # 6 s, not less: on a loaded 2-core machine two ranks' torch import and gloo set-up alone can take 3 s, and a
    # watcher that fires before rank 0 reaches its collective cannot tell the odd rank.
    assert elapsed < 6 + 45, elapsed  # startup + timeout + generous slack: the watcher ended the job
    report = json.loads((report_dir / "report.json").read_text())
    (f,) = report["findings"]
    sleep_line, wait_line = line_of("hang_python.py", "# HANG"), line_of("hang_python.py", "# WAIT")
    assert f["ranks"] == [1]
    assert f["message"] == (f"no progress for 6s: rank 1 is in load_shard (hang_python.py:{sleep_line}) while "
                            f"rank 0 waits in all_reduce #2 (hang_python.py:{wait_line})")
    assert f["detail"]["last_collectives"]["1"]["last_completed"]["seq"] == 1
    assert report["artifacts"]["stacks.txt"] == "stacks.txt" and (report_dir / "stacks.json").exists()
    # the watcher is gone too (it exits after ending the ranks)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            "distcheck.supervise.node_watcher" in _cmdline(p) and str(report_dir) in _cmdline(p) for p in _pids()):
        time.sleep(0.2)
    assert time.monotonic() < deadline, "node watcher still running"


def test_a_hung_torchrun_job_ends_after_its_console_went_away(line_of, tmp_path):
    """`torchrun ... | head`, a closed terminal, a killed CI log reader: the job's console is a pipe nobody reads
    when the watcher prints the hang's report. The BrokenPipeError ended the watcher before it ended the hung ranks,
    and the job hung for good (still running a minute later). The watcher drops what it cannot print, says so in its
    log, and ends the job; the report is whole."""
    report_dir = tmp_path / "report"
    console_r, console_w = os.pipe()
    proc = start_process(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distcheck", "run",
                          "--timeout", "5", "--report-dir", str(report_dir), "--", str(FIXTURES / "hang_python.py")],
                         env_for_ranks(None), new_session=True, stdout=console_w, stderr=console_w)
    os.close(console_w)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(report_dir.glob("stackhook-pid*.json"))) < 2:
            time.sleep(0.1)  # both ranks run: the console goes away before the hang is declared
        os.close(console_r)
        code = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert code != 0
    report = json.loads((report_dir / "report.json").read_text())
    (f,) = report["findings"]
    assert f["kind"] == "hang" and f["ranks"] == [1] and f"hang_python.py:{line_of('hang_python.py', '# HANG')}" in \
        f["message"], f["message"]
    (log,) = report_dir.glob("watcher-*.log")
    assert "the console is gone (BrokenPipeError on stderr)" in log.read_text(), log.read_text()
    assert not list(report_dir.glob("stackhook-pid*.json"))  # the watcher went on to its tidy-up


def _cmdline(pid: int) -> str:
    """A process's command line, "" once it has ended (it may end between the listing and the read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:
        return ""


def _pids() -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                Path(f"/proc/{d}/cmdline").read_text(errors="replace")
                out.append(int(d))
            except OSError:
                pass
    return out
