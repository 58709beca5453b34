"""``watcher-<host>.json``: the node watcher's state. Local rank 0 writes its first one as it starts the watcher
(rank/bootstrap.py: the watcher's imports take a second or more); from then on the one writer is the watcher
(supervise/node_watcher.py), which rewrites it whole as it goes; the readers are the node's ranks
(rank/bootstrap.py, rank/entry.py).

    torchrun --nproc-per-node 2 --max-restarts 1 -m distcheck run -- train.py

Under torchrun a node has one watcher for the lifetime of its agent: local rank 0 of the first attempt starts it,
and a restarted attempt's ranks find it here instead of starting another. The file says which process it is (pid
and start time, so that a reused pid is not taken for it), whose agent it serves, the attempt it watches, and the
last attempt whose watch is over, with its exit code (the report's, on the node that writes the report) and the
ranks it saw. A restarted rank moves the earlier attempt's files aside only once that attempt is reported; local rank 0 takes its
exit code from here once its own attempt is.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distcheck.contract import atomic_file, files

NAME = files.WATCHER
NOT_YET = -1  # ``reported`` before the first attempt's watch is over


@dataclass
class WatcherState:
    pid: int
    ticks: int | None  # the process's start time (/proc/<pid>/stat): with the pid, which process this is
    agent: str  # the torchrun agent it serves (processes.launcher_id)
    watching: int  # the attempt (TORCHELASTIC_RESTART_COUNT) it watches now
    reported: int = NOT_YET  # the last attempt whose watch is over
    code: int | None = None  # that attempt's exit code
    ranks: list[int] = field(default_factory=list)  # the pids of that attempt's ranks the watch saw
    # Several nodes: the ranks whose end this node's own report (node-<host>/) already holds, in attempt
    # ``covered_attempt``. A rank that failed waits (bounded) until it is covered before it exits, so that the
    # report exists when torchrun returns, even if the watcher is killed then (rank/entry.py).
    covered: list[int] = field(default_factory=list)
    covered_attempt: int = NOT_YET
    # The last attempt whose exchange is in place (every node's watcher on node 0's exchange store, which outlives
    # torchrun's agents; or given up): what a node sends after its torchrun ended still reaches node 0.
    exchange_attempt: int = NOT_YET

    def covers(self, attempt: int, rank: int) -> bool:
        return self.covered_attempt == attempt and rank in self.covered and self.exchange_attempt >= attempt

    def done_with(self, attempt: int, pid: int | None = None) -> bool:
        """Whether the watch of ``attempt`` is over; with ``pid``, the watch of that rank's attempt (after a change
        of membership torchrun starts new ranks under the same count)."""
        return self.reported > attempt or self.reported == attempt and (pid is None or not self.ranks
                                                                        or pid in self.ranks)


def path(report_dir: str | os.PathLike, host: str | None = None) -> Path:
    return Path(report_dir) / NAME.format(host=host or socket.gethostname())


def write(report_dir: str | os.PathLike, state: WatcherState) -> None:
    """Whole or not at all (a reader never sees half a file). Raises OSError: a full report disk."""
    atomic_file.write_text(path(report_dir), json.dumps(asdict(state)))


def read(report_dir: str | os.PathLike, host: str | None = None) -> WatcherState | None:
    """The state of this host's watcher, or None when there is none (or the file is not one)."""
    try:
        data = json.loads(path(report_dir, host).read_text())
        return WatcherState(int(data["pid"]), None if data.get("ticks") is None else int(data["ticks"]),
                            str(data["agent"]), int(data["watching"]), int(data.get("reported", NOT_YET)),
                            None if data.get("code") is None else int(data["code"]),
                            [int(pid) for pid in data.get("ranks") or []],
                            [int(r) for r in data.get("covered") or []], int(data.get("covered_attempt", NOT_YET)),
                            int(data.get("exchange_attempt", NOT_YET)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def remove(report_dir: str | os.PathLike) -> None:
    path(report_dir).unlink(missing_ok=True)
