"""A rank's whole process tree, and its output: nothing left behind, nothing lost (issue 25).

    .venv/bin/python -m pytest -q tests/integration/test_faults_procs.py

Each test launches distcheck the way a user or a CI step does: fresh interpreters (no zygote), its output read
through pipes until they close, which they only do once nothing holds them (``subprocess.run(...,
capture_output=True)`` or ``distcheck ... | tail`` wait for the same thing). Every launch carries
DISTCHECK_TEST_TAG=<uuid> in its environment, which every process it starts inherits: a process still alive with
that tag after the launcher's output closed is a process distcheck left behind (found in /proc/*/environ, never by
name). Each test asserts the report, the exit code, a bounded time, and that none is left.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from launch_helpers import BIN, FRESH, ROOT, TAG, env_for_ranks, kill_tagged, load_report, tagged

def describe(pids: list[int]) -> str:
    """Each process with its parent and state (a leftover's parent says who failed to end it)."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            cmd, state, ppid = "?", "?", "?"
        out.append(f"{pid} (parent {ppid}, {state}, {_waits_in(pid)}): {cmd[:150]}")
        if "stderr_tee" in cmd:  # a copier left: the launcher and rank it watches for, as it sees them
            env = dict(e.split("=", 1) for e in _environ(pid) if "=" in e)
            launcher = env.get("DISTCHECK_LAUNCHER", "").partition(":")[0]
            out.append(f"  its launcher {env.get('DISTCHECK_LAUNCHER')}: {_state(launcher)}; "
                       f"rank {env.get('RANK')}; parent {ppid}: {_state(ppid)} {_cmd(ppid)[:80]}")
    return "\n".join(out)


def _waits_in(pid) -> str:
    try:
        return "waits in " + Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "?"


def _state(pid) -> str:
    try:
        return "state " + Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _cmd(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _environ(pid) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class Tagged:
    """One launch with its own tag; ``run`` waits until its output pipes close (bounded)."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex

    def run(self, cmd: list[str], limit: float, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None, fresh: bool = True) -> tuple[int, str, str, float]:
        """``fresh``: the ranks are fresh interpreters, as for users (the process-tree tests); else they fork from
        the session's zygote (the tests of what a rank does, which would import torch again for nothing)."""
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env=env_for_ranks({**(FRESH if fresh else {}), TAG: self.tag, **(env or {})}),
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit)  # returns once every holder of the pipes closed them
        except subprocess.TimeoutExpired:
            left = describe(self.leftovers())
            self.cleanup()
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"the output of {cmd[1:4]} did not close within {limit}s (exit code "
                                 f"{proc.returncode}); processes of the launch:\n{left}\n{out[-3000:]}\n"
                                 f"{err[-3000:]}") from None
        return proc.returncode, out, err, time.monotonic() - t0

    def leftovers(self) -> list[int]:
        return tagged(self.tag)

    def assert_none_left(self) -> None:
        deadline = time.monotonic() + 2.0  # one that is being killed right now is not a leftover
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.leftovers()
        assert not left, f"processes left behind:\n{describe(left)}"

    def cleanup(self) -> None:
        kill_tagged(self.tag)


@pytest.fixture
def launch():
    launched = Tagged()
    yield launched
    launched.cleanup()


def marker_line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


LOADER_STUCK = textwrap.dedent('''
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset


    def read_record(rank, i):
        if rank == 1 and i == 2:
            time.sleep(3600)  # STUCK: rank 1's worker never returns this record
        return torch.full((4,), float(i)), torch.tensor(float(i))


    class Records(Dataset):
        def __init__(self, rank):
            self.rank = rank

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return read_record(self.rank, i)


    def main():
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        loader = DataLoader(Records(rank), batch_size=2, num_workers=1)
        for x, y in loader:  # LOOP
            dist.all_reduce(x)  # WAIT
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
''')


@pytest.mark.parametrize("form", ["nproc", "torchrun"])
def test_a_stuck_dataloader_worker_is_dumped_named_and_ended(tmp_path, launch, form):
    """Rank 1's DataLoader worker blocks in __getitem__: the hang names the worker's line (not only rank 1's
    ``for x, y in loader``), and after the run no worker holds distcheck's output open."""
    script = tmp_path / "loader_stuck.py"
    script.write_text(LOADER_STUCK)
    out = tmp_path / "report"
    args = ["run", "--timeout", "4", "--report-dir", str(out), "--", str(script)]
    cmd = ([sys.executable, "-m", "distcheck", *args[:1], "--nproc", "2", *args[1:]] if form == "nproc"
           else [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "distcheck", *args])
    code, stdout, stderr, seconds = launch.run(cmd, limit=90)
    assert code == 1, stderr[-3000:]
    assert seconds < 60
    (f,) = [f for f in load_report(out)["findings"] if f["kind"] == "hang"]
    stuck, loop = marker_line(LOADER_STUCK, "# STUCK"), marker_line(LOADER_STUCK, "# LOOP")
    assert f["ranks"] == [1], f["message"]
    assert re.search(rf"rank 1's DataLoader worker 0 \(pid \d+\) is in read_record \(loader_stuck.py:{stuck}\), "
                     rf"which rank 1 waits for at loader_stuck.py:{loop}", f["message"]), f["message"]
    assert f["detail"]["line"] == stuck  # the diagnosis follows the rank to its worker
    (worker,) = [p for p in f["detail"]["processes"] if p["role"] == "DataLoader worker 0" and p["rank"] == 1]
    (main,) = [t for t in worker["stack"]["threads"] if t["main"]]
    assert main["frames"][0]["name"] == "read_record"
    stacks_txt = (out / "stacks.txt").read_text()
    assert "rank 1's DataLoader worker 0" in stacks_txt and "read_record" in stacks_txt
    launch.assert_none_left()


