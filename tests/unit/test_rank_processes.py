"""A rank's processes and its output, without launching any (issue 25): the hang diagnosis placed on a process a
rank waits for, the process tree and its sweep (on a stand-in /proc), and the stderr copier on in-process pipes.

    .venv/bin/python -m pytest -q tests/unit/test_rank_processes.py
"""
from __future__ import annotations

import os
import threading

import pytest

from distcheck.analysis.hang import diagnose
from distcheck.analysis.progress import CollectiveRef, RankProgress
from distcheck.analysis.stack_groups import (
    RankStack, own_frames, parse_pyspy_json, process_role, render_processes, waits_on,
)
from distcheck.contract import env, stderr_file
from distcheck import processes
from distcheck.rank import stderr_tee
from distcheck.supervise import procs

TRAIN = "/home/u/proj/train.py"
SITE = "/venv/lib/python3.11/site-packages"
PY = "/usr/lib/python3.11"
TORCH_DIST = f"{SITE}/torch/distributed"


def thread(pid, frames, name="MainThread"):
    return {"thread_name": name, "os_thread_id": pid, "active": False, "owns_gil": False,
            "frames": [{"name": n, "filename": f, "short_filename": os.path.basename(f), "line": ln,
                        "locals": loc} for n, f, ln, *rest in frames for loc in [rest[0] if rest else None]]}


def stack(rank, pid, frames, role=""):
    out = RankStack(rank, pid, "node0", "py-spy", parse_pyspy_json([thread(pid, frames)], pid))
    if role:
        for t in out.threads:
            t.frames = own_frames(t.frames)
        out.role = process_role(out)
    return out


# rank 1 in `for x, y in loader` (train.py:40), blocked on its DataLoader's queue
RANK_IN_LOADER = [("poll", f"{PY}/multiprocessing/connection.py", 257), ("get", f"{PY}/multiprocessing/queues.py", 113),
                  ("_try_get_data", f"{SITE}/torch/utils/data/dataloader.py", 1133),
                  ("__next__", f"{SITE}/torch/utils/data/dataloader.py", 733),
                  ("main", TRAIN, 40), ("<module>", TRAIN, 60)]
# its worker 0, in the dataset's read_record (train.py:22); below _bootstrap: what it inherited at the fork
WORKER_STUCK = [("read_record", TRAIN, 22), ("__getitem__", TRAIN, 30),
                ("fetch", f"{SITE}/torch/utils/data/_utils/fetch.py", 54),
                ("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 374,
                 [{"name": "worker_id", "repr": "0"}, {"name": "dataset", "repr": "<Records>"}]),
                ("run", f"{PY}/multiprocessing/process.py", 108), ("_bootstrap", f"{PY}/multiprocessing/process.py", 314),
                ("_launch", f"{PY}/multiprocessing/popen_fork.py", 71),
                ("__next__", f"{SITE}/torch/utils/data/dataloader.py", 733),
                ("main", TRAIN, 40), ("<module>", TRAIN, 60)]
WORKER_IDLE = [("get", f"{PY}/multiprocessing/queues.py", 113),
               ("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 334,
                [{"name": "worker_id", "repr": "0"}]),
               ("_bootstrap", f"{PY}/multiprocessing/process.py", 314), ("main", TRAIN, 40)]
RANK_IN_ALLREDUCE = [("all_reduce", f"{TORCH_DIST}/distributed_c10d.py", 2806), ("main", TRAIN, 41),
                     ("<module>", TRAIN, 60)]


def ref(seq: int, completed: bool) -> CollectiveRef:
    return CollectiveRef("all_reduce", seq, [0, 1], "train.py:41", TRAIN, 41, completed=completed)


def waiting_in_all_reduce() -> dict[int, RankProgress]:
    return {0: RankProgress(0, ref(2, False), ref(1, True), 2, 1, first_open=ref(2, False), open=[ref(2, False)]),
            1: RankProgress(1, ref(1, True), ref(1, True), 1, 1)}


def test_a_forked_workers_stack_loses_what_it_inherited_and_says_which_worker_it_is():
    worker = stack(1, 2001, WORKER_STUCK, role="child process")
    assert [f.name for f in worker.main_thread().frames][-1] == "_bootstrap"  # not the rank's main (train.py:40)
    assert worker.role == "DataLoader worker 0" and worker.label == "rank 1's DataLoader worker 0 (pid 2001)"
    assert worker.main_thread().frames[3].locals == {"worker_id": "0"}  # only the locals that name the process
    plain = stack(0, 2002, [("serve", TRAIN, 5), ("_bootstrap", f"{PY}/multiprocessing/process.py", 314)], "x")
    assert plain.role == "child process"
    assert RankStack.from_json(worker.to_json()).role == "DataLoader worker 0"


