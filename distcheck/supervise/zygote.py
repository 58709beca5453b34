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
import sys

# What every rank imports anyway: loaded once, before any fork.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "distcheck.cli", "distcheck.commands.run", "distcheck.rank.tracer",
           "distcheck.rank.autocheck", "distcheck.supervise.watchdog")


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
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    except Exception:
        pass
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


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
