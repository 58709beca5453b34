"""Rank/world info, backend choice, process-group start/stop with bounded timeouts, and the side channel.

The side channel is the rendezvous key-value store (torchrun's agent store, or our own): every exchange distcheck
needs for itself (fingerprints, env snapshots, findings, verdicts) goes through it with a timeout, so it keeps
working when the process group is broken, stays out of the user's collective traces, and a dead rank turns into
a ChannelTimeout naming it instead of a hang.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from distcheck.contract import env
from distcheck.errors import ChannelTimeout

log = logging.getLogger("distcheck")

DEFAULT_TIMEOUT = 300.0
POLL_MAX = 0.02  # seconds between store checks while waiting for other ranks
READ_WAIT = 10.0  # seconds rank 0 waits at most, after an exchange, for the others to have read it (SideChannel)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    hostname: str
    launched: bool  # True when a launcher (torchrun, distcheck, Slurm wrapper) set RANK/WORLD_SIZE

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> RankInfo:
        launched = "WORLD_SIZE" in env and "RANK" in env

        def num(key: str, default: int) -> int:
            try:
                return int(env.get(key, default))
            except ValueError:
                return default

        return cls(
            rank=num("RANK", 0),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=num("LOCAL_WORLD_SIZE", 1),
            node_rank=num("GROUP_RANK", 0),
            hostname=socket.gethostname(),
            launched=launched,
        )


def pick_device(info: RankInfo) -> tuple[str, torch.device]:
    """nccl and one CUDA device per local rank when CUDA is there, else gloo on the CPU.

    DISTCHECK_BACKEND=gloo forces the CPU path on a GPU machine (useful to rule out NCCL itself).
    """
    forced = os.environ.get(env.BACKEND, "").strip().lower()
    if forced != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = info.local_rank % torch.cuda.device_count()
        return "nccl", torch.device("cuda", index)
    return "gloo", torch.device("cpu")


def setup_logging(info: RankInfo) -> None:
    level = os.environ.get(env.LOG, "WARNING").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[distcheck rank {info.rank}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(getattr(logging, level, logging.WARNING))
    log.propagate = False


class SideChannel:
    """All-to-all exchange of small Python objects through the store, each bounded by a timeout."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float = DEFAULT_TIMEOUT,
                 rank0_hosts_store: bool | None = None):
        self.store = dist.PrefixStore("distcheck", store)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._counters: dict[str, int] = {}
        self.pending: tuple[str, list[str], list[int]] | None = None
        # Whether rank 0's own process serves the store: init_process_group's env:// rendezvous outside torchrun's
        # agent store and distcheck's launcher (which set TORCHELASTIC_USE_AGENT_STORE): mp.spawn, MASTER_ADDR and
        # MASTER_PORT set by hand. Then a rank 0 that ends right after an exchange takes the store with it while the
        # others still read their answers ("Connection reset by peer" in multi_get): see _hold_until_read.
        if rank0_hosts_store is None:
            rank0_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)  # as torch reads it
        self.rank0_hosts_store = rank0_hosts_store

    def _next_key(self, tag: str, ranks: Sequence[int]) -> str:
        scope = tag if len(ranks) == self.world_size else f"{tag}@{','.join(map(str, ranks))}"
        n = self._counters.get(scope, 0) + 1
        self._counters[scope] = n
        return f"{scope}#{n}"

    def exchange(self, tag: str, obj: Any, ranks: Sequence[int] | None = None,
                 timeout: float | None = None) -> list[Any]:
        """Every rank in ``ranks`` (default: all) publishes ``obj``; returns the objects in ``ranks`` order.

        All participating ranks must call exchange with the same tag the same number of times.
        """
        ranks = list(range(self.world_size)) if ranks is None else sorted(ranks)
        base = self._next_key(tag, ranks)
        self.store.set(f"{base}/{self.rank}", pickle.dumps(obj))
        keys = [f"{base}/{r}" for r in ranks]
        self._wait(tag, keys, ranks, timeout)
        values = [pickle.loads(v) for v in self.store.multi_get(keys)]
        if self.rank0_hosts_store and 0 in ranks and len(ranks) > 1:
            self._hold_until_read(base, ranks)
        return values

    def _hold_until_read(self, base: str, ranks: list[int]) -> None:
        """Where rank 0 serves the store: the other ranks say they have read the exchange, and rank 0 returns only
        then (at most READ_WAIT seconds: a rank that died after publishing must not hold it), so that a script that
        ends right after (``check_model`` then ``destroy_process_group``) cannot end the store under a reader."""
        if self.rank != 0:
            try:
                self.store.set(f"{base}/read/{self.rank}", b"1")
            except Exception:  # rank 0 gave up waiting and left: this rank has its answer already
                pass
            return
        self._poll([f"{base}/read/{r}" for r in ranks if r != 0], time.monotonic() + min(self.timeout, READ_WAIT))

    def peek(self, key: str) -> Any:
        """A p2p value if it is there already, else None; never waits."""
        full = f"p2p/{key}"
        return pickle.loads(self.store.get(full)) if self._has(full) else None

    def put(self, key: str, obj: Any) -> None:
        self.store.set(f"p2p/{key}", pickle.dumps(obj))

    def get(self, key: str, owner: int, timeout: float | None = None) -> Any:
        full = f"p2p/{key}"
        self._wait(key, [full], [owner], timeout)
        return pickle.loads(self.store.get(full))

    def _wait(self, tag: str, keys: list[str], ranks: list[int], timeout: float | None) -> None:
        seconds = self.timeout if timeout is None else timeout
        self.pending = (tag, keys, ranks)
        if not self._poll(keys, time.monotonic() + seconds):
            raise ChannelTimeout(tag, self.missing() or list(ranks), seconds)
        self.pending = None

    def _poll(self, keys: list[str], deadline: float) -> bool:
        """Whether every key is in the store before ``deadline``. Polls with check() rather than one long wait(): a
        Python signal handler (SIGTERM from torchrun when another rank died) only runs between calls, and it is
        what lets this rank still write what it knows."""
        pause = 0.0005
        while not self._has_all(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX)
        return True

    def missing(self) -> list[int]:
        """Ranks that have not yet published their part of the exchange this rank is waiting in."""
        if self.pending is None:
            return []
        _, keys, ranks = self.pending
        return [r for r, k in zip(ranks, keys) if not self._has(k)]

    def _has_all(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except Exception:
            return False

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:
            return False


@dataclass
class Session:
    info: RankInfo
    backend: str
    device: torch.device
    channel: SideChannel
    timeout: float
    owns_group: bool  # False when the user's script initialized the process group itself

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size


def start(timeout: float = DEFAULT_TIMEOUT) -> Session:
    """Initialize the default process group (if not already) and the side channel.

    Without a launcher this is a 1-rank world on a private in-memory store, so every command also runs as
    plain ``python -m distcheck ...``.
    """
    info = RankInfo.from_env()
    setup_logging(info)
    backend, device = pick_device(info)
    owns = not dist.is_initialized()
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        pg_timeout = timedelta(seconds=timeout)
        if info.launched:
            dist.init_process_group(backend, timeout=pg_timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
    else:
        backend = dist.get_backend()
    info = RankInfo(dist.get_rank(), dist.get_world_size(), info.local_rank, info.local_world_size,
                    info.node_rank, info.hostname, info.launched)
    global _current
    _current = Session(info, backend, device, default_channel(timeout), timeout, owns)
    return _current


_current: Session | None = None
_channel: SideChannel | None = None


def default_channel(timeout: float = DEFAULT_TIMEOUT) -> SideChannel:
    """The side channel over the default process group's store; one per process so exchange counters agree."""
    global _channel
    if _channel is None:
        store = dist.distributed_c10d._get_default_store()
        _channel = SideChannel(store, dist.get_rank(), dist.get_world_size(), timeout)
    _channel.timeout = timeout
    return _channel


def current_channel() -> SideChannel | None:
    """The side channel of this process, or None when torch.distributed is not initialized."""
    if not dist.is_initialized():
        return None
    return _current.channel if _current is not None else default_channel()


def stop(session: Session, timeout: float = 30.0) -> None:
    """Destroy the process group we created, without letting a dead peer block the exit."""
    if not session.owns_group or not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # teardown after a failed peer is best effort
            log.debug("destroy_process_group failed: %s", exc)
        done.set()

    global _current, _channel
    _current = _channel = None
    thread = threading.Thread(target=destroy, name="distcheck-teardown", daemon=True)
    thread.start()
    if not done.wait(timeout):
        log.warning("process group teardown did not finish within %ss; exiting anyway", timeout)


def bounded(collective: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> None:
    """Run a torch.distributed collective with async_op=True and wait at most ``timeout`` seconds.

    distcheck's own collectives go through here, so a peer that never arrives raises instead of hanging.
    """
    work = collective(*args, async_op=True, **kwargs)
    if work is not None:
        work.wait(timeout=timedelta(seconds=timeout))


def end_rank(code: int) -> None:
    """End a rank whose script has returned: the script's atexit handlers run (they are the user's), then the
    process exits without torch's C++ teardown, which can abort (SIGABRT) after a correct script."""
    import atexit

    try:
        atexit._run_exitfuncs()
    except Exception:  # an atexit handler's error is printed by atexit itself; the exit code stays ours
        pass
    hard_exit(code)


def hard_exit(code: int) -> None:
    """After a failure the process group may hold threads blocked on dead peers: exit without joining them. What
    the rank started (helpers, DataLoader workers) ends first: nothing outlives its rank (end_processes)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    end_processes()
    os._exit(code)


_keep: set[int] = set()  # distcheck's own children of this rank that must outlive it (rank 0's store host)


def keep_process(pid: int) -> None:
    """A child of this rank that end_processes leaves alone (it ends by itself, after the rank)."""
    _keep.add(pid)


def end_processes(grace: float = 1.0) -> None:
    """End every process this rank started, and their children, except distcheck's own: a helper a correct script
    leaves running (or a DataLoader worker, a script's own subprocess) would otherwise outlive the run and hold its
    output open, so ``distcheck ... | tail`` or a CI step capturing the output would wait for it. The rank is a
    child subreaper (rank/bootstrap.py), so its orphaned grandchildren are found too."""
    import signal

    try:
        # torch's DataLoader turns a worker's death by a signal into an error raised in the main thread (its
        # SIGCHLD handler): these deaths are ours, at the end.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread: the main thread is stuck in the script anyway
        pass
    try:
        from distcheck.rank.stderr_tee import copier_pid
        from distcheck.processes import end_descendants

        end_descendants(_keep | {p for p in (copier_pid(),) if p}, grace=grace)
    except Exception as exc:  # the exit must happen whatever the sweep meets
        log.debug("could not end this rank's processes: %s", exc)