def test_what_a_rank_waits_for():
    assert waits_on(stack(1, 1001, RANK_IN_LOADER).main_thread()) == "DataLoader"
    assert waits_on(stack(0, 1000, RANK_IN_ALLREDUCE).main_thread()) is None
    in_subprocess = [("_try_wait", f"{PY}/subprocess.py", 1959), ("wait", f"{PY}/subprocess.py", 1264),
                     ("main", TRAIN, 12)]
    assert waits_on(stack(0, 1000, in_subprocess).main_thread()) == "process"
    # the user's own frame is further in: the rank is in its own code, whatever is further out
    assert waits_on(stack(0, 1000, [("helper", TRAIN, 3), *in_subprocess]).main_thread()) is None


def test_a_rank_blocked_on_its_dataloader_worker_points_at_the_workers_line():
    ranks = [stack(0, 1000, RANK_IN_ALLREDUCE), stack(1, 1001, RANK_IN_LOADER)]
    processes = [stack(0, 2000, WORKER_IDLE, "child process"), stack(1, 2001, WORKER_STUCK, "child process")]
    diag = diagnose(ranks, waiting_in_all_reduce(), 2, 10.0, processes=processes)
    assert diag.message == ("no progress for 10s: rank 1's DataLoader worker 0 (pid 2001) is in read_record "
                            "(train.py:22), which rank 1 waits for at train.py:40 while rank 0 waits in all_reduce "
                            "#2 (train.py:41)")
    finding = diag.to_finding(ranks, waiting_in_all_reduce())
    assert finding.ranks == [1] and finding.detail["line"] == 22
    assert [(p["rank"], p["role"], p["pid"]) for p in finding.detail["processes"]] == [
        (0, "DataLoader worker 0", 2000), (1, "DataLoader worker 0", 2001)]
    (odd,) = [loc for loc in finding.detail["locations"] if loc["ranks"] == [1]]
    assert odd["process"]["func"] == "read_record" and odd["line"] == 40
    text = render_processes(processes)
    assert "rank 1's DataLoader worker 0 (pid 2001) via py-spy:" in text and "read_record (train.py:22)" in text


def test_without_the_processes_the_diagnosis_is_as_before():
    ranks = [stack(0, 1000, RANK_IN_ALLREDUCE), stack(1, 1001, RANK_IN_LOADER)]
    diag = diagnose(ranks, waiting_in_all_reduce(), 2, 10.0)
    assert diag.message == ("no progress for 10s: rank 1 is in main (train.py:40) while rank 0 waits in all_reduce "
                            "#2 (train.py:41)")
    assert "processes" not in diag.to_finding(ranks, waiting_in_all_reduce()).detail


def test_a_process_of_a_rank_in_init_process_group_means_the_script_launches_its_own_ranks():
    spawning = [("join", f"{SITE}/torch/multiprocessing/spawn.py", 150), ("<module>", TRAIN, 19)]
    child = [("TCPStore", f"{TORCH_DIST}/rendezvous.py", 189), ("init_process_group", f"{TORCH_DIST}/c10d.py", 1500),
             ("worker", TRAIN, 11), ("_wrap", f"{SITE}/torch/multiprocessing/spawn.py", 90, [{"name": "i",
                                                                                               "repr": "1"}]),
             ("_bootstrap", f"{PY}/multiprocessing/process.py", 314)]
    ranks = [stack(0, 1000, spawning), stack(1, 1001, spawning)]
    processes = [stack(0, 2000, child, "child process"), stack(1, 2001, child, "child process")]
    assert processes[0].role == "spawned process 1"
    diag = diagnose(ranks, {}, 2, 20.0, processes=processes)
    assert diag.message.startswith("no progress for 20s: the spawned process 1 of each of ranks 0-1 (rank 0's: "
                                   "pid 2000) is in worker (train.py:11), which they wait for at train.py:19; ")
    assert diag.message.endswith("; rank 0's spawned process 1 (pid 2000) is in init_process_group at train.py:11: "
                                 "the script starts its own ranks, but distcheck started them already: run it with "
                                 "plain python, or drop mp.spawn (or the processes that call init_process_group) "
                                 "and use --nproc")
    assert diag.extra["self_launch"] is True


# --- the process tree ---------------------------------------------------------------------------------------------


