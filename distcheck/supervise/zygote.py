"""A fork server: one process imports torch once and forks rank processes from it, for one run or for many.

    DISTCHECK_ZYGOTE=1 python -m distcheck run --nproc 2 -- train.py     # a private zygote for this run

    python -m distcheck.supervise.zygote /tmp/dc/zygote.sock &          # a shared one, serving until killed
    DISTCHECK_ZYGOTE=/tmp/dc/zygote.sock python -m distcheck run --nproc 2 -- train.py
    DISTCHECK_ZYGOTE=/tmp/dc/zygote.sock torchrun --nproc-per-node 2 -m distcheck consistency   # see stand_in

Every rank would otherwise spend seconds of CPU importing torch (about 2 s each on this project's 2-core machine).
A private zygote pays that once per run instead of once per rank (`compare` reuses it for its reference and N-rank
runs, the pytest marker for every pool it starts); a shared one pays it once for every run that names its socket:
the test suite starts one per xdist worker (tests/integration/conftest.py). Forking after ``import torch`` (before
any CUDA or thread-pool initialization) is what DataLoader workers do on Linux by default. Off by default: ranks
forked from one zygote share its string-hash seed (fresh interpreters draw one each), so a bug that needs a
different set order per rank shows only without it.

Protocol, over a Unix SOCK_SEQPACKET socket (one message per request or reply, so the descriptors sent with a
request cannot straddle two): request ``{"args": [...], "env": {...}, "cwd": str, "fds": [targets],
"new_session": bool, "unbuffered": bool}``, where args is what follows the interpreter (``-m MODULE ...`` or
``SCRIPT ...``) and unbuffered is ``python -u``, with the descriptors to install at those numbers (stdin, stdout,
stderr, then any ``pass_fds``) -> reply ``{"pid": int}``;
later, unprompted, ``{"exit": pid, "code": int}`` when the process ends (negative: killed by that signal). A
connection owns the processes it asked for: when it closes (its launcher ended or was killed) the zygote SIGKILLs
those still running, as PR_SET_PDEATHSIG does for ranks a launcher starts itself; and every one dies with the
zygote. The zygote is single-threaded (a select loop), so nothing holds a lock when it forks.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from distcheck.contract import env as env_names
from distcheck.processes import AGENT_PID_ENV, alive, die_with_parent

log = logging.getLogger("distcheck")

ENV = env_names.ZYGOTE  # "1": a private zygote per launcher; a socket path: a shared one; unset or "0": none

# What every rank imports anyway, loaded once before any fork: FSDP2, DTensor, TP and torch._dynamo are most of a
# DDP or FSDP2 rank's CPU (torch._dynamo alone 1.1 s of 1.3 s; DDP's constructor and FSDP2's first DTensor import
# it). With torch 2.13 none of these starts a thread (serve() checks). With them preloaded, ranks deadlocked at the
# end of DDP scripts far more often (about one suite run in three) in torch's teardown, which joins a gloo worker
# under the GIL; rank/group_keepalive.py now keeps that teardown from running at all.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch._dynamo", "distcheck.cli", "distcheck.commands.run",
           "distcheck.rank.tracer", "distcheck.rank.autocheck", "distcheck.rank.entry", "distcheck.supervise.hang",
           # What every forked launcher and rank imports after the fork otherwise (about 0.1 s of CPU each): the
           # launcher's watch and report, the ranks' first-forward checks, sampler and stderr copy. None of them
           # starts a thread at import (serve() refuses to fork a multi-threaded zygote).
           "distcheck.supervise.supervised_run", "distcheck.supervise.node_report", "distcheck.analysis.stragglers",
           "distcheck.analysis.torch_errors", "distcheck.rank.checks.placement", "distcheck.rank.checks.mesh",
           "distcheck.rank.checks.replicas", "distcheck.rank.sampler", "distcheck.rank.records",
           "distcheck.rank.group_keepalive", "distcheck.rank.stderr_tee", "distcheck.rank.store_host")

_MAX_MESSAGE = 1 << 20  # a request carries the rank's environment: a few kB
_MAX_FDS = 16


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
    _skip_library_teardown()


def _skip_library_teardown() -> int:
    """Keep every process forked from here from tearing down, at its exit, the operator registrations the preload
    made; returns how many were switched off.

    Importing torch and the modules above creates about 170 ``torch.library.Library`` objects, each with a
    ``weakref.finalize`` that runs at interpreter exit and takes its operators out of the dispatcher. In a forked
    process that work writes into torch's operator tables, memory it shares with the zygote until written: 8,000
    page copies and 45 ms of CPU per process on this project's 2-core machine, a third of what a forked launcher
    costs, for a process that is ending anyway (nothing runs after it: forked processes leave through os._exit).
    Only torch.library's own finalizer is switched off, and only for what exists now: a Library the user's code
    creates after the fork keeps its own.
    """
    import weakref

    library = sys.modules.get("torch.library")
    teardown = getattr(library, "_del_library", None)
    if teardown is None:
        return 0
    skipped = 0
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):  # private to weakref: absent, none skipped
        info = finalizer.peek()
        if info is not None and info[1] is teardown and finalizer.atexit:
            finalizer.atexit = False
            skipped += 1
    return skipped


def _path_entries(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _install_fds(received: list[int], targets: list[int]) -> None:
    """Put each received descriptor at its target number (a target may be another received one's number)."""
    import fcntl

    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in received]  # above every target
    for fd in received:
        os.close(fd)
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)  # inheritable, like Popen's pass_fds
        os.close(fd)


