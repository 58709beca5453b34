"""Helpers for integration tests: launch distcheck or scripts on real gloo ranks, always with a timeout.

Every launch runs in its own session (process group) so a timeout kills torchrun *and* its ranks, by pid,
and parallel tests never collide: torchrun uses --standalone (a free port each time). Launches fork from the
session's zygote when there is one (tests/integration/conftest.py), so they do not import torch again.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
BIN = Path(sys.executable).parent
# env for a launch whose ranks must be fresh interpreters (the default for users) rather than forked from the
# test session's zygote (tests/integration/conftest.py)
FRESH = {"DISTCHECK_ZYGOTE": "0"}


# Set on a launch by tests that check nothing is left behind: every process the launch starts inherits it, so a
# process still alive with it afterwards was left by the run (found in /proc/*/environ, never by name).
TAG = "DISTCHECK_TEST_TAG"


def tagged(tag: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries ``TAG=tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL every live process of the run (``TAG=tag``), wherever it is: a failed test leaves nothing behind."""
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended since the listing
            pass


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for_ranks(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # 2 cores shared by xdist workers and ranks
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(FIXTURES), env.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.pop("DISTCHECK_REPORT_DIR", None)
    if extra:
        env.update(extra)
    return env


def start_zygote():
    """A zygote for this process's launches (distcheck/supervise/zygote.py), named in DISTCHECK_ZYGOTE; returns
    (process, folder) for stop_zygote. Launches that find no zygote there fall back to fresh interpreters."""
    import subprocess
    import tempfile
    import time

    from distcheck.processes import die_with_parent
    from distcheck.supervise.zygote import ENV

    folder = tempfile.mkdtemp(prefix="distcheck-test-zygote-")
    path = os.path.join(folder, "socket")
    proc = subprocess.Popen([sys.executable, "-m", "distcheck.supervise.zygote", path], env=env_for_ranks(),
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.environ[ENV] = path
    return proc, folder


def stop_zygote(proc, folder) -> None:
    import shutil

    from distcheck.processes import terminate
    from distcheck.supervise.zygote import ENV

    os.environ.pop(ENV, None)
    terminate([proc.pid], grace=3.0)  # its ranks die with it (PR_SET_PDEATHSIG)
    proc.wait(timeout=10)
    shutil.rmtree(folder, ignore_errors=True)


def run_python(args: list[str], timeout: float = 120, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> Result:
    """``python ARGS`` in its own session, forked by the session's zygote (tests/integration/conftest.py) when there
    is one, so that it does not import torch again. Output captured, a timeout, and a group kill at the end."""
    from distcheck.supervise.zygote import start_process

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = start_process(args, env_for_ranks(env), new_session=True, stdout=out_w, stderr=err_w,
                     cwd=None if cwd is None else str(cwd))
    finally:
        os.close(out_w)
        os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    reading = [out_r, err_r]
    deadline = time.monotonic() + timeout
    try:
        while reading and time.monotonic() < deadline:  # until every writer (the ranks too) closed its end
            for fd in select.select(reading, [], [], max(0.0, deadline - time.monotonic()))[0]:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    reading.remove(fd)
        if not reading:  # a process may close its output a moment before it exits (a torchrun agent leaving
            try:         # its rendezvous): its own exit code, not the SIGKILL below
                proc.wait(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:  # ranks may outlive a crashed torchrun: end everything this launch started, by its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = proc.wait(timeout=10)
        os.close(out_r)
        os.close(err_r)
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    if reading:
        raise AssertionError(f"command timed out after {timeout}s: python {' '.join(args)}\n{out}\n{err}")
    return Result(code, out, err)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120, **kw) -> Result:
    """torchrun's agent (torch.distributed.run, all the torchrun script runs), forked by the session's zygote when
    there is one (run_python). It starts its ranks itself; a ``-m distcheck`` rank then has the zygote fork it and
    stands in for it (distcheck/supervise/zygote.py, stand_in) unless ``env=FRESH``, as for users by default."""
    return run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
                      timeout=timeout, **kw)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launch's rendezvous (parallel tests never share one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_ranks(args: list[str], nproc: int = 2, timeout: float = 120, env: dict[str, str] | None = None) -> Result:
    """``python ARGS`` as ``nproc`` ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT of a free port: env:// rendezvous) and no distcheck launcher, each forked by the session's zygote
    (run_python) where torchrun's agent would start fresh interpreters that import torch again (seconds of CPU
    each). For the tests of distcheck's API in plain ranks and their baselines. Every rank's result, merged: the
    first non-zero exit code, the outputs in rank order."""
    import threading

    port = free_port()
    results: dict[int, Result | AssertionError] = {}

    def rank(r: int) -> None:
        world = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        try:
            results[r] = run_python(args, timeout=timeout, env={**(env or {}), **world})
        except AssertionError as exc:  # run_python's timeout
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(nproc)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [results[r] for r in range(nproc) if isinstance(results[r], AssertionError)]
    if failed:
        raise failed[0]
    done = [results[r] for r in range(nproc)]
    return Result(next((x.returncode for x in done if x.returncode), 0), "".join(x.stdout for x in done),
                  "".join(x.stderr for x in done))


def run_pytest(pytester, *args: str, timeout: float = 240):
    """pytester.runpytest_subprocess with the inner pytest forked by the session's zygote (run_python): the same
    command line (its own --basetemp, the test folder first on PYTHONPATH) and the same RunResult."""
    import tempfile

    import pytest

    basetemp = tempfile.mkdtemp(prefix="runpytest-", dir=pytester.path)
    started = time.monotonic()
    res = run_python(["-m", "pytest", f"--basetemp={basetemp}", *args], timeout=timeout, cwd=pytester.path,
                     env={"PYTHONPATH": os.pathsep.join(filter(None, [str(pytester.path),
                                                                      os.environ.get("PYTHONPATH", "")]))})
    return pytest.RunResult(res.returncode, res.stdout.splitlines(), res.stderr.splitlines(),
                            time.monotonic() - started)


def distcheck(args: list[str], timeout: float = 120, **kw) -> Result:
    return run_python(["-m", "distcheck", *args], timeout=timeout, **kw)


def load_report(report_dir: str | os.PathLike) -> dict:
    return json.loads((Path(report_dir) / "report.json").read_text())