def test_descendants_are_found_below_each_root_and_attributed_to_it(monkeypatch):
    monkeypatch.setattr(processes, "alive", lambda pid: pid != 13)
    children = {1: [10, 11], 10: [12, 13], 13: [14], 2: [20], 20: [21], 99: [100]}
    assert processes.descendants({10: 0, 20: 1}, children) == {12: 0, 14: 0, 21: 1}  # 13 ended; its child stays
    # a root below another root is that rank itself, not the other's descendant
    assert processes.descendants({1: 0, 10: 1}, children) == {11: 0, 12: 1, 14: 1}


def test_the_run_tree_ends_the_users_processes_first_and_lets_the_stderr_copies_drain(monkeypatch):
    live = {30: None, 31: procs.STDERR_COPY, 32: None, 33: None}  # 33 is a rank: kept
    ticks = {30: 500, 31: 400, 32: 700, 33: 300}
    calls = []

    def terminate(pids, grace=3.0, group=False):
        calls.append((sorted(pids), grace))
        for pid in pids:
            live.pop(pid, None)

    monkeypatch.setattr(procs, "terminate", terminate)
    monkeypatch.setattr(procs, "alive", lambda pid: pid in live)
    monkeypatch.setattr(procs, "start_ticks", lambda pid: ticks.get(pid))
    monkeypatch.setattr(procs, "role_of", lambda pid: live.get(pid))
    monkeypatch.setattr(procs, "tagged", lambda run_id: {p: r for p, r in live.items() if p in (31, 33)})
    monkeypatch.setattr(procs, "children_map", lambda: {os.getpid(): [32, 33]})
    monkeypatch.setattr(procs, "descendants", lambda roots, children=None: {30: 1})
    monkeypatch.setattr(procs, "reap", lambda pids: list(pids))
    tree = procs.RunTree("run-1", keep=[33], adopt_since=600)
    tree.observe({1: 33})
    assert tree.known == {30: (1, 500)}

    def copy_drains():  # the copy ends by itself once the writers (30, 32) are gone
        while 30 in live or 32 in live:
            threading.Event().wait(0.01)
        live.pop(31, None)

    drain = threading.Thread(target=copy_drains)
    drain.start()
    ended = tree.end(grace=0.5, drain=5.0)
    drain.join()
    # the tracked child (30) and the adopted orphan (32, started after the run); the rank (33) stays, the copy
    # was not killed: it drained
    assert calls == [([30, 32], 0.5)] and sorted(ended) == [30, 32] and 33 in live


def test_a_tracked_pid_reused_by_another_process_is_not_ended(monkeypatch):
    monkeypatch.setattr(procs, "alive", lambda pid: True)
    monkeypatch.setattr(procs, "start_ticks", lambda pid: 900)  # pid 30 now belongs to a later process
    monkeypatch.setattr(procs, "tagged", lambda run_id: {})
    tree = procs.RunTree("run-1")
    tree.known[30] = (0, 500)
    assert tree.leftovers() == {}


# --- the stderr copier ------------------------------------------------------------------------------------------


def test_whole_line_chunks_never_cut_a_line_and_stay_within_pipe_buf():
    block = b"".join(f"line {i:05d} ".encode() + b"y" * (i % 300) + b"\n" for i in range(2000))
    chunks = list(stderr_tee.whole_line_chunks(block))
    assert b"".join(chunks) == block
    assert all(len(c) <= stderr_tee.PIPE_BUF and c.endswith(b"\n") for c in chunks)
    long = b"a" * 10000 + b"\n"
    assert list(stderr_tee.whole_line_chunks(b"x\n" + long + b"z\n")) == [b"x\n", long, b"z\n"]


def read_all(fd: int) -> bytes:
    out = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            return b"".join(out)
        out.append(data)


def run_copy(tmp_path, chunks, keep):
    """The copier's loop on in-process pipes: ``chunks`` written (as a rank would), then the pipe closed."""
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    path = tmp_path / "stderr-rank0.txt"
    copier = threading.Thread(target=stderr_tee.copy, args=(src_r, dst_w, str(path), keep))
    copier.start()
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(read_all(dst_r)))
    reader.start()
    for chunk in chunks:
        stderr_tee.write_all(src_w, chunk)
    os.close(src_w)
    copier.join(10)
    os.close(dst_w)
    reader.join(10)
    for fd in (src_r, dst_r):
        os.close(fd)
    return received[0], path.read_bytes()


