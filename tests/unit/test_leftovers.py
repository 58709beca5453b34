"""What a distributed test leaves behind (testing/leftovers.py), without launching anything: threads started by
the test's own code, by a library, or ended in time; pending collectives; ranks out of step; the headline."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from distcheck.analysis.trace_events import RankTrace, TraceEvent
from distcheck.testing import leftovers
from distcheck.testing.leftovers import COLLECTIVE, THREAD, Leftover, Watch, headline, out_of_step

HERE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    with open(__file__) as fh:
        return next(i for i, line in enumerate(fh, 1) if marker in line and "line_of(" not in line)


@pytest.fixture
def stop():
    event = threading.Event()
    yield event
    event.set()


def wait_for(event: threading.Event, entered: threading.Event | None = None) -> None:  # DEF
    if entered is not None:
        entered.set()
    event.wait(30)  # NOW


def test_a_thread_the_test_started_and_left_running_is_named(stop):
    watch = Watch()
    watch.start()
    entered = threading.Event()
    thread = threading.Thread(target=wait_for, args=(stop, entered))
    thread.start()  # STARTED
    assert entered.wait(30)  # on a loaded machine the thread may not have reached its target yet
    watch.stop()
    started = time.monotonic()
    (left,) = watch.find(grace=0.2)
    assert time.monotonic() - started < 10  # the grace, not a wait for the thread to end
    assert left.kind == THREAD
    assert left.what == f"{thread.name.split(' ')[0]} (target wait_for at {HERE}:{line_of('# DEF')})"
    assert left.detail == (f"started at {HERE}:{line_of('# STARTED')}, now in wait_for at {HERE}:{line_of('# NOW')}")
    assert left.line().startswith("the test left a thread running: Thread-")


def test_a_thread_that_ends_within_the_grace_is_not_a_leftover():
    watch = Watch()
    watch.start()
    threading.Thread(target=time.sleep, args=(0.1,)).start()
    watch.stop()
    assert watch.find(grace=2.0) == []


def test_an_executor_the_test_made_counts_as_the_tests(stop):
    watch = Watch()
    watch.start()
    pool = ThreadPoolExecutor(1)
    pool.submit(stop.wait, 30)  # SUBMIT
    watch.stop()
    (left,) = watch.find(grace=0.1)
    assert left.kind == THREAD and f"started at {HERE}:{line_of('# SUBMIT')}" in left.detail
    stop.set()
    pool.shutdown()


def test_a_thread_a_library_starts_for_itself_is_not_the_tests(stop):
    scope: dict = {}
    code = "import threading\ndef spawn(ev):\n    threading.Thread(target=ev.wait, args=(30,), daemon=True).start()\n"
    exec(compile(code, "/venv/lib/python3.11/site-packages/somelib/monitor.py", "exec"), scope)
    watch = Watch()
    watch.start()
    scope["spawn"](stop)
    watch.stop()
    assert watch.find(grace=0.1) == []


def test_the_hooks_are_removed_and_change_nothing():
    import subprocess

    before = (threading.Thread.start, subprocess.Popen.__init__, os.fork)
    watch = Watch()
    watch.start()
    assert threading.Thread.start is not before[0]
    watch.stop()
    assert (threading.Thread.start, subprocess.Popen.__init__, os.fork) == before


def event(rank: int, eid: int, op: str = "all_reduce", done: bool = True, pg=(0, 1), line: int = 9) -> TraceEvent:
    return TraceEvent(rank=rank, id=eid, seq=eid, pg=pg, op=op, shapes=[[3]], dtypes=["float32"],
                      reduce_op="SUM" if op == "all_reduce" else None, peer=None, site=f"test_x.py:{line}",
                      file="/p/test_x.py", line=line, t_start=1.0, t_end=2.0 if done else None,
                      root=0 if op == "broadcast" else None)


def test_a_collective_that_never_completed_is_pending(monkeypatch):
    from distcheck.analysis import trace_events

    trace = RankTrace(0, [event(0, 1), event(0, 2, "broadcast", done=False, line=12)], [], {}, None)
    monkeypatch.setattr(trace_events, "load_rank_records", lambda path, rank, merge=True: trace)
    (left,) = leftovers.pending_collectives("/nowhere", 0)()
    assert left.kind == COLLECTIVE
    assert left.what == "broadcast [3] float32 root=0 (#2, issued at test_x.py:12, never completed)"


def test_ranks_out_of_step_on_a_group(monkeypatch):
    from distcheck.analysis import trace_events

    traces = {0: RankTrace(0, [event(0, 1), event(0, 2, "broadcast", line=14)], [], {}, None),
              1: RankTrace(1, [event(1, 1)], [], {}, None)}
    monkeypatch.setattr(trace_events, "load_traces", lambda d: traces)
    found = out_of_step("/nowhere")
    assert list(found) == [0]
    (left,) = found[0]
    assert left.what == "broadcast [3] float32 root=0 (#2, issued at test_x.py:14, never issued by rank 1)"
    traces[1].events.append(event(1, 2, "broadcast", line=14))
    assert out_of_step("/nowhere") == {}


def test_the_headline_groups_ranks_that_left_the_same_thing():
    text = headline({0: [Leftover(THREAD, "Thread-3 (target f at t.py:4)", "started at t.py:9")],
                     1: [Leftover(THREAD, "Thread-3 (target f at t.py:4)", "started at t.py:9"),
                         Leftover(COLLECTIVE, "all_reduce [3] float32 SUM (#1, issued at t.py:7, never completed)")]})
    lines = text.splitlines()
    assert lines[0] == "the test left a thread running: Thread-3 (target f at t.py:4) on ranks 0-1"
    assert lines[1] == ("the test left a collective pending: all_reduce [3] float32 SUM (#1, issued at t.py:7, never "
                        "completed) on rank 1")
    assert "the pool of ranks is retired" in lines[2]
    assert headline({}) == ""