HELPER = textwrap.dedent('''
    import subprocess
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    # A helper in a session of its own (a log shipper, a data server): torchrun's group kill does not reach it.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} done", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.parametrize("form", ["nproc", "torchrun"])
def test_helper_processes_a_correct_script_starts_are_ended_with_the_run(tmp_path, launch, form):
    """A correct script whose ranks each start a helper: PASSED, exit 0, and the output closes at once (no helper
    and none of distcheck's stderr copies holds it open)."""
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    out = tmp_path / "report"
    args = ["run", "--timeout", "60", "--report-dir", str(out), "--", str(script)]
    cmd = ([sys.executable, "-m", "distcheck", *args[:1], "--nproc", "2", *args[1:]] if form == "nproc"
           else [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "distcheck", *args])
    code, stdout, stderr, seconds = launch.run(cmd, limit=60)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert seconds < 45
    report = load_report(out)
    assert report["ok"] and not report["findings"]
    assert "rank 0 done" in stdout and "rank 1 done" in stdout
    launch.assert_none_left()


SPAWN = textwrap.dedent('''
    import os

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def worker(rank, world_size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = "29533"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(2,), nprocs=2)  # SPAWN
''')


def test_a_script_that_launches_its_own_ranks_is_told_how_to_run(tmp_path, launch):
    """mp.spawn under ``run --nproc 2``: one finding that says what to do instead, no hang, nothing left."""
    script = tmp_path / "spawn_ddp.py"
    script.write_text(SPAWN)
    out = tmp_path / "report"
    code, stdout, stderr, seconds = launch.run(
        [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "20", "--report-dir", str(out),
         "--", str(script)], limit=90, fresh=False)
    assert code == 1, stderr[-3000:]
    assert seconds < 40  # well before the no-progress limit would have fired
    (f,) = load_report(out)["findings"]
    assert f["kind"] == "rank_failure" and f["ranks"] == [0, 1], f["message"]
    first = f["message"].splitlines()[0]
    assert f"spawn_ddp.py:{marker_line(SPAWN, '# SPAWN')}" in first
    assert "torch.multiprocessing.spawn" in first and "run it with plain python" in first
    assert "drop mp.spawn and use --nproc" in first, first
    launch.assert_none_left()


FLOOD = textwrap.dedent('''
    import sys

    import torch.distributed as dist

    n = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    for i in range(n):  # one write per 100-byte line, as logging does
        sys.stderr.write(f"rank {rank} line {i:08d} " + "x" * 78 + "\\n")
    dist.barrier()
    dist.destroy_process_group()
''')
LINE = re.compile(r"^rank ([01]) line (\d{8}) x{78}$")


def test_every_line_of_a_flood_of_rank_output_arrives_whole(tmp_path, launch):
    """20k lines of 100 bytes per rank on stderr, both ranks at once, into one pipe: every line arrives whole and
    once; each rank's copy in the report directory keeps its first and last lines and says what it cut."""
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    out = tmp_path / "report"
    n, keep = 20000, 64 * 1024
    code, stdout, stderr, seconds = launch.run(
        [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "60", "--report-dir", str(out),
         "--", str(script), str(n)], limit=90, env={"DISTCHECK_STDERR_KEEP": str(keep)}, fresh=False)
    assert code == 0, stdout[-2000:]
    assert seconds < 60
    seen: dict[str, list[int]] = {"0": [], "1": []}
    spliced = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            seen[m.group(1)].append(int(m.group(2)))
        elif "line 0" in line or "xxxx" in line:
            spliced.append(line)
    assert not spliced, f"{len(spliced)} lines spliced, e.g. {spliced[:3]}"
    assert seen == {"0": list(range(n)), "1": list(range(n))}
    ours = [line for line in stderr.splitlines() if line.startswith("distcheck")]
    for rank in (0, 1):
        # distcheck's own lines first: pytest cuts a long message, and "no copy of its stderr" would say why.
        assert (out / f"stderr-rank{rank}.txt").exists(), (
            f"no stderr-rank{rank}.txt; distcheck's lines on stderr: {ours}; files: "
            f"{sorted(p.name for p in out.iterdir())}; stdout: {stdout[-1500:]}")
        copy = (out / f"stderr-rank{rank}.txt").read_bytes()
        assert len(copy) <= 3 * keep + 1024  # bounded: head (to a line end), cut line, at most 2 × keep after it
        lines = copy.decode().splitlines()
        flood = [line for line in lines if LINE.match(line)]
        assert flood[0] == f"rank {rank} line {0:08d} " + "x" * 78
        assert flood[-1] == f"rank {rank} line {n - 1:08d} " + "x" * 78
        (cut,) = [line for line in lines if "cut here" in line]
        assert re.search(r"\d+ lines \(\d[\d,]* bytes\)", cut), cut
    launch.assert_none_left()


def test_the_stderr_copier_starts_on_the_standard_librarys_core_alone(tmp_path):
    """Every rank starts a copier: its start imports stderr_file and what the interpreter loads anyway, not typing,
    importlib.util or signal's enums (25 of its 50 ms of CPU; bench/bench_copier_start.py)."""
    copier = ROOT / "distcheck" / "rank" / "stderr_tee.py"
    done = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", str(copier), "--copy",
                           str(tmp_path / "copy.txt")], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "stderr_file" in imported and (tmp_path / "copy.txt").exists(), sorted(imported)
    assert not imported & {"typing", "importlib.util", "enum", "signal", "re", "collections"}, sorted(imported)


HELPERS_THEN_WAIT = textwrap.dedent('''
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("helpers started", flush=True)
    time.sleep(300)
''')


def test_sigkill_of_the_launcher_takes_what_the_ranks_started_along(tmp_path, launch):
    """Nothing of distcheck runs after a SIGKILL: the ranks die with the launcher (PR_SET_PDEATHSIG), and each
    rank's stderr copy, which outlives it, ends the processes its rank started."""
    import select

    script = tmp_path / "helpers.py"
    script.write_text(HELPERS_THEN_WAIT)
    proc = subprocess.Popen([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "300",
                             "--report-dir", str(tmp_path / "report"), "--", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env_for_ranks({**FRESH, TAG: launch.tag}), start_new_session=True)
    try:
        seen, deadline = "", time.monotonic() + 90
        while seen.count("helpers started") < 2:
            assert time.monotonic() < deadline, f"the ranks never started their helpers: {seen!r}"
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 4096).decode(errors="replace")
        assert len(launch.leftovers()) >= 2 + 2 * 2  # ranks, their helpers (and the copies, the store host)
        proc.kill()
        # Not reaped yet: a parent reading the output to its end (subprocess.run(capture_output=True), a CI step)
        # reaps the launcher only once every holder of the pipes has closed them.
        t0 = time.monotonic()
        while launch.leftovers() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        launch.assert_none_left()
        assert time.monotonic() - t0 < 5  # a copier checks for its rank and launcher every second
        out, _ = proc.communicate(timeout=10)  # the output closes
    finally:
        proc.kill()
        proc.wait(timeout=10)


# A rank whose launcher is gone and whose main thread has ended while another thread of it is still on its way out
# (a SIGKILLed rank with a thread held in the kernel): its children stay parented to that last thread, so the
# copier's parent never changes. Seen once in CI as this file's SIGKILL test leaving a copier and a rank's helpers.
LEADER_ENDS_FIRST = textwrap.dedent('''
    import ctypes
    import platform
    import subprocess
    import sys
    import threading
    import time

    from distcheck.rank.stderr_tee import tee_stderr

    tee_stderr(sys.argv[1], 0)
    subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL)  # keeps the rank's stderr open, as helpers do
    threading.Thread(target=time.sleep, args=(300,)).start()  # the thread that outlives the main one
    print("ready", flush=True)
    ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # SYS_exit: this thread only
