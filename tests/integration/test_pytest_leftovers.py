"""The pytest marker's pool of ranks (issue 25, item 6): a test that leaves a thread, a child process or a pending
collective behind fails itself, naming what it left and on which rank; the pool is retired and the next test, which
is innocent, starts on fresh ranks and passes. Each test asserts the outcomes, the message, a bounded time, and that
no process is left once pytest has ended, found by an environment tag every process of the run inherits."""
from __future__ import annotations

import re
import time
import uuid

from launch_helpers import TAG, run_pytest, tagged

INNOCENT = '''
@pytest.mark.distributed(nprocs=2, timeout=20)
def test_innocent(dist_ctx):
    for _ in range(30):
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [2.0] * 4
        time.sleep(0.05)
'''

THREAD = '''
import threading, time, pytest, torch, torch.distributed as dist

def broadcast_later():
    time.sleep(1)  # TARGET
    dist.broadcast(torch.ones(4), src=0)

@pytest.mark.distributed(nprocs=2, timeout=20)
def test_leaves_a_thread(dist_ctx):
    if dist_ctx.rank == 0:
        threading.Thread(target=broadcast_later).start()  # STARTED
''' + INNOCENT

PROCESS = '''
import subprocess, sys, time, pytest, torch, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=20)
def test_leaves_a_process(dist_ctx):
    # its own session: a group kill of the rank does not reach it
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)  # STARTED
''' + INNOCENT

PENDING = '''
import time, pytest, torch, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=20)
def test_leaves_a_pending_collective(dist_ctx):
    if dist_ctx.rank == 0:
        dist.broadcast(torch.ones(3), src=0, async_op=True)  # ISSUED: never matched on rank 1, never waited on
''' + INNOCENT


def run_tagged(pytester, monkeypatch, name: str, source: str):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)  # the inner pytest, its pool's ranks and whatever they start inherit it
    pytester.makepyfile(**{name: source})
    started = time.monotonic()
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", timeout=180)
    seconds = time.monotonic() - started
    deadline = time.monotonic() + 10
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged(tag)
    assert not left, f"processes left behind: {left}"
    return result, result.stdout.str(), seconds


def failure_of(out: str, test: str) -> str:
    start = out.index(f"_ {test} _")
    end = out.find("_ test_innocent _", start)
    return out[start:end if end > 0 else len(out)]


def test_a_test_that_leaves_a_thread_fails_itself_and_the_next_passes(pytester, monkeypatch, line_of):
    result, out, seconds = run_tagged(pytester, monkeypatch, "test_thread", THREAD)
    result.assert_outcomes(passed=1, failed=1)
    assert "test_innocent PASSED" in out and "test_leaves_a_thread FAILED" in out
    text = failure_of(out, "test_leaves_a_thread")
    target = line_of(None, "def broadcast_later", text=THREAD.strip("\n"))
    started = line_of(None, "# STARTED", text=THREAD.strip("\n"))
    assert ("the test left a thread running: Thread-" in text
            and f"(target broadcast_later at test_thread.py:{target}) on rank 0" in text), text
    assert f"started at test_thread.py:{started}" in text, text
    assert "the pool of ranks is retired" in text
    assert seconds < 60


def test_a_test_that_leaves_a_child_process_fails_itself_and_nothing_is_left(pytester, monkeypatch, line_of):
    result, out, seconds = run_tagged(pytester, monkeypatch, "test_process", PROCESS)
    result.assert_outcomes(passed=1, failed=1)
    assert "test_innocent PASSED" in out
    text = failure_of(out, "test_leaves_a_process")
    started = line_of(None, "# STARTED", text=PROCESS.strip("\n"))
    assert "the test left a child process running: " in text and "time.sleep(120)" in text, text
    assert f"started at test_process.py:{started}) on ranks 0-1" in text, text
    assert seconds < 60


def test_a_test_that_leaves_a_pending_collective_fails_itself(pytester, monkeypatch, line_of):
    result, out, seconds = run_tagged(pytester, monkeypatch, "test_pending", PENDING)
    result.assert_outcomes(passed=1, failed=1)
    assert "test_innocent PASSED" in out
    text = failure_of(out, "test_leaves_a_pending_collective")
    issued = line_of(None, "# ISSUED", text=PENDING.strip("\n"))
    assert (f"the test left a collective pending: broadcast [3] float32 root=0 (#1, issued at "
            f"test_pending.py:{issued}, never completed) on rank 0") in text, text
    assert seconds < 60



LOADER_STUCK = '''
import time, pytest, torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

def read_record(rank, i):
    if rank == 1 and i == 2:
        time.sleep(3600)  # STUCK: rank 1's worker never returns this record
    return torch.full((4,), float(i))

class Records(Dataset):
    def __init__(self, rank):
        self.rank = rank

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return read_record(self.rank, i)

@pytest.mark.distributed(nprocs=2, timeout=6)
def test_loader(dist_ctx):
    for x in DataLoader(Records(dist_ctx.rank), batch_size=2, num_workers=1):  # LOOP
        dist.all_reduce(x)
''' + INNOCENT


def test_a_stuck_dataloader_worker_in_a_pool_test_is_named_and_ended(pytester, monkeypatch, line_of):
    """The pool's hang diagnosis follows rank 1 to its DataLoader worker's line, the worker is ended with the pool
    (none left once pytest has ended), and the next test passes on fresh ranks."""
    result, out, seconds = run_tagged(pytester, monkeypatch, "test_loader_stuck", LOADER_STUCK)
    result.assert_outcomes(passed=1, failed=1)
    assert "test_innocent PASSED" in out
    text = failure_of(out, "test_loader")
    source = LOADER_STUCK.strip("\n")
    stuck, loop = line_of(None, "# STUCK", text=source), line_of(None, "# LOOP", text=source)
    assert re.search(rf"rank 1's DataLoader worker 0 \(pid \d+\) is in read_record \(test_loader_stuck.py:{stuck}\), "
                     rf"which rank 1 waits for at test_loader_stuck.py:{loop}", text), text
    assert seconds < 90
