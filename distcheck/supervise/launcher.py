"""Start and supervise the ranks of ``distcheck run --nproc N`` (and ``compare``), never hanging past a timeout.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py --lr 0.1

Why our own supervisor rather than torch.distributed.launcher.api.elastic_launch: the elastic agent tears every
worker down (SIGTERM, then SIGKILL after 30 s) as soon as one fails, before the survivors can raise the backend
error that we keep as evidence; it exposes no rank pids or progress hook without reaching into private attributes
(``agent._pcontext``); and its restart and rendezvous machinery is dead weight for a one-shot check. We keep
torch's rendezvous protocol, though: a TCPStore that outlives every rank, as torchrun's agent's does, and
``TORCHELASTIC_USE_AGENT_STORE`` set exactly like torchrun's agent, so ``init_process_group()`` in the user's
script behaves as under torchrun, and there is no free-port race (we bind port 0 and pass on the port it got).
The store is served by a process rank 0 forks before anything else (rank/store_host.py), with a lifeline pipe
from here: this process never imports torch, which would cost every run a second of CPU.

Watching is the one watch loop's (supervise/watch.py): on a hang, or a stop signal (``interrupt``), it dumps every
rank's stack while the ranks are still alive (``dump``), then the ranks are ended here with the one kill routine
(supervise/procs.terminate). ``should_stop`` lets the caller end a run early that can provably not progress (a
rank waits in a collective a finished peer never issued).

Nothing of the run outlives it: every rank gets the run's id (DISTCHECK_RUN_ID), which whatever it execs inherits,
the watch loop remembers each live rank's process tree, and this process adopts the ranks' orphans (a child
subreaper); once the ranks have ended, everything found these ways is ended too (supervise/procs.RunTree): a
helper a correct script left running, a stuck DataLoader worker, a script's own spawned processes. The ranks'
stderr copies (rank/stderr_tee.py) go last, once they have drained, so that nothing holds this process's output
open after it exits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from distcheck.contract.findings import Finding
from distcheck.processes import (
    LAUNCHER_ENV, RUN_ID_ENV, launcher_id, new_run_id, set_child_subreaper, start_ticks, terminate,
)
from distcheck.supervise.live_stragglers import LiveStragglers
from distcheck.supervise.procs import RunTree
from distcheck.supervise.signals import Interrupt, StopNow
from distcheck.supervise.watch import HUNG, INTERRUPTED, STOP_GRACE, STOPPED, HangDump, WatchLoop
from distcheck.supervise.zygote import start_process

ShouldStop = Callable[[dict[int, "int | None"]], "str | None"]


@dataclass
class RankExit:
    rank: int
    pid: int
    returncode: int | None  # None: still running when distcheck killed it
    signal: str | None = None  # the signal that ended it, when returncode < 0
    killed: str | None = None  # "hang", "stop" or "interrupt" (a signal to the launcher) when distcheck ended it


@dataclass
class SupervisorResult:
    exits: dict[int, RankExit]
    hung: bool
    stop_reason: str | None
    hang_findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _distcheck_args(argv: Sequence[str]) -> list[str] | None:
    """The arguments after ``python -m distcheck``, or None for any other command line."""
    argv = list(argv)
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1:3] == ["-m", "distcheck"]:
        return argv[3:]
    return None


class LauncherRanks:
    """The launcher's RankSource (supervise/watch.py): its child processes. ``live()`` also remembers each live
    rank's process tree as it goes."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def live(self) -> dict[int, int]:
        pids = self.supervisor.pids()
        if self.supervisor.tree is not None:
            self.supervisor.tree.observe(pids)
        return pids

    def finished(self) -> set[int]:
        return {r for r, p in self.supervisor.procs.items() if p.poll() is not None}


