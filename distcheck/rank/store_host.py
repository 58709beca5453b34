"""The rendezvous store of ``run --nproc N`` / ``compare``, hosted by a process forked from rank 0.

    python -m distcheck run --nproc 2 -- train.py   # the launcher hands rank 0 the store's socket and a lifeline

torchrun's agent hosts the TCPStore the ranks rendezvous through (``TORCHELASTIC_USE_AGENT_STORE``), so it outlives
every rank. Our launcher keeps that protocol, but hosting the store itself would mean importing torch in the
launcher: a second of CPU per run that the ranks, starting at the same moment, wait for on a small machine.
Instead the launcher binds the port and passes two descriptors to rank 0: the listening socket and the read end of
a pipe whose write end only the launcher holds. Rank 0, which imports torch anyway, forks before anything else
(single-threaded: no lock can be held in the copy) and the child serves the store on that socket until the pipe
reaches end-of-file, i.e. until the launcher closes it after the run or dies. The store therefore lives exactly as
long as the launcher's run, whatever happens to rank 0, as under torchrun.
"""
from __future__ import annotations

import os
import signal

from distcheck.contract import env

ENV_STORE_FDS = env.STORE_FDS  # "<listening socket fd>,<lifeline read fd>", set for rank 0 only


def host_if_asked() -> None:
    """In rank 0 of a launcher that asked for it: fork the store host. A no-op elsewhere."""
    spec = os.environ.pop(ENV_STORE_FDS, None)
    if not spec:
        return
    listen_fd, lifeline = (int(x) for x in spec.split(","))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    pid = os.fork()
    if pid == 0:
        _serve(listen_fd, lifeline, world_size)  # never returns
    os.close(listen_fd)
    os.close(lifeline)


def detach() -> None:
    """In a store host just forked from rank 0 (this one, and rank/exchange_host.py's): out of rank 0's process
    group (a signal to the rank's group is not for the store), the stop signals' default actions back, and the
    console let go (its pipes close when the launcher or torchrun ends, not when this process does)."""
    os.setpgid(0, 0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def _serve(listen_fd: int, lifeline: int, world_size: int) -> None:
    code = 1
    try:
        detach()
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world_size, True,
                              timedelta(seconds=3600), wait_for_workers=False, master_listen_fd=listen_fd)
        while os.read(lifeline, 1):  # blocks until the launcher closes its end (or dies)
            pass
        del store
        code = 0
    finally:
        os._exit(code)
