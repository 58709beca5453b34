"""One node watcher per torchrun agent, across restarts (``--max-restarts``), without launching anything: its
state file (contract/watcher_file.py), how a restarted attempt's ranks find it and wait for it, and how it finds
the next attempt's ranks. The real restart is tests/integration/test_torchrun_fail_fast.py."""
from __future__ import annotations

import json
import os
import socket

from distcheck.contract import stack_hook_file, watcher_file
from distcheck.contract.stack_hook_file import HookInfo
from distcheck.contract.watcher_file import WatcherState
from distcheck.processes import launcher_id, start_ticks
from distcheck.rank.bootstrap import NodeWatcher, live_watcher
from distcheck.supervise.node_watcher import Attempt, local_ranks, next_attempt

NO_SUCH_PID = 4194999  # above Linux's largest pid_max


def _hook(tmp_path, attempt: int, agent: int, rank: int = 0, max_restarts: int = 1) -> None:
    launch = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    stack_hook_file.write(tmp_path, HookInfo(os.getpid(), rank, 12, "x", "", socket.gethostname(), agent, launch))


def test_the_state_file_is_written_whole_and_read_back(tmp_path):
    assert watcher_file.read(tmp_path) is None
    state = WatcherState(os.getpid(), start_ticks(os.getpid()), "1:2", watching=1, reported=0, code=1)
    watcher_file.write(tmp_path, state)
    assert watcher_file.read(tmp_path) == state
    assert state.done_with(0) and not state.done_with(1)
    assert [p.name for p in tmp_path.iterdir()] == [f"watcher-{socket.gethostname()}.json"]  # no temp file left
    watcher_file.path(tmp_path).write_text("{not json")
    assert watcher_file.read(tmp_path) is None


def test_a_restarted_rank_finds_only_its_own_agents_live_watcher(tmp_path, monkeypatch):
    from distcheck.contract import env

    me = os.getpid()
    monkeypatch.setenv(env.AGENT_PID, str(me))  # this process plays the agent, and the watcher
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), launcher_id(me), watching=0))
    assert live_watcher(tmp_path).pid == me
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), "12:34", watching=0))  # another job's agent
    assert live_watcher(tmp_path) is None
    watcher_file.write(tmp_path, WatcherState(NO_SUCH_PID, 5, launcher_id(me), watching=0))  # it died
    assert live_watcher(tmp_path) is None
    watcher_file.write(tmp_path, WatcherState(me, 1, launcher_id(me), watching=0))  # its pid now another process's
    assert live_watcher(tmp_path) is None


def test_local_rank_0_takes_its_attempts_code_from_the_watcher_that_outlives_it(tmp_path):
    me = os.getpid()
    watcher = NodeWatcher(tmp_path, me, None)  # an earlier attempt's watcher: not this rank's child
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), "a", watching=1, reported=0, code=1))
    assert watcher.outcome(1, limit=0.3) is None  # attempt 0's code is not attempt 1's: it waits, bounded
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), "a", watching=1, reported=1, code=0))
    assert watcher.outcome(1, limit=5.0) == 0
    gone = NodeWatcher(tmp_path, NO_SUCH_PID, None)  # a watcher that died without saying: no code, at once
    assert gone.outcome(2, limit=30.0) is None


def test_the_watcher_finds_the_next_attempts_ranks_of_its_agent_and_ends_with_the_agent(tmp_path):
    me = os.getpid()
    first = Attempt(0, {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1"}, None)
    assert first.restarts_left
    _hook(tmp_path, attempt=1, agent=NO_SUCH_PID + 1)  # another agent's restart: not this watcher's
    assert next_attempt(str(tmp_path), NO_SUCH_PID, first) is None  # the agent has ended: so does the watcher
    _hook(tmp_path, attempt=1, agent=me)
    nxt = next_attempt(str(tmp_path), me, first)
    assert (nxt.number, nxt.world_size, nxt.local_world_size, nxt.restarts_left) == (1, 2, 2, False)
    assert nxt.run_id.endswith("-attempt1") and f"torchrun-{me}-" in nxt.run_id


def test_a_zygote_forked_ranks_attempt_comes_from_its_hook_file(tmp_path):
    """/proc/<pid>/environ of a rank the zygote forked is the zygote's (no restart count): the hook names it."""
    _hook(tmp_path, attempt=1, agent=os.getpid())
    assert local_ranks(tmp_path, attempt=1) == {0: os.getpid()}
    assert local_ranks(tmp_path, attempt=0) == {}
    data = json.loads(stack_hook_file.files.hook_file(tmp_path, os.getpid()).read_text())
    assert data["launch"]["TORCHELASTIC_RESTART_COUNT"] == "1" and data["agent"] == os.getpid()


def test_a_change_of_membership_is_a_new_attempt_under_the_same_count(tmp_path):
    """torchrun restarts the ranks without counting a restart when a node joins (--nnodes 1:2): new processes under
    the same TORCHELASTIC_RESTART_COUNT. The watcher watches them as the next attempt, and their local rank 0 does
    not take the earlier membership's exit code for its own."""
    me = os.getpid()
    earlier = Attempt(1, {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}, None, {me + 1})
    _hook(tmp_path, attempt=1, agent=me, max_restarts=2)  # this process: not one of the earlier ranks
    nxt = next_attempt(str(tmp_path), me, earlier)
    assert nxt.number == 1 and nxt.pids == set()
    state = WatcherState(me, start_ticks(me), "a", watching=1, reported=1, code=1, ranks=[me + 1])
    assert state.done_with(1) and not state.done_with(1, pid=me) and state.done_with(0, pid=me)
    watcher_file.write(tmp_path, state)
    assert watcher_file.read(tmp_path).ranks == [me + 1]
    assert NodeWatcher(tmp_path, me, None).outcome(1, limit=0.3) is None  # the earlier membership's: waits
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), "a", watching=1, reported=1, code=0, ranks=[me]))
    assert NodeWatcher(tmp_path, me, None).outcome(1, limit=5.0) == 0


