"""A pool of live rank processes that run distributed test bodies, reused across tests.

torch's MultiProcessTestCase spawns fresh processes (and re-imports torch) for every test; here each pytest
process (each xdist worker) keeps one pool per world size: N rank processes that joined one process group once.
A test is shipped to every rank as (test file, module name, function name, picklable arguments) and each rank
sends back passed / failed (with its traceback) / skipped. A test that fails, hangs or kills a rank retires the
pool, and the next test gets a fresh one, so one bad test never poisons the next.

The pytest process hosts the TCPStore on a port the OS picks (port 0), so parallel pools never collide.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Callable

from distcheck.contract import env as env_names
from distcheck.testing.leftovers import ENV_TAG

log = logging.getLogger("distcheck")

START_TIMEOUT = 120.0
STOP_AFTER = 2.0  # seconds before asking whether a test can still progress at all
FAILURE_GRACE = 5.0  # seconds the other ranks get once one rank failed


@dataclass
class PoolOutcome:
    """One rank's outcome of one pytest test (not a run's RankOutcome: analysis/trace_align.py)."""

    rank: int
    status: str  # "passed", "failed", "skipped", "died", "hung"
    text: str = ""
    leftovers: list = field(default_factory=list)  # what the test left on this rank (testing/leftovers.py)


@dataclass
class TestJob:
    path: str
    module: str
    cls: str | None
    function: str
    kwargs: dict[str, Any]
    timeout: float
    trace_dir: str | None = None


class PoolRanks:
    """The pool's RankSource (supervise/watch.py) for one test: its rank processes, and the outcomes they send
    back (``finished()`` collects them into ``outcomes``; a rank that died is one too)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.outcomes: dict[int, PoolOutcome] = {}

    def finished(self) -> set[int]:
        outcomes = self.outcomes
        for rank, conn in enumerate(self.pool.conns):
            if rank in outcomes:
                continue
            if self.pool.procs[rank].poll() is not None:
                code = self.pool.procs[rank].returncode
                outcomes[rank] = PoolOutcome(rank, "died", f"rank {rank} exited with code {code} "
                                             f"(signal {-code})" if code < 0 else f"rank {rank} exited "
                                             f"with code {code}")
            elif conn.poll(0):
                try:
                    outcomes[rank] = conn.recv()
                except EOFError:
                    continue
        return set(outcomes)

    def live(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.pool.procs) if r not in self.outcomes and p.poll() is None}

    def failed(self) -> bool:
        """Some rank failed the test (or died): the others get the failure grace."""
        return any(o.status not in ("passed", "skipped") for o in self.outcomes.values())


