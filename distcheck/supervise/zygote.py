"""A process that imports torch once and forks rank processes from it (used by the launcher).

    python -m distcheck.supervise.zygote REQUEST_FD REPLY_FD      # started by distcheck.supervise.launcher, not by users

Every rank would otherwise spend seconds of CPU importing torch (about 3 s each on this project's 2-core
machine); a `run --nproc 2` or `compare --nproc 2` pays that once here instead of once per rank, and `compare`
reuses the same zygote for its reference and N-rank runs. Forking after ``import torch`` (before any CUDA or
thread-pool initialization) is what DataLoader workers do on Linux by default.

Protocol, one JSON object per line: request ``{"argv": [...], "env": {...}, "cwd": str}`` -> reply
``{"pid": int}``; later, unprompted, ``{"exit": pid, "code": int}`` when a rank ends (negative: killed by that
signal). The zygote is single-threaded (a select loop), so nothing holds a lock when it forks.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Sequence

from distcheck.supervise.procs import die_with_parent

# What every rank imports anyway: loaded once, before any fork. Not torch.distributed.fsdp/.tensor: they import
# torch._dynamo, and ranks forked after that deadlocked at the end of a DDP script (9 of 48 runs of
# fixtures/cmp_loss_sum.py, 4 loops in parallel): the main thread, holding the GIL, destroys the Reducer and joins
# ProcessGroupGloo's worker, which waits for the GIL to drop a Python object held by a finished work's
# ThreadLocalState. Without them: 0 of 48.
PRELOAD = ("torch", "torch.distributed", "distcheck.cli", "distcheck.commands.run", "distcheck.rank.tracer",
           "distcheck.rank.autocheck", "distcheck.rank.entry", "distcheck.supervise.hang")


def _preload() -> None:
    import importlib

    # numpy's OpenBLAS starts a thread-pool thread at import; a fork copies the pool's bookkeeping but not its
    # thread, so a rank could wait on a worker that does not exist. One BLAS thread means no pool thread: the
    # zygote stays single-threaded when it forks. (It affects numpy's own BLAS in the ranks only, not torch's.)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # a rank imports it again and reports the error in its own output
            pass


def _child(request: dict, fds: tuple[int, int]) -> None:
    """In the forked rank: become what `python -m distcheck ...` would have been, run it, exit."""
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()  # die with the zygote, which dies with the launcher
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    sys.argv = ["python -m distcheck", *argv]
    code = 1
    try:
        from distcheck.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - print it as the interpreter would, then exit non-zero
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # what interpreter shutdown would run (the user's atexit handlers too)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)


def serve(request_fd: int, reply_fd: int) -> None:
    _preload()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:  # never fork a multi-threaded process: the launcher falls back to fresh interpreters
        sys.stderr.write(f"distcheck zygote: {threads} threads after preloading; not forking\n")
        return
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    buffer = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([request_fd], [], [], 0.05)
        if readable:
            chunk = os.read(request_fd, 65536)
            if not chunk:  # the launcher is gone: end (the ranks die with us through PR_SET_PDEATHSIG)
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, (request_fd, reply_fd))
                children.add(pid)
                reply.write(json.dumps({"pid": pid}) + "\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            reply.write(json.dumps({"exit": pid, "code": code}) + "\n")


# --- the launcher's handle on the zygote -----------------------------------------------------------------------


class ForkedRank:
    """A rank forked by the zygote: the subset of subprocess.Popen the supervisor uses."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.collect()
            self.returncode = self._zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        try:
            self.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """The launcher's handle on ``python -m distcheck.supervise.zygote``: forks ranks that have torch imported already.

    One per supervising process (compare reuses it for the reference and the N-rank runs). Used for ranks that
    run ``python -m distcheck ...`` when DISTCHECK_ZYGOTE=1. Off by default: the stall at the end of a script that
    the test suite saw under load came from preloading torch._dynamo (see PRELOAD); with it gone the suite passed
    once and the 48-run loop showed no stall, which is not yet enough to make forking the default. (It cut the
    suite's CPU time by about a third but not its wall time on the 2-core VM, which had other limits.)
    """

    _shared: "Zygote | None" = None

    def __init__(self) -> None:
        req_r, self._req_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "distcheck.supervise.zygote", str(req_r), str(reply_w)],
                                     pass_fds=(req_r, reply_w), stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent if sys.platform == "linux" else None)
        os.close(req_r)
        os.close(reply_w)
        os.set_blocking(self._reply_r, False)
        self._buffer = b""
        self.exits: dict[int, int] = {}
        self._pids: list[int] = []
        self._ready = False

    @classmethod
    def shared(cls) -> "Zygote | None":
        if os.environ.get("DISTCHECK_ZYGOTE", "0") != "1" or sys.platform != "linux":
            return None
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def _read(self, timeout: float) -> None:
        import select

        ready, _, _ = select.select([self._reply_r], [], [], timeout)
        if not ready:
            return
        try:
            chunk = os.read(self._reply_r, 65536)
        except BlockingIOError:
            return
        if not chunk:
            raise RuntimeError("the zygote exited")
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            msg = json.loads(line)
            if "ready" in msg:
                self._ready = True
            elif "pid" in msg:
                self._pids.append(msg["pid"])
            elif "exit" in msg:
                self.exits[msg["exit"]] = msg["code"]

    def collect(self) -> None:
        self._read(0)

    def spawn(self, argv: Sequence[str], env: dict[str, str], timeout: float = 120.0) -> ForkedRank:
        """Fork a rank running ``python -m distcheck <argv>``; waits (bounded) for the zygote's torch import."""
        os.write(self._req_w, (json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()}) + "\n").encode())
        deadline = time.monotonic() + timeout
        while not self._pids:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the zygote did not fork the rank")
            self._read(0.05)
        return ForkedRank(self._pids.pop(0), self)



if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
