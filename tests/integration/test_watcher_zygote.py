"""A torchrun rank's node watcher, forked by the shared zygote that forked the rank (rank/bootstrap.py,
start_node_watcher), outlives that rank as a Popen'd one does: torchrun stops and restarts the ranks, and the
watcher must go on to write the report and watch the next attempt. The real restart is
test_torchrun_fail_fast.py::test_a_job_that_passes_on_its_second_attempt_passes_and_the_report_lists_both.

    pytest tests/integration/test_watcher_zygote.py      # needs the session's shared zygote (DISTCHECK_ZYGOTE)
"""
from __future__ import annotations

import os
import select
import signal
import socket
import struct
import time

import pytest

from launch_helpers import env_for_ranks

from distcheck.contract import env as env_names
from distcheck.contract import watcher_file
from distcheck.contract.watcher_file import NOT_YET
from distcheck.processes import alive, start_ticks
from distcheck.supervise.zygote import Zygote

# A rank as zygote.stand_in forks one: it starts its node's watcher, says which, and waits to be killed.
RANK = """\
import sys, time
from distcheck.rank.bootstrap import start_node_watcher

watcher = start_node_watcher(sys.argv[1], 60.0)
print(watcher.pid, watcher.started, watcher.process is None, flush=True)
time.sleep(120)
"""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _read_line(fd: int, timeout: float) -> str:
    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            raise AssertionError(f"no line from the rank within {timeout}s: {data!r}")
        data += chunk
    return data.decode()


def _read_rest(fd: int, timeout: float) -> str:
    """What is left in the pipe until every writer closed it."""
    data, deadline = b"", time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"the pipe is still open after {timeout}s: {data!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            return data.decode(errors="replace")
        data += chunk


def test_a_watcher_the_zygote_forks_outlives_the_rank_that_asked_for_it_and_ends_by_itself(tmp_path, shared_zygote):
    if not shared_zygote or shared_zygote in ("0", "1"):
        pytest.skip("this session runs without a shared zygote (DISTCHECK_ZYGOTE=0)")
    script, report_dir = tmp_path / "rank.py", tmp_path / "report"
    script.write_text(RANK)
    report_dir.mkdir()
    zygote = Zygote(shared_zygote)  # this test's connection owns the rank, as torchrun's stand-in does
    zygote_pid = struct.unpack("3i", zygote.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))[0]
    read_end, write_end = os.pipe()
    rank, watcher = None, None
    try:
        # This process plays torchrun's agent; the rank names the zygote, its parent, as its ptracer.
        env = env_for_ranks({env_names.AGENT_PID: str(os.getpid()), env_names.ZYGOTE: shared_zygote})
        env.pop(env_names.PTRACER, None)
        rank = zygote.spawn([str(script), str(report_dir)], env, stdout=write_end, stderr=write_end,
                            new_session=True)
        os.close(write_end)
        write_end = -1
        pid, started, not_popen = _read_line(read_end, timeout=60).split()
        watcher = int(pid)
        ticks = start_ticks(watcher)
        assert (started, not_popen) == ("True", "True")  # the rank's to wait for and end, not its child
        assert _ppid(watcher) == zygote_pid != rank.pid  # forked by the zygote: no interpreter start, no imports
        # The zygote replies once it forked: the child sets itself up (session, descriptors) on its own time. Its
        # first state comes after, from the watcher's own code.
        deadline = time.monotonic() + 30
        while getattr(watcher_file.read(report_dir), "pid", None) != watcher and time.monotonic() < deadline:
            time.sleep(0.02)
        first = watcher_file.read(report_dir)
        assert first is not None and first.pid == watcher, "the watcher ended before it wrote its first state"
        assert first.reported == NOT_YET  # watching, not yet done
        assert os.getsid(watcher) == watcher  # a session of its own: torchrun's group signals miss it
        assert os.readlink(f"/proc/{watcher}/fd/0") == "/dev/null"
        for fd in (1, 2):  # the job's console
            assert os.readlink(f"/proc/{watcher}/fd/{fd}") == os.readlink(f"/proc/{rank.pid}/fd/{fd}")

        # The rank's own connection to the zygote closed as soon as the watcher was forked, and the rank dies now:
        # the zygote must SIGKILL neither (a rank's processes die with its connection, not a detached one).
        rank.kill()
        assert rank.wait(timeout=30) == -signal.SIGKILL
        # With no rank left to watch (none ever registered) it ends by itself, after writing its state: a watcher
        # the zygote killed would leave the state of a watch that never ended.
        deadline = time.monotonic() + 30
        while alive(watcher) and start_ticks(watcher) == ticks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(watcher), "the watcher did not end by itself"
        state = watcher_file.read(report_dir)
        assert state is not None and state.pid == watcher and state.ticks == ticks
        assert state.reported == 0 != NOT_YET and state.code == 0, state
        # Nothing on the console (its log is a file) that a fresh interpreter would not print: no runpy warning
        # about a module the zygote preloaded.
        assert _read_rest(read_end, timeout=30) == ""
        watcher = None
    finally:
        if rank is not None:
            rank.kill()
        if watcher is not None and alive(watcher) and start_ticks(watcher) == ticks:
            os.kill(watcher, signal.SIGKILL)  # started by this test's rank: never left behind
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        zygote.sock.close()