class Supervisor:
    """Launch ``nproc`` ranks of ``argv_for_rank(rank)`` and supervise them until they end or stop progressing."""

    def __init__(self, nproc: int, argv_for_rank: Callable[[int], Sequence[str]], *, report_dir: str | os.PathLike,
                 timeout: float, env: dict[str, str] | None = None, dump: HangDump | None = None,
                 should_stop: ShouldStop | None = None, stop_grace: float = STOP_GRACE, poll: float = 0.1,
                 kill_grace: float = 3.0, startup_timeout: float | None = None,
                 interrupt: Interrupt | None = None) -> None:
        self.nproc = nproc
        self.argv_for_rank = argv_for_rank
        self.report_dir = Path(report_dir)
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env)
        self.dump = dump
        self.interrupt = interrupt
        self.should_stop = should_stop
        self.stop_grace = min(stop_grace, timeout)
        self.poll = poll
        self.kill_grace = kill_grace
        self.startup_timeout = startup_timeout
        self.procs: dict[int, subprocess.Popen] = {}
        self._lifeline: int | None = None  # write end of the store host's lifeline pipe (see rank/store_host.py)
        self.run_id = new_run_id()
        self.tree: RunTree | None = None  # every other process of the run, once the ranks are started

    def pids(self) -> dict[int, int]:
        """rank -> pid of every rank still running (for stack dumps)."""
        return {r: p.pid for r, p in self.procs.items() if p.poll() is None}

    def _rank_env(self, rank: int, port: int) -> dict[str, str]:
        env = dict(self.env)
        env.update({
            RUN_ID_ENV: self.run_id, LAUNCHER_ENV: launcher_id(os.getpid()),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.nproc), "ROLE_NAME": "default",
        })
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def run(self) -> SupervisorResult:
        import socket

        started = time.monotonic()
        # Bind the store's port before starting the ranks (no free-port race). Rank 0 serves the store on this
        # socket (rank/store_host.py), whether it is a fresh interpreter or forked by a zygote.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        killed: dict[int, str] = {}
        result = None
        # Orphans of the ranks' processes come to this process rather than to init (a rank that dies leaves its
        # DataLoader workers and helpers behind): the sweep below finds them as its own children.
        set_child_subreaper()
        stopping = False
        try:
            self._launch(port, listener.fileno())
            listener.close()  # rank 0's store host has its own copy
            self.tree = self._run_tree()
            loop = WatchLoop(self.report_dir, self.timeout, source=LauncherRanks(self), expected=self.nproc,
                             should_stop=self._should_stop, dump=self.dump, startup_timeout=self.startup_timeout,
                             stop_grace=self.stop_grace, poll=self.poll, interrupt=self.interrupt,
                             stragglers=LiveStragglers(self.report_dir))
            result = loop.run()
            if result.state in (HUNG, STOPPED, INTERRUPTED):
                alive = sorted(self.pids())
                why = {HUNG: "hang", STOPPED: "stop", INTERRUPTED: "interrupt"}[result.state]
                killed.update({r: why for r in alive})
                self._end(alive)
        except StopNow:
            stopping = True
            self._end(sorted(self.pids()), grace=0.0)  # a second signal: at once
            raise
        finally:
            leftover = sorted(self.pids())
            if leftover:  # interrupted (Ctrl-C, an exception): never leave ranks behind
                self._end(leftover)
            if self._lifeline is not None:  # the store host sees end-of-file and exits
                os.close(self._lifeline)
                self._lifeline = None
            if listener.fileno() >= 0:
                listener.close()
            # However the run ended: what the ranks started, and their stderr copies once drained.
            (self.tree or self._run_tree()).end(grace=0.0 if stopping else 1.0)
        exits = {}
        for r, p in self.procs.items():
            code = p.returncode
            exits[r] = RankExit(r, p.pid, None if r in killed else code,
                                None if r in killed else _signal_name(code), killed.get(r))
        reason = result.stop_reason if result is not None else None
        if result is not None and result.state == INTERRUPTED:
            reason = f"stopped from outside by {reason}"
        return SupervisorResult(exits, result is not None and result.state == HUNG, reason,
                                result.hang_findings if result is not None else [], time.monotonic() - started)

    def _run_tree(self) -> RunTree:
        from distcheck.supervise.zygote import Zygote

        ranks = [p.pid for p in self.procs.values()]
        zygote = Zygote._shared.proc if Zygote._shared is not None else None
        keep = ranks + ([zygote.pid] if zygote is not None else [])
        since = [t for t in map(start_ticks, ranks) if t is not None]
        return RunTree(self.run_id, keep, adopt_since=min(since) if since else None)

    def _should_stop(self, finished: set[int]) -> str | None:
        if self.should_stop is None:
            return None
        return self.should_stop({r: p.poll() for r, p in self.procs.items()})

    def _launch(self, port: int, listen_fd: int) -> None:
        """Start every rank; rank 0 gets the store's socket and the read end of the lifeline (rank/store_host.py)."""
        from distcheck.contract.env import STORE_FDS as ENV_STORE_FDS

        for rank in range(self.nproc):
            argv = list(self.argv_for_rank(rank))
            args = _distcheck_args(argv)
            if args is None or args[:1] != ["run"]:
                raise ValueError(f"a rank runs `python -m distcheck run ...`, not {argv}")
            env = self._rank_env(rank, port)
            pass_fds: tuple[int, ...] = ()
            if rank == 0:
                read_end, self._lifeline = os.pipe()
                env[ENV_STORE_FDS] = f"{listen_fd},{read_end}"
                pass_fds = (listen_fd, read_end)
            try:
                self.procs[rank] = start_process(argv[1:], env, pass_fds)
            finally:
                if rank == 0:
                    os.close(read_end)

    def _end(self, ranks: list[int], grace: float | None = None) -> None:
        """The one kill routine (SIGTERM, then SIGKILL after kill_grace), then reap our children."""
        terminate([self.procs[r].pid for r in ranks if self.procs[r].poll() is None],
                  grace=self.kill_grace if grace is None else grace)
        for r in ranks:
            try:
                self.procs[r].wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.procs[r].kill()
                self.procs[r].wait()
