"""The processes a supervisor watches: the ranks below a torchrun agent, what each rank started (``RunTree``), so
that none outlives the run and a hang dump can reach each one. Built on distcheck/processes.py (the /proc
primitives every distcheck process shares).

    python -m distcheck stacks 12345        # resolves a torchrun agent's pid to its rank processes (rank_descendants)
    python -m distcheck run --nproc 2 -- train.py   # the launcher tracks and ends each rank's tree with RunTree

Only pids distcheck started, that descend from a rank, or that carry the run's tag (``RUN_ID_ENV``), or that the
user named are ever signalled: never a process found by its name.
"""
from __future__ import annotations

import os
import time
from typing import Iterable

from distcheck.processes import (
    STDERR_COPY, alive, children_map, descendants, read_environ, reap, role_of, start_ticks, tagged, terminate,
)


def rank_descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """The topmost descendants of ``pid`` that have RANK in their environment: torchrun's workers.

    The search stops at a rank: its own children (DataLoader workers) inherit RANK but are not ranks.
    """
    children = children_map() if children is None else children
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        try:
            env = read_environ(child)
        except OSError:
            env = {}
        if "RANK" in env and alive(child):
            found.append(child)
        else:
            stack.extend(children.get(child, []))
    return sorted(found)


def rank_processes(rank_pids: dict[int, int]) -> dict[int, int]:
    """``{pid: rank}`` of the processes the ranks started (and their children) that are the user's: distcheck's
    own (a stderr copy, the node watcher) are left out."""
    found = descendants({pid: rank for rank, pid in rank_pids.items()})
    return {pid: rank for pid, rank in found.items() if role_of(pid) is None}


class RunTree:
    """Every process of one run other than its ranks: what the ranks start (DataLoader workers, helpers, a script's
    own ``mp.spawn`` workers) and their children, and distcheck's per-rank processes (stderr copies).

    Found three ways, because no single one sees every process: the tree below each live rank (``observe``, called
    from the watch loop; every rank is a child subreaper, so its orphaned grandchildren stay below it); the run's
    tag in /proc/PID/environ (what a rank execs carries it, also once orphaned or in a session of its own); and,
    for a launcher that is a subreaper, the orphans it adopted since the run started. ``end`` ends them all.
    """

    def __init__(self, run_id: str | None, keep: Iterable[int] = (), adopt_since: int | None = None) -> None:
        self.run_id = run_id
        self.keep = set(keep) | {os.getpid()}  # never these: the ranks, the launcher, its zygote
        self.adopt_since = adopt_since  # start ticks: this process's children started since are the run's orphans
        self.known: dict[int, tuple[int, int | None]] = {}  # pid -> (rank, start ticks)
        self._last = float("-inf")

    def observe(self, rank_pids: dict[int, int], every: float = 1.0) -> None:
        """Remember the descendants of the live ranks (at most once per ``every`` seconds: a /proc scan costs a few
        ms): a rank that dies takes its tree's shape along, and its orphans go to init."""
        now = time.monotonic()
        if now - self._last < every:
            return
        self._last = now
        for pid, rank in descendants({pid: rank for rank, pid in rank_pids.items()}).items():
            if pid not in self.known:
                self.known[pid] = (rank, start_ticks(pid))

    def leftovers(self) -> dict[int, str | None]:
        """``{pid: role}`` of every live process of the run (role: ROLE_ENV, None for the user's)."""
        found: dict[int, str | None] = {}
        for pid, (_, ticks) in list(self.known.items()):
            if alive(pid) and start_ticks(pid) == ticks:
                found[pid] = role_of(pid)
        if self.run_id:
            found.update(tagged(self.run_id))
        if self.adopt_since is not None:
            for pid in children_map().get(os.getpid(), []):
                ticks = start_ticks(pid)
                if pid not in self.keep and ticks is not None and ticks >= self.adopt_since and alive(pid):
                    found.setdefault(pid, role_of(pid))
        for pid in self.keep:
            found.pop(pid, None)
        return found

    def end(self, grace: float = 1.0, drain: float = 5.0) -> list[int]:
        """End every process of the run: the user's first (SIGTERM, SIGKILL after ``grace``; again for what they
        started meanwhile), then distcheck's stderr copies, which end by themselves once no writer of their pipe is
        left and get ``drain`` seconds to copy what is still in it. Returns the pids that had to be ended."""
        ended: list[int] = []
        for attempt in range(3):
            left = self.leftovers()
            users = [pid for pid, role in left.items() if role != STDERR_COPY]
            if not users:
                break
            terminate(users, grace=grace if attempt == 0 else 0.2)
            ended.extend(users)
            reap(users)
        copies = [pid for pid, role in self.leftovers().items() if role == STDERR_COPY]
        deadline = time.monotonic() + drain
        while time.monotonic() < deadline and any(alive(p) for p in copies):
            time.sleep(0.02)
        stuck = [pid for pid in copies if alive(pid)]
        if stuck:
            terminate(stuck, grace=0.0)
            ended.extend(stuck)
        reap(copies)
        if self.adopt_since is not None:  # orphans that ended by themselves (rank 0's store host): no zombies
            reap(pid for pid in children_map().get(os.getpid(), [])
                 if pid not in self.keep and (start_ticks(pid) or -1) >= self.adopt_since)
        return ended