def _child(request: dict, fds: list[int], server_fds: list[int], server_env: dict[str, str]) -> None:
    """In the forked process: become what ``python ARGS`` would have been, run it, exit."""
    for fd in server_fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("new_session"):
        os.setsid()  # like Popen(start_new_session=True): a group kill reaches its own children too
    die_with_parent()  # die with the zygote (which ends the processes of a launcher that dies)
    _install_fds(fds, request["fds"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["args"]  # what follows the interpreter: ["-m", MODULE, ...] or [SCRIPT, ...]
    module = args[1] if args[0] == "-m" else None
    # sys.path as the interpreter would build it: the working directory (-m) or the script's folder, then PYTHONPATH.
    inherited = set(_path_entries(server_env))
    rest = [p for p in sys.path[1:] if p not in inherited]
    first = request["cwd"] if module else os.path.dirname(os.path.abspath(args[0]))
    sys.path[:] = [first, *_path_entries(request["env"]), *rest]
    if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS; so do we
        sys.modules["numpy.random"].seed()  # (`random` reseeds itself after a fork)
    if "torch" in sys.modules:  # and torch's CPU generator (an unseeded model differs per rank, as under torchrun)
        sys.modules["torch"].default_generator.seed()
    sys.argv = list(args[1:] if module else args)  # runpy puts the module's file first, as `python -m` does
    # Buffering as a fresh interpreter would choose it for these descriptors, not as the zygote's own were:
    # stdout line-buffered on a terminal only, stderr always. Under `python -u` both reach the descriptor line by
    # line (the stream objects stay: handlers made at import hold them; -u alone would pass partial lines too).
    unbuffered = bool(request.get("unbuffered") or request["env"].get("PYTHONUNBUFFERED"))
    for stream, lines in ((sys.stdout, os.isatty(1)), (sys.stderr, True)):
        try:
            stream.reconfigure(line_buffering=lines or unbuffered, write_through=unbuffered)
        except (AttributeError, ValueError, OSError):  # a zygote started without that stream: nothing to set
            pass
    code = 1
    try:
        import runpy

        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
        code = 0
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


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the launcher is gone; its ranks are being ended
        pass


def listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)  # before the preload: a launcher connects at once and its first request waits for it
        os.chmod(path, 0o600)  # whoever can connect runs code as this user: this user only
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def serve(listener: socket.socket, private: bool = False) -> None:
    """Fork a process per request on ``listener``. ``private``: end when the first launcher disconnects."""
    _preload()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:  # never fork a multi-threaded process: the launchers fall back to fresh interpreters
        sys.stderr.write(f"distcheck zygote: {threads} threads after preloading; not forking\n")
        return
    server_env = dict(os.environ)
    owned: dict[socket.socket, set[int]] = {}  # connection -> the ranks it asked for that still run
    owner: dict[int, socket.socket] = {}
    served = False
    while True:
        readable, _, _ = select.select([listener, *owned], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                owned[conn] = set()
                served = True
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:  # the launcher ended: so do the ranks it started (those already ended are reaped below)
                for pid in owned.pop(sock):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                sock.close()
                continue
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _child(request, fds, [listener.fileno(), *(c.fileno() for c in owned)], server_env)
            for fd in fds:
                os.close(fd)
            owned[sock].add(pid)
            owner[pid] = sock
            _send(sock, {"pid": pid})
        while owner:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock = owner.pop(pid, None)
            if sock in owned:
                owned[sock].discard(pid)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})  # -N: killed by signal N
        if private and served and not owned and not owner:
            return


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
            if self.returncode is None and self._zygote.lost and not alive(self.pid):
                self.returncode = -signal.SIGKILL  # the zygote died, and its ranks with it
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
    """A launcher's connection to a zygote: private (started here, ends with this process) or shared (a socket).

    One per launcher process (``shared()``): ``compare`` reuses it for the reference and the N-rank runs.
    """

    _shared: "Zygote | None" = None
    _failed = False  # one warning, then fresh interpreters for the rest of this process

    def __init__(self, path: str, proc: subprocess.Popen | None = None, timeout: float = 10.0) -> None:
        self.proc = proc  # the private zygote's process; None for a shared one
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        deadline = time.monotonic() + timeout
        while True:  # a private zygote binds its socket a moment after it starts
            try:
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                    self.sock.close()
                    raise RuntimeError(f"no zygote listens on {path}") from None
                time.sleep(0.02)
        self.exits: dict[int, int] = {}
        self.lost = False

    @classmethod
    def shared(cls) -> "Zygote | None":
        """This process's zygote as DISTCHECK_ZYGOTE asks; None when it asks for none or none can be had."""
        setting = os.environ.get(ENV, "0")
        if setting in ("", "0") or sys.platform != "linux" or cls._failed:
            return None
        if cls._shared is not None and not cls._shared.lost:
            return cls._shared
        try:
            cls._shared = cls._private() if setting == "1" else cls(setting, timeout=0.0)  # shared: there or not
        except (OSError, RuntimeError) as exc:
            cls.give_up(f"{ENV}={setting}: {exc}")
        return cls._shared

    @classmethod
    def give_up(cls, why: str) -> None:
        log.warning("%s; starting ranks as fresh interpreters", why)
        cls._shared, cls._failed = None, True

    @classmethod
    def _private(cls) -> "Zygote":
        folder = tempfile.mkdtemp(prefix="distcheck-zygote-")
        path = os.path.join(folder, "socket")
        proc = subprocess.Popen([sys.executable, "-m", "distcheck.supervise.zygote", "--private", path],
                                stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent if sys.platform == "linux" else None)
        try:
            return cls(path, proc)
        finally:  # connected (or failed): the name is no longer needed
            for remove, name in ((os.unlink, path), (os.rmdir, folder)):
                try:
                    remove(name)
                except OSError:
                    pass

    def _handle(self, data: bytes) -> int | None:
        if not data:
            self.lost = True
            return None
        message = json.loads(data)
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
            return None
        return message["pid"]

    def collect(self) -> None:
        """Read the exits the zygote reported, without waiting."""
        while not self.lost:
            try:
                data = self.sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            self._handle(data)

    def spawn(self, args: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = (),
              new_session: bool = False, stdout: int | None = None, stderr: int | None = None,
              cwd: str | None = None, timeout: float = 120.0, unbuffered: bool = False) -> ForkedRank:
        """Fork ``python ARGS`` (``-m MODULE ...`` or ``SCRIPT ...``) with this process's stdin and ``pass_fds``,
        and its stdout and stderr unless given.

        Waits (bounded) for the zygote's preload when it has only just started.
        """
        targets = [0, 1, 2, *pass_fds]
        sent = [0, 1 if stdout is None else stdout, 2 if stderr is None else stderr, *pass_fds]
        request = {"args": list(args), "env": env, "cwd": cwd or os.getcwd(), "fds": targets,
                   "new_session": new_session, "unbuffered": unbuffered}
        socket.send_fds(self.sock, [json.dumps(request).encode()], sent)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.sock], [], [], max(remaining, 0))
            if not ready:
                raise RuntimeError("the zygote did not fork the rank")
            pid = self._handle(self.sock.recv(_MAX_MESSAGE))
            if pid is not None:
                return ForkedRank(pid, self)
            if self.lost:
                raise RuntimeError("the zygote exited")