def test_the_copier_passes_on_every_line_and_keeps_a_bounded_copy(tmp_path):
    lines = [f"rank 0 line {i:08d} ".encode() + b"x" * 78 + b"\n" for i in range(20000)]
    # written in odd-sized pieces: the copier's reads cut lines anywhere
    data = b"".join(lines)
    console, copy = run_copy(tmp_path, [data[i:i + 7777] for i in range(0, len(data), 7777)], keep=64 * 1024)
    assert console == data
    kept = copy.splitlines(keepends=True)
    (cut,) = [i for i, line in enumerate(kept) if b"cut here" in line]
    assert kept[:cut] == lines[:cut]  # the head: whole lines from the first
    assert kept[cut + 1:] == lines[len(lines) - (len(kept) - cut - 1):]  # the tail: the last lines, whole
    dropped = len(lines) - (len(kept) - 1)
    assert f"[distcheck] {dropped:,} lines ({dropped * 100:,} bytes) of this rank's stderr cut here".encode() \
        in kept[cut]
    assert len(copy) <= 3 * 64 * 1024 + 1024  # head (to a line end), cut line, at most 2 × keep after it


def test_a_line_without_its_newline_is_passed_on_when_the_rank_pauses(tmp_path):
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    copier = threading.Thread(target=stderr_tee.copy, args=(src_r, dst_w, str(tmp_path / "copy.txt")))
    copier.start()
    try:
        os.write(src_w, b"epoch 1: 50%\r")  # a progress bar: no newline
        assert os.read(dst_r, 100) == b"epoch 1: 50%\r"  # arrives after FLUSH_AFTER, not at the end
    finally:
        os.close(src_w)
        copier.join(10)
        for fd in (src_r, dst_r, dst_w):
            os.close(fd)


def test_a_console_that_goes_away_never_blocks_the_rank(tmp_path):
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    os.close(dst_r)  # `distcheck ... | head` after head exited
    copier = threading.Thread(target=stderr_tee.copy, args=(src_r, dst_w, str(tmp_path / "copy.txt")))
    copier.start()
    data = b"z" * 99 + b"\n"
    for _ in range(5000):  # far more than a pipe holds: the copier keeps reading
        stderr_tee.write_all(src_w, data)
    os.close(src_w)
    copier.join(10)
    assert not copier.is_alive()
    assert (tmp_path / "copy.txt").stat().st_size == 5000 * 100
    for fd in (src_r, dst_w):
        os.close(fd)


@pytest.mark.parametrize("since, expect", [(0, ["a", "b"]), (3, ["b"]), (99, ["a", "b"])])
def test_tail_reads_from_an_offset_unless_the_copy_was_cut_below_it(tmp_path, since, expect):
    path = tmp_path / "stderr-rank0.txt"
    path.write_bytes(b"a\n\nb\n")
    assert stderr_file.tail(path, since=since) == expect


def test_the_copier_names_the_variables_as_the_contract_does():
    # The copier runs without distcheck on its path (python -I -S): it spells the names out itself.
    assert (stderr_tee.RUN_ID_ENV, stderr_tee.ROLE_ENV, stderr_tee.LAUNCHER_ENV) == (
        processes.RUN_ID_ENV, processes.ROLE_ENV, processes.LAUNCHER_ENV) == (env.RUN_ID, env.ROLE, env.LAUNCHER)
    assert stderr_file.KEEP_ENV == env.STDERR_KEEP  # the copier imports no distcheck: mirrored names, checked here


def test_the_copier_as_a_script_loads_the_file_format_by_its_path(tmp_path):
    """``python -I -S stderr_tee.py --copy FILE`` (how a rank starts it) has no distcheck on its path: it loads
    contract/stderr_file.py by its path (run_path runs the file as the script does, with no package)."""
    import runpy

    script = runpy.run_path(stderr_tee.__file__, run_name="copier")
    assert script["BoundedCopy"].__module__ == "stderr_file" and script["KEEP"] == stderr_file.KEEP
    copy = script["BoundedCopy"](str(tmp_path / "copy.txt"))
    copy.write(b"a\nb\n")
    copy.close()
    assert stderr_file.tail(tmp_path / "copy.txt") == ["a", "b"]


@pytest.mark.parametrize("rank, launcher, swept", [("gone", "gone", True), ("gone", "running", False),
                                                   ("running", "gone", False), ("zombie leader", "gone", True),
                                                   ("gone", "zombie", True)])