def test_a_failed_rank_on_one_of_several_nodes_waits_for_a_watcher_still_starting(tmp_path, monkeypatch):
    """A rank that fails at its first collective may end before its node's watcher is up (its imports take
    seconds): it waits for it, bounded, instead of exiting at once and taking torchrun's store down before the
    nodes found the exchange; a watcher that was up and is gone is not waited for."""
    import threading
    import time

    from distcheck.contract import env
    from distcheck.rank.entry import wait_until_covered

    me = os.getpid()
    monkeypatch.setenv(env.AGENT_PID, str(me))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    covering = WatcherState(me, start_ticks(me), launcher_id(me), watching=0, covered=[1], covered_attempt=0,
                            exchange_attempt=0)
    late = threading.Timer(0.3, lambda: watcher_file.write(tmp_path, covering))  # the watcher comes up late
    late.start()
    started = time.monotonic()
    assert wait_until_covered(tmp_path, 1, limit=5.0)
    assert 0.25 < time.monotonic() - started < 5.0
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), launcher_id(me), watching=0))  # up, not covered
    gone = threading.Timer(0.2, lambda: watcher_file.write(tmp_path, WatcherState(NO_SUCH_PID, 5, launcher_id(me),
                                                                                   watching=0)))
    gone.start()
    started = time.monotonic()
    assert not wait_until_covered(tmp_path, 1, limit=5.0)
    assert time.monotonic() - started < 2.0  # it was up and is gone: no wait to the limit


def test_a_rank_on_one_of_several_nodes_starts_its_script_once_the_exchange_is_in_place(tmp_path, monkeypatch):
    """gloo aborts a rank at its first collective (SIGABRT: no Python runs after it) when a shape differs across
    nodes; that took torchrun's store down before a watcher still importing had found node 0's exchange, and its
    node's part never reached the report (3 of 15 loop runs under load). The ranks now start their scripts once the
    exchange is in place, bounded; at once on one node, or when no watcher comes up."""
    import threading
    import time

    from distcheck.contract import env
    from distcheck.rank import entry

    me = os.getpid()
    monkeypatch.setenv(env.AGENT_PID, str(me))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), launcher_id(me), watching=0))  # up, not on it
    ready = WatcherState(me, start_ticks(me), launcher_id(me), watching=0, exchange_attempt=0)
    threading.Timer(0.3, lambda: watcher_file.write(tmp_path, ready)).start()
    started = time.monotonic()
    assert entry.wait_for_exchange(tmp_path, limit=5.0)
    assert 0.25 < time.monotonic() - started < 5.0
    monkeypatch.setattr(entry, "WATCHER_START_WAIT", 0.2)
    started = time.monotonic()
    assert not entry.wait_for_exchange(tmp_path / "no-watcher", limit=5.0)  # none came up: the script runs
    assert time.monotonic() - started < 2.0
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not entry.wait_for_exchange(tmp_path, limit=5.0)  # one node: no exchange to wait for


def test_a_watcher_still_importing_is_found_by_the_next_attempt(tmp_path, monkeypatch):
    """The watcher writes its state once its imports are done (a second or more on a loaded machine); an attempt
    that failed sooner left none, and the restarted attempt's local rank 0 started a second watcher. The rank that
    starts it writes its first state (no process launched: Popen stands in, this process for the watcher)."""
    import subprocess

    from distcheck.contract import env
    from distcheck.rank import bootstrap

    me = os.getpid()
    monkeypatch.setenv(env.AGENT_PID, str(me))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")

    class Started:
        pid = me

        def __init__(self, cmd, **kwargs):
            self.cmd = cmd

    monkeypatch.setattr(subprocess, "Popen", Started)
    assert live_watcher(tmp_path) is None
    watcher = bootstrap.start_node_watcher(tmp_path, 30.0)
    found = live_watcher(tmp_path)  # what attempt 1's local rank 0 asks before it would start another
    assert found is not None and found.pid == watcher.pid == me and found.watching == 0
    assert not found.done_with(0)  # the ranks of a restart wait for its report of attempt 0 before moving files