@dataclass
class Pool:
    world_size: int
    backend: str
    devices: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    workdir: str = ""
    healthy: bool = True
    generation: int = 0
    _store: Any = None
    _listener: Listener | None = None

    def job_dir(self) -> str:
        """A fresh directory for one test's traces and stack dumps."""
        self.generation += 1
        path = Path(self.workdir) / f"test-{self.generation}"
        path.mkdir()
        return str(path)

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs)}

    def start(self, sys_path: list[str]) -> None:
        import torch.distributed as dist

        # Here, not at the top: the ranks import this module (pool_worker) for its job records, and a rank loads
        # no supervisor code (tests/unit/test_layout.py).
        from distcheck.supervise.zygote import start_process

        self.workdir = tempfile.mkdtemp(prefix="distcheck-pool-")
        # The store lives in this (the pytest) process: port 0 = a free port chosen by the OS.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True,
                                    wait_for_workers=False)
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        for rank in range(self.world_size):
            env = dict(os.environ)
            env.update({
                "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self._store.port), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                env_names.POOL_BACKEND: self.backend, env_names.POOL_AUTH: authkey.hex(),
                env_names.POOL_ADDR: f"{host}:{port}", env_names.POOL_DIR: self.workdir,
                ENV_TAG: f"{authkey.hex()[:16]}-{rank}",  # found by it: whatever a test starts on this rank
                "PYTHONPATH": os.pathsep.join(p for p in sys_path if p),
            })
            if self.devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
            env.pop("PYTEST_XDIST_WORKER", None)
            # Its own session (a group kill takes its DataLoader workers too), and SIGKILL when this process dies:
            # a pytest ended by SIGTERM or SIGINT leaves no rank behind. Forked by a zygote when DISTCHECK_ZYGOTE
            # asks for one: a pool retired by a failing test then restarts without importing torch again.
            self.procs.append(start_process(["-m", "distcheck.testing.pool_worker"], env, new_session=True))
        self._listener._listener._socket.settimeout(START_TIMEOUT)  # accept() must not block forever
        conns: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT
        while len(conns) < self.world_size:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close()
                raise RuntimeError("the rank processes of the distributed test pool did not start "
                                   f"(exit codes {[p.poll() for p in self.procs]})")
            conn = self._listener.accept()
            rank = conn.recv()
            conns[rank] = conn
        self.conns = [conns[r] for r in range(self.world_size)]
        for rank, conn in enumerate(self.conns):
            if not conn.poll(START_TIMEOUT) or conn.recv() != "ready":
                self.close()
                raise RuntimeError(f"rank {rank} of the distributed test pool failed to join the process group")

    def run(self, job: TestJob, should_stop: Callable[[set[int]], str | None] | None = None,
            ) -> tuple[list[PoolOutcome], bool, str | None]:
        """Run one test on every rank. Returns the outcomes and whether it hung (the pool is then retired).

        ``should_stop(finished_ranks)`` is asked about once a second after STOP_AFTER seconds: a reason means the
        ranks provably cannot progress (e.g. they wait in different collectives), so the test is a hang now
        rather than at its timeout.
        """
        from distcheck.supervise.watch import DONE, WatchLoop

        self._stderr_offsets = {r: self._stderr_size(r) for r in range(self.world_size)}
        for conn in self.conns:
            conn.send(job)
        source = PoolRanks(self)
        outcomes = source.outcomes
        # The marker's timeout is a no-progress limit, like --timeout: a test that keeps issuing collectives is
        # not cut off. After one rank fails, the others often wait in a collective that will never complete.
        loop = WatchLoop(job.trace_dir or self.workdir, job.timeout, source=source,
                         expected=self.world_size, should_stop=should_stop, startup_timeout=job.timeout,
                         stop_grace=STOP_AFTER, failure_grace=FAILURE_GRACE, failed=source.failed, poll=0.02)
        result = loop.run()
        hung = result.state != DONE
        for rank in range(self.world_size):
            if rank not in outcomes:
                outcomes[rank] = PoolOutcome(rank, "hung", "")
        if not hung and job.trace_dir and all(o.status == "passed" for o in outcomes.values()):
            self._out_of_step(job.trace_dir, outcomes)
        if hung or any(o.status != "passed" and o.status != "skipped" for o in outcomes.values()):
            self.healthy = False
        return [outcomes[r] for r in range(self.world_size)], hung, result.stop_reason

    @staticmethod
    def _out_of_step(trace_dir: str, outcomes: dict[int, PoolOutcome]) -> None:
        """Every rank passed, but some issued more collectives on a group than its peers: the next test's
        collectives would pair with these. The ranks that issued them fail the test (testing/leftovers.py)."""
        from distcheck.testing.leftovers import out_of_step, rank_text

        try:
            extra = out_of_step(trace_dir)
        except Exception as exc:  # noqa: BLE001 - unreadable traces: the ranks' own outcomes stand
            log.debug("cannot compare the ranks' collective counts: %s", exc)
            return
        for rank, items in extra.items():
            if rank in outcomes:
                outcomes[rank] = PoolOutcome(rank, "failed", rank_text(items), items)

    def _stderr_size(self, rank: int) -> int:
        from distcheck.contract import files

        try:
            return files.rank_file(self.workdir, "stderr", rank).stat().st_size
        except OSError:
            return 0

    def stderr_tail(self, rank: int) -> list[str]:
        """The last lines this rank wrote to stderr during the current test."""
        from distcheck.contract import files
        from distcheck.contract.stderr_file import tail

        since = getattr(self, "_stderr_offsets", {}).get(rank, 0)
        return tail(files.rank_file(self.workdir, "stderr", rank), since=since)

    def dump_stacks(self) -> dict[int, str]:
        """Every rank's Python stacks, via faulthandler on SIGUSR1: a C-level handler, so it works even when a
        rank is stuck in native code holding the GIL, and needs no ptrace permission."""
        paths = {r: Path(self.workdir) / f"stacks-rank{r}.txt" for r in range(self.world_size)}
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        out = {}
        for rank, path in paths.items():
            try:
                out[rank] = path.read_text()
            except OSError:
                out[rank] = "(no stack: the process had exited)"
        return out

    def close(self) -> None:
        from distcheck.processes import terminate

        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + (2.0 if self.healthy else 0.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Each rank leads its own session: the group kill also ends its DataLoader workers.
        terminate([p.pid for p in self.procs if p.poll() is None], grace=0.5, group=True)
        for proc in self.procs:
            proc.wait(timeout=10)
        for conn in self.conns:
            conn.close()
        if self._listener is not None:
            self._listener.close()
        self.procs, self.conns = [], []
        if self.healthy and self.workdir:
            # Traces of passed tests are of no use; a failed test's message points into the directory: keep it.
            shutil.rmtree(self.workdir, ignore_errors=True)