''')


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="SYS_exit's number")
def test_a_copier_whose_rank_is_a_zombie_leader_ends_the_ranks_processes_and_itself(tmp_path, launch):
    launcher = subprocess.Popen(["true"])
    ticks = Path(f"/proc/{launcher.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    launcher.wait(timeout=10)  # the launcher that started the rank, SIGKILLed: gone
    script = tmp_path / "rank.py"
    script.write_text(LEADER_ENDS_FIRST)
    env = env_for_ranks({**FRESH, TAG: launch.tag, "DISTCHECK_RUN_ID": launch.tag, "RANK": "0",
                         "DISTCHECK_LAUNCHER": f"{launcher.pid}:{ticks}"})
    rank = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        assert rank.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 20
        while Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the rank's main thread did not end"
            time.sleep(0.05)
        assert set(os.listdir(f"/proc/{rank.pid}/task")) - {str(rank.pid)}  # its other thread still runs
        t0 = time.monotonic()
        while launch.leftovers() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        launch.assert_none_left()  # the helper, and the copier (it drained and ended though the rank holds its pipe)
        assert time.monotonic() - t0 < 5  # a copier checks for its rank and launcher every second
        assert set(os.listdir(f"/proc/{rank.pid}/task")) - {str(rank.pid)}  # ended while the rank still had a thread
    finally:
        rank.kill()
        rank.wait(timeout=10)
