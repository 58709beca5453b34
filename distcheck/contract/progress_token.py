"""Whether the ranks move: each rank's progress token, read from its files between two polls. The one reader of it.

    from distcheck.contract.progress_token import ProgressTokens
    tokens = ProgressTokens("report/", ranks=[0, 1])
    before = tokens.sizes(); ...; moved = tokens.sizes() != before

distcheck models a rank's progress twice, on purpose, and only twice:

* *where* it is (its last started, last completed and pending collective, per group): analysis/progress.RankProgress,
  computed from the rank's whole trace when a report or a diagnosis needs it;
* *whether* it moves: this token, a number that grows whenever the rank starts a collective, completes its
  latest one, writes a trace line, or its process group completes one the tracer does not see (DDP's buckets).
  The watch loop (supervise/watch.py) compares it at every poll, 10 times a second, and the node exchange sends
  it to the other nodes (supervise/node_exchange.NodeLink): a read or two per rank (the hint remembers where the
  last poll found the end of the records), where RankProgress would parse every trace at every poll.

``-1``: the rank has not opened its trace yet (it still imports torch): the start-up allowance applies to it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from distcheck.contract import files, trace_slots


class ProgressTokens:
    """The tokens of ``ranks`` (None: whichever ranks have a trace in the directory; a node watcher does not
    know the global ranks), polled by one caller: each instance keeps its own read positions."""

    def __init__(self, report_dir: str | os.PathLike, ranks: Iterable[int] | None = None) -> None:
        self.report_dir = Path(report_dir)
        self.ranks = sorted(ranks) if ranks is not None else None
        self._up: set[int] = set()  # positions whose trace existed once: those ranks are past their start
        # Per rank, where the last poll found the end of its records: a poll reads past it only (a 20,000-collective
        # trace costs a read or two per rank and poll, not a search of the file).
        self._hints: dict[int, dict[str, int]] = {}

    def token(self, rank: int) -> int:
        return files.trace_progress(self.report_dir, rank, self._hints.setdefault(rank, {}))

    def sizes(self) -> tuple[int, ...]:
        """Every rank's token, in rank order (without a rank list: those of the traces there, -1 left out)."""
        if self.ranks is None:
            sizes = (self.token(r) for r in files.rank_files(self.report_dir, "trace"))
            return tuple(s for s in sizes if s >= 0)  # a trace removed since the listing does not count
        if not self.report_dir.is_dir():
            # The report directory was removed or replaced under the run: no trace will appear, so no rank is
            # "still starting" any more and the normal no-progress limit applies.
            self._up.update(range(len(self.ranks)))
        out = []
        for i, r in enumerate(self.ranks):
            out.append(self.token(r))
            if out[-1] >= 0:
                self._up.add(i)
        return tuple(out)

    def starting(self, sizes: tuple[int, ...]) -> bool:
        """Some rank has not opened its trace yet (a trace that vanished later does not count: the report
        directory was removed under the run, and the normal limit applies). Without the list of ranks (the node
        watcher): no rank has opened its trace yet."""
        if self.ranks is None:
            if sizes:
                self._up.add(-1)
            return not sizes and -1 not in self._up
        return any(s < 0 and i not in self._up for i, s in enumerate(sizes))

    def has_trace(self, rank: int) -> bool:
        """The rank runs the script (its trace is open), past its imports."""
        return files.trace_progress(self.report_dir, rank) >= 0

    def none_completed(self) -> bool:
        """Start-up: no rank has completed a collective yet (each imports, builds, joins the process group), by
        its records and by torch's ring (DDP's buckets), read without loading whole traces."""
        for rank in files.rank_files(self.report_dir, "trace"):
            if files.flight_progress(self.report_dir, rank) > 0:
                return False
            try:  # the records alone, not the 3 MiB segment of zeros they start: this runs at every poll
                records = trace_slots.read_records(files.rank_file(self.report_dir, "trace_events", rank))
            except OSError:
                continue
            if any(r.t_end is not None for r in trace_slots.iter_slots(records)):
                return False
        return True