def test_a_copier_ends_its_ranks_processes_only_when_rank_and_launcher_are_gone(monkeypatch, rank, launcher, swept):
    """A rank is gone when the copier's parent changed, or when the rank's main thread is a zombie: a killed rank
    with a thread still in the kernel keeps its children parented to that thread. A zombie launcher is gone too: a
    parent reading distcheck's output to its end reaps it only after that."""
    env = {"DISTCHECK_RUN_ID": "r1", "RANK": "1", "DISTCHECK_LAUNCHER": "4000:77"}
    ppid = os.getppid()
    orphaned = stderr_tee.Orphaned(env)
    parent_ticks = orphaned.parent_ticks
    assert parent_ticks is not None
    monkeypatch.setattr(stderr_tee.os, "getppid", lambda: 1 if rank == "gone" else ppid)
    launcher_stat = {"gone": None, "running": ("S", 77), "zombie": ("Z", 77)}[launcher]
    monkeypatch.setattr(stderr_tee, "_stat", lambda pid: launcher_stat if pid == 4000 else
                        ("Z" if rank == "zombie leader" else "S", parent_ticks))
    processes = {501: [b"DISTCHECK_RUN_ID=r1", b"RANK=1"],  # the rank's helper: ended
                 502: [b"DISTCHECK_RUN_ID=r1", b"RANK=0"],  # another rank's: not this copier's
                 503: [b"DISTCHECK_RUN_ID=r1", b"RANK=1", b"DISTCHECK_ROLE=stderr-copy"],  # distcheck's own
                 504: [b"DISTCHECK_RUN_ID=r2", b"RANK=1"]}  # another run's
    monkeypatch.setattr(stderr_tee.os, "listdir", lambda path: [str(p) for p in processes])
    monkeypatch.setattr(stderr_tee, "_environ", lambda pid: processes[pid])
    killed = []
    monkeypatch.setattr(stderr_tee, "_environ", lambda pid: processes.get(pid, []))
    monkeypatch.setattr(stderr_tee.os, "kill", lambda pid, sig: killed.append(processes.pop(pid) and pid))
    assert orphaned() is swept
    assert killed == ([501] if swept else [])


def test_a_copier_whose_rank_died_before_it_was_up_still_ends_the_ranks_processes(monkeypatch):
    """Under load a rank can be killed (its launcher SIGKILLed) before its copier's interpreter is up: the copier's
    parent is init from its first look, so the rank tells it which process it is (--rank pid:ticks). Taking init
    for the rank, it would wait for init to end and leave the rank's helpers running (CI's flaky SIGKILL test)."""
    env = {"DISTCHECK_RUN_ID": "r1", "RANK": "1", "DISTCHECK_LAUNCHER": "4000:77"}
    monkeypatch.setattr(stderr_tee.os, "getppid", lambda: 1)
    monkeypatch.setattr(stderr_tee, "_stat", lambda pid: ("S", 1) if pid == 1 else None)  # rank, launcher: gone
    processes = {501: [b"DISTCHECK_RUN_ID=r1", b"RANK=1"]}
    killed = []
    monkeypatch.setattr(stderr_tee.os, "listdir", lambda path: [str(p) for p in processes])
    monkeypatch.setattr(stderr_tee, "_environ", lambda pid: processes.get(pid, []))
    monkeypatch.setattr(stderr_tee.os, "kill", lambda pid, sig: killed.append(processes.pop(pid) and pid))
    assert stderr_tee.Orphaned(env)() is False and killed == []  # found, not told: init is no rank that ends
    assert stderr_tee.Orphaned(env, rank="4001:88")() is True and killed == [501]


def test_a_copier_told_its_rank_is_gone_drains_and_ends_though_a_writer_holds_its_input(tmp_path):
    """After the sweep nobody the run knows of writes to the copier's input; a writer that still holds it (a rank's
    last thread on its way out) must not keep the copier, and distcheck's console, alive."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"last words\n")
        calls = []

        def idle(final=False):
            calls.append(final)
            return True

        dst = tmp_path / "console"
        with open(dst, "wb") as console:
            copier = threading.Thread(target=stderr_tee.copy, args=(read_end, console.fileno(),
                                                                    str(tmp_path / "copy.txt")), kwargs={"idle": idle})
            copier.start()
            copier.join(timeout=10)
            ended = not copier.is_alive()
            os.close(write_end)  # ends a copier that waits for the end of its input (the bug), so the test ends
            write_end = None
            copier.join(timeout=10)
        assert ended, "the copier waited for its input's end"
        assert dst.read_bytes() == b"last words\n"
        assert stderr_file.tail(tmp_path / "copy.txt") == ["last words"]
        assert calls == [False]  # no second, final call: the sweep is done
    finally:
        os.close(read_end)
        if write_end is not None:
            os.close(write_end)
