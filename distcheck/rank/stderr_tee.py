"""Pass this rank's stderr on to the console in whole lines, and keep a bounded copy in the report directory, so a
failure report can quote its last lines.

    python -m distcheck run --nproc 2 -- train.py     # every rank: stderr-rank<R>.txt next to its trace

The copy is taken at the file-descriptor level, so it holds what torch's C++ side prints too ("terminate called
without an active exception", NCCL and gloo errors), not only Python's. fd 2 of the rank becomes a pipe, read by a
small process of its own (this file run as a script: ``python -I -S stderr_tee.py --copy FILE``; no torch, no
distcheck import) that writes to the original stderr (the console, or the launcher's log) and to the file. A
separate process, so what the rank wrote just before it was killed or aborted is still drained into the file.

Why not ``tee``: the ranks share one console, and a pipe keeps a write whole only up to PIPE_BUF (4096) bytes. A
rank writes a line at a time (logging does), so plain torchrun never splices lines; ``tee`` passes on whatever its
read returned, cut anywhere, and lines of two ranks came out spliced into each other. This copier writes only
whole lines, at most PIPE_BUF bytes per write (a longer line alone), so every line arrives whole at any volume; a
line still without its newline is passed on once the rank pauses (FLUSH_AFTER: a prompt, a progress bar).

The copy in the report directory is bounded: the first and the last KEEP bytes, with a line between them saying
how much was cut (contract/stderr_file.py, the file's one writer and reader).

It costs the rank less than writing to the console itself: the rank's pipe holds 1 MiB, and the copier reads it
in batches (after a read that found little it waits BATCH, a millisecond), so a rank writing line after line does
not wake it up once per line, and the console gets a few large writes instead of one per line (bench/
bench_output.py: 200,000 lines per rank, 2 ranks, 0.68 of plain torchrun's time).

The copier ends when every writer of its pipe has (the rank and whatever the rank started that inherited its
stderr); it carries DISTCHECK_ROLE=stderr-copy, so the sweeps of supervise/procs.py let it drain instead of killing
it, and its own session, so a group kill aimed at the rank does not end it before it drained. It is also the last
resort when no sweep can run (``Orphaned``: the launcher was SIGKILLed).
Where it cannot be started the rank keeps its plain stderr and reports simply carry no stderr tail.
"""
from __future__ import annotations

import os
import sys
import time

# The copier starts once per rank, so its start imports only what it uses: typing.TYPE_CHECKING without typing,
# stderr_file by a plain import from its folder (added last: nothing in it shadows the standard library) instead of
# importlib.util, and the C module _signal below. typing (re, enum, collections), importlib.util (contextlib,
# functools) and signal's enums were 25 of the 50 ms of CPU a copier's start took (bench/bench_copier_start.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

if __package__:
    from distcheck.contract import stderr_file
else:  # the copier, run as a script with no distcheck on the path (python -I -S): the same module, by its path
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract"))
    import stderr_file
BoundedCopy, KEEP, KEEP_ENV = stderr_file.BoundedCopy, stderr_file.KEEP, stderr_file.KEEP_ENV
PIPE_BUF = 4096  # POSIX's minimum, Linux's value: a write to a pipe up to this size is never interleaved
FLUSH_AFTER = 0.05  # seconds a line without its newline waits for the rest before it is passed on as it is
PIPE_SIZE = 1 << 20  # the rank's stderr pipe (Linux's default limit for F_SETPIPE_SZ): a flood never blocks it
READ_SIZE = PIPE_SIZE
LINE_LIMIT = 1 << 16  # a line without its end is passed on once it is this long
BATCH = 0.001  # seconds between reads that found little
DRAIN = 0.2  # seconds of silence that end the copy once the rank and its launcher are gone and its processes ended
DRAIN_MAX = 2.0  # seconds that drain may take at most

_tee = None  # the copier's Popen, in the rank


