"""Node 0's exchange store on several nodes: torch's TCPStore, served by a process forked from global rank 0.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m distcheck run -- train.py   # rank 0 forks it first thing

The node watchers send each other what the job's report needs (supervise/node_exchange.py). torchrun's rendezvous
store ends with the agent that hosts it, often before another node has sent what its crashed rank said, so the
exchange has a store of its own that lives as long as node 0's watcher: this process. Rank 0 imports torch anyway
and forks it before anything else (single-threaded: no lock can be held in the copy, as rank/store_host.py does),
so the store is up within milliseconds of rank 0's start; hosting it in the watcher cost that watcher ``import
torch`` (3.4 s on a 2-core VM), longer than a job that fails at its first collective lives. It serves while node 0's
watcher runs (its state file names it, contract/watcher_file.py; an earlier attempt's watcher serves a restarted
one), at most WAIT_FOR_WATCHER seconds without one, and the watcher's end of the attempt ends it too
(supervise/procs.RunTree: it is a process rank 0 started). It writes its port to ``exchange-<host>-<attempt>.json``
(contract/exchange_file.py) once it listens.
"""
from __future__ import annotations

import os

WAIT_FOR_WATCHER = 60.0  # seconds it serves before node 0's watcher is known (local rank 0 starts it)
GONE_GRACE = 1.0  # seconds it outlives the watcher it served


def fork_if_node0(report_dir: str | os.PathLike) -> int | None:
    """In global rank 0 of a job on several nodes under torchrun (call before any thread starts): fork the host;
    its pid. A no-op elsewhere."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        rank = int(os.environ.get("RANK", "-1"))
    except ValueError:
        return None
    if rank != 0 or world <= local or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from distcheck.processes import restart_count

    from distcheck.contract import exchange_file

    attempt = restart_count()
    exchange_file.remove(report_dir, attempt)  # an earlier job's, in a reused report dir
    pid = os.fork()
    if pid == 0:
        _serve(str(report_dir), attempt)  # never returns
    from distcheck.rank.runtime import keep_process

    keep_process(pid)  # not one of the script's processes: it ends with node 0's watcher
    return pid


def _serve(report_dir: str, attempt: int) -> None:
    code = 1
    try:
        from distcheck.rank.store_host import detach

        detach()
        from datetime import timedelta

        import torch.distributed as dist

        from distcheck.contract import exchange_file

        store = dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        exchange_file.write(report_dir, attempt, store.port, os.getpid())
        _while_watched(report_dir)
        exchange_file.remove(report_dir, attempt)
        del store
        code = 0
    finally:
        os._exit(code)


def _while_watched(report_dir: str, poll: float = 0.2) -> None:
    """Return once node 0's watcher has been gone for GONE_GRACE seconds, or none came within WAIT_FOR_WATCHER."""
    import time

    from distcheck.contract import watcher_file
    from distcheck.processes import alive, start_ticks

    began = last_seen = time.monotonic()
    seen = False
    while True:
        state = watcher_file.read(report_dir)
        now = time.monotonic()
        if state is not None and alive(state.pid) and start_ticks(state.pid) == state.ticks:
            seen, last_seen = True, now
        elif seen and now - last_seen >= GONE_GRACE or not seen and now - began >= WAIT_FOR_WATCHER:
            return
        time.sleep(poll)