def start_process(args: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = (), new_session: bool = False,
                  stdout: int | None = None, stderr: int | None = None,
                  cwd: str | None = None) -> "subprocess.Popen | ForkedRank":
    """``python ARGS`` as a process that dies with this one: forked by the zygote DISTCHECK_ZYGOTE asks for, or a
    fresh interpreter (the default, and what a zygote that fails falls back to: it costs speed only).

    ``stdout``, ``stderr``: descriptors to write to instead of this process's (the same one twice merges them).
    """
    zygote = Zygote.shared()
    if zygote is not None:
        try:
            # py-spy runs from this process, which is not the forked process's parent: it says so (stack_hooks)
            return zygote.spawn(args, {**env, env_names.PTRACER: str(os.getpid())}, pass_fds, new_session,
                                stdout, stderr, cwd)
        except (OSError, RuntimeError) as exc:
            Zygote.give_up(f"zygote unavailable ({exc})")
    return subprocess.Popen([sys.executable, *args], env=env, pass_fds=tuple(pass_fds), start_new_session=new_session,
                            stdout=stdout, stderr=stderr, cwd=cwd,
                            preexec_fn=die_with_parent if sys.platform == "linux" else None)


# The stop signals torchrun sends, and the stack-dump ones: what reaches the stand-in reaches the rank.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def stand_in(argv: Sequence[str]) -> int | None:
    """A torchrun rank of ``python -m distcheck ARGV``, forked by the shared zygote DISTCHECK_ZYGOTE names while this
    process (the one torchrun started: about 0.1 s of CPU, no torch) stands in for it; None: run here as usual.

        DISTCHECK_ZYGOTE=/tmp/dc/zygote.sock torchrun --nproc-per-node 2 -m distcheck consistency

    To torchrun the stand-in is the rank: it passes the rank its stdio, its environment and every stop signal, and
    ends as the rank ends (the same exit code, or death by the same signal). If the stand-in is SIGKILLed, its
    connection closes and the zygote kills the rank. The rank finds the agent in DISTCHECK_AGENT_PID (procs.agent_pid)
    and names its own parent, the zygote, as its ptracer: the node watcher it starts descends from the zygote.
    """
    setting = os.environ.get(ENV, "0")
    if (setting in ("", "0", "1") or sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ
            or AGENT_PID_ENV in os.environ or not argv or argv[0] not in ("consistency", "run")):
        return None
    zygote = Zygote.shared()  # the socket's zygote ("1", a private one, is excluded above): None, and warned, if none
    if zygote is None:
        return None
    env = {k: v for k, v in os.environ.items() if k != env_names.PTRACER}
    env[AGENT_PID_ENV] = str(os.getppid())
    try:
        # torchrun starts `python -u` (stdout writes through): so must the rank, or its output waits for its exit
        rank = zygote.spawn(["-m", "distcheck", *argv], env,
                            unbuffered=bool(getattr(sys.stdout, "write_through", False)))
    except (OSError, RuntimeError) as exc:
        Zygote.give_up(f"zygote unavailable ({exc})")
        return None

    def forward(sig: int, _frame: object) -> None:
        try:
            rank.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    code = rank.wait()
    if code < 0:  # killed by a signal: so is the stand-in, as torchrun would have seen it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # a signal that stops rather than kills; fall through to a plain exit code
    return 128 - code if code < 0 else code


def main(argv: Sequence[str]) -> int:
    private = argv[:1] == ["--private"]
    args = list(argv[1:] if private else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m distcheck.supervise.zygote SOCKET_PATH"
                         "   (then DISTCHECK_ZYGOTE=SOCKET_PATH)\n")
        return 2
    try:
        listener = listen(args[0])
    except OSError as exc:  # a path in use, or a folder that is missing or not writable
        sys.stderr.write(f"distcheck zygote: cannot listen on {args[0]}: {exc.strerror or exc}; remove the old "
                         "socket or pick another path\n")
        return 2
    serve(listener, private=private)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