def tee_stderr(report_dir: str | os.PathLike, rank: int) -> Path | None:
    """From now on, pass fd 2 of this process on in whole lines and copy it into ``stderr-rank<R>.txt`` (appended,
    bounded); returns the path."""
    import subprocess

    from distcheck.contract import files
    from distcheck.processes import ROLE_ENV, STDERR_COPY

    global _tee
    if _tee is not None:
        if _tee.poll() is None:
            return None
        _tee = None  # a copier inherited from the process this one was forked from, or one that died: a new one
    path = files.rank_file(report_dir, "stderr", rank)
    try:
        sys.stderr.flush()
        console = os.dup(2)
        try:
            # -I -S: no site, no user paths, nothing of the rank's environment changes what this tiny loop does.
            # --rank: which process the rank is, told rather than found. Under load a rank can be killed before
            # the copier's interpreter is up, and the copier's parent is then init already.
            me = f"{os.getpid()}:{_start_ticks(os.getpid())}"
            _tee = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), "--copy", str(path),
                                     "--rank", me],
                                    stdin=subprocess.PIPE, stdout=console, stderr=subprocess.DEVNULL, close_fds=True,
                                    start_new_session=True, env={**os.environ, ROLE_ENV: STDERR_COPY})
        finally:
            os.close(console)
    except OSError as exc:  # the rank keeps its plain stderr; its reports quote no stderr tail
        sys.stderr.write(f"distcheck: rank {rank}: no copy of its stderr in {path} ({exc})\n")
        return None
    try:
        import fcntl

        fcntl.fcntl(_tee.stdin.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
    except OSError:  # above the system's pipe-max-size: the default (64 KiB) still works, with more wake-ups
        pass
    os.dup2(_tee.stdin.fileno(), 2)
    _tee.stdin.close()  # fd 2 is now the only write end: the copier ends when this process (and its children) end
    return path


def copier_pid() -> int | None:
    """The pid of this rank's stderr copier, if it started one."""
    return _tee.pid if _tee is not None else None


# --- the copier (runs as its own process) ------------------------------------------------------------------------


def write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def whole_line_chunks(block: bytes, limit: int = PIPE_BUF):
    """``block`` (whole lines) cut at line ends into pieces of at most ``limit`` bytes; a longer line is a piece
    of its own."""
    start, size = 0, len(block)
    while start < size:
        end = start + limit
        if end >= size:
            end = size
        else:
            newline = block.rfind(b"\n", start, end)
            if newline < 0:  # one line longer than the limit: whole, in one piece
                newline = block.find(b"\n", end)
                end = size if newline < 0 else newline + 1
            else:
                end = newline + 1
        yield block[start:end]
        start = end


def copy(src: int, dst: int, path: str, keep: int = KEEP, idle=None) -> None:
    """Read ``src`` to its end: whole lines to ``dst`` (at most PIPE_BUF bytes a write), everything to the bounded
    copy at ``path``. A console that goes away (a closed pipe) is dropped; the rank is never blocked by it.
    ``idle()`` is called when nothing came for IDLE seconds, and ``idle(final=True)`` at the end. Once it returns
    True, what is still in ``src`` is drained (until it stays empty for DRAIN seconds, DRAIN_MAX at most) and the
    copy ends, even if some writer still holds ``src`` open (a rank's last thread on its way out of the kernel, a
    helper that escaped the sweep)."""
    import select

    out = BoundedCopy(path, keep)
    pending = b""  # a line still without its newline, held back from the console
    console = True

    def emit(block: bytes) -> None:
        nonlocal console
        if not console or not block:
            return
        try:
            for piece in whole_line_chunks(block):
                write_all(dst, piece)
        except OSError:  # EPIPE: nobody reads the console any more; keep draining into the file
            console = False

    closing, close_by = False, 0.0
    while True:
        wait = DRAIN if closing else FLUSH_AFTER if pending else IDLE
        if (pending or idle) and not select.select([src], [], [], wait)[0]:
            if pending:
                emit(pending)  # the rank paused mid-line: pass it on as it is
                pending = b""
            elif closing:
                break
            elif idle and idle():
                closing, close_by = True, time.monotonic() + DRAIN_MAX
            continue
        if closing and time.monotonic() > close_by:  # a writer that escaped the sweep and keeps writing
            break
        try:
            data = os.read(src, READ_SIZE)
        except InterruptedError:
            continue
        except OSError:
            break
        if not data:
            break
        out.write(data)
        buf = pending + data if pending else data
        end = buf.rfind(b"\n") + 1
        emit(buf[:end])
        pending = buf[end:]
        if len(pending) > LINE_LIMIT:  # a line without end: do not hold it back forever
            emit(pending)
            pending = b""
        if len(data) < LINE_LIMIT:
            # Read in batches: a rank writing line after line would otherwise wake this process up for every
            # line (a context switch per write, on the rank's time). What came is already passed on; the rank's
            # next lines wait in the pipe for at most BATCH seconds (a millisecond of a flood is ~100 KB: the
            # pipe, PIPE_SIZE, holds ten times that).
            time.sleep(BATCH)
    emit(pending)
    out.close()
    if idle and not closing:
        idle(final=True)


# --- the last resort: a run whose launcher was SIGKILLed ---------------------------------------------------------

RUN_ID_ENV, ROLE_ENV, LAUNCHER_ENV = "DISTCHECK_RUN_ID", "DISTCHECK_ROLE", "DISTCHECK_LAUNCHER"  # supervise/procs.py
IDLE = 1.0  # seconds between checks that the rank and its launcher are still there


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def _has_ended(pid: int, ticks: int | None) -> bool:
    """The process ``pid`` (started at ``ticks``) has ended, or its main thread has: a zombie leader. Python never
    ends its main thread alone, so that is a process on its way out (killed, with a thread still leaving the
    kernel); its children stay parented to its last thread until then, so a parent check alone would wait."""
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X") or (ticks is not None and stat[1] != ticks)


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


class Orphaned:
    """Ends this rank's processes when nobody else will: the rank has ended (this copier's parent changed) and so
    has the process that launched it (DISTCHECK_LAUNCHER, "pid:start ticks": distcheck's launcher, or torchrun's
    agent), as when the launcher was SIGKILLed and the ranks died with it (PR_SET_PDEATHSIG). Every other way a
    run ends, the launcher or the node watcher ends them (supervise/procs.RunTree), and this does nothing.

    Only processes tagged with this run's id and this rank's RANK are ended (what the rank started, its helpers'
    children too), never one of distcheck's own (DISTCHECK_ROLE): a helper that holds the rank's stderr open
    would otherwise keep this copier, and the console, alive with it.
    """

    def __init__(self, env=os.environ, rank: str | None = None) -> None:
        """``rank``: "pid:start ticks" of the rank whose output this copies (its parent, by default)."""
        pid, _, ticks = (rank or "").partition(":")
        if pid.isdigit():
            self.parent, self.parent_ticks = int(pid), int(ticks) if ticks.isdigit() else None
        else:
            self.parent = os.getppid()
            self.parent_ticks = _start_ticks(self.parent)
        self.run_id = env.get(RUN_ID_ENV, "")
        self.rank = env.get("RANK", "")
        pid, _, ticks = env.get(LAUNCHER_ENV, "").partition(":")
        self.launcher = (int(pid), int(ticks)) if pid.isdigit() and ticks.isdigit() else None
        self.done = False

    def __call__(self, final: bool = False) -> bool:
        """True once this copier has ended the rank's processes: then nobody the run knows of writes to its input
        any more, and it should drain what is there and end."""
        if self.done or not self.run_id or self.launcher is None:
            return self.done
        if not _has_ended(*self.launcher):
            # The launcher is there: it ends what the ranks left, once they have ended. A zombie is not: a parent
            # that reads distcheck's output to its end (subprocess.run) reaps the launcher only after that.
            return False
        deadline = time.monotonic() + (0.5 if final else 0.0)  # at the end of our input the rank may be exiting
        while not self.rank_ended() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.rank_ended():
            return False  # the rank still runs
        self.done = True
        # Until a pass finds nothing: a process whose /proc entry could not be read in one pass (one on its way
        # out, or being set up) is looked at again.
        for _ in range(5):
            if not self.sweep():
                break
            time.sleep(0.1)
        return True

    def rank_ended(self) -> bool:
        return os.getppid() != self.parent or _has_ended(self.parent, self.parent_ticks)

    def sweep(self) -> int:
        """SIGKILL this rank's processes; how many were found."""
        import signal

        tag, rank = f"{RUN_ID_ENV}={self.run_id}".encode(), f"RANK={self.rank}".encode()
        role = f"{ROLE_ENV}=".encode()
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            env = _environ(int(entry))
            if tag in env and rank in env and not any(item.startswith(role) for item in env):
                found += 1
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        return found


def _main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or argv[0] != "--copy" or len(argv) == 4 and argv[2] != "--rank":
        sys.stderr.write("usage: python -I -S stderr_tee.py --copy FILE [--rank PID:START_TICKS]   (stdin: the "
                         "rank's stderr)\n")
        return 2
    try:
        keep = int(os.environ.get(KEEP_ENV, KEEP))
    except ValueError:
        keep = KEEP
    try:
        import _signal as signals  # what signal wraps in enums (see the top of the file)
    except ImportError:
        import signal as signals

    # A stop signal aimed at the rank's terminal group (Ctrl-C) must not end the copy before it drained: the
    # copier ends when its input does.
    for sig in (signals.SIGINT, signals.SIGHUP):
        signals.signal(sig, signals.SIG_IGN)
    copy(0, 1, argv[1], keep, idle=Orphaned(rank=argv[3] if len(argv) == 4 else None))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
