"""Under torchrun, rank 0's report writer for ``run``: a thread in each rank, since torchrun has no distcheck
supervisor to build the report.

    torchrun --nproc-per-node 2 -m distcheck run --timeout 60 -- train.py

Rank 0's thread runs the one watch loop (supervise/watch.py) over every rank's trace: once every rank has
finished, died or provably cannot progress, it builds and writes the report (supervise/run_report.py) and drops
a marker file. The thread in the other ranks ends its rank once the marker appears while the script is still
stuck in it. The node watcher (supervise/node_watcher.py), a process outside the ranks, diagnoses a hang at
``--timeout`` with every rank's stack; this loop's own hang limit is the backstop for when it cannot.

On several nodes the other nodes' traces are on those nodes: how their ranks ended and how far they got comes
from node 0's watcher, which mirrors what they sent through torchrun's store (supervise/node_exchange.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from distcheck.analysis.trace_align import provably_stuck
from distcheck.analysis.trace_events import RankTrace, load_traces
from distcheck.options import RunOptions, backstop
from distcheck.supervise import run_report
from distcheck.processes import agent_pid, alive
from distcheck.supervise.watch import HUNG, STARTUP_TIMEOUT, STOPPED, WatchLoop

log = logging.getLogger("distcheck")


class TorchrunMonitor(threading.Thread):
    def __init__(self, rank: int, world_size: int, report_dir: Path, opts: RunOptions, done_marker: Path,
                 main_done: threading.Event, exit_rank: Callable[[int], None]) -> None:
        super().__init__(name="distcheck-run-monitor", daemon=True)
        self.rank, self.world_size, self.report_dir, self.opts = rank, world_size, report_dir, opts
        self.done_marker, self.main_done = done_marker, main_done
        # How this rank ends at once (rank/runtime.hard_exit: its processes first), passed in by the rank: this
        # thread runs in rank 0 but is supervisor code, which imports nothing of rank/.
        self.exit_rank = exit_rank
        self.exit_code = 1
        self.started_at = time.monotonic()
        self._cache: tuple[tuple, dict[int, RankTrace]] | None = None
        first = int(os.environ.get("RANK", rank)) - int(os.environ.get("LOCAL_RANK", 0))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        # This node's ranks; the others' files are on their nodes (multi-node: LOCAL_WORLD_SIZE < WORLD_SIZE).
        self.local_ranks = set(range(first, first + local)) if local < world_size else set(range(world_size))
        self.multi_node = local < world_size
        self._mirror_cache: tuple[tuple, object] | None = None

    def run(self) -> None:
        try:
            if self.rank == 0:
                self._finalize()
            else:
                self._follow()
        except Exception:  # the monitor must never be what breaks the run
            log.exception("distcheck run monitor failed")
            if self.rank == 0 and not self.main_done.is_set():
                self.exit_rank(1)

    def _follow(self) -> None:
        while not self.main_done.is_set():
            if self.done_marker.exists():
                # Rank 0 wrote the report while our script is still inside it: stuck on a collective.
                time.sleep(0.5)
                if not self.main_done.is_set():
                    self.exit_rank(1)
            time.sleep(0.2)

    def _traces(self) -> dict[int, RankTrace]:
        # This thread runs inside rank 0 while it trains and asks several times a poll: re-read the traces only
        # when one of them grew.
        from distcheck.contract import files

        key = tuple((rank, files.trace_progress(self.report_dir, rank))
                    for rank in files.rank_files(self.report_dir, "trace"))
        if self._cache is None or self._cache[0] != key:
            # A reused report dir may still hold a trace of an earlier run from a rank that has not started yet:
            # only the ranks of this torchrun (same agent) count.
            ppid = agent_pid()
            self._cache = (key, {r: t for r, t in load_traces(self.report_dir).items()
                                 if r < self.world_size and t.meta.get("ppid", ppid) == ppid})
        return self._cache[1]

    def _running(self, traces: dict[int, RankTrace]) -> dict[int, int]:
        """Ranks whose trace has no exit line and whose process (same node: pid from the trace) still runs; on
        several nodes also the other nodes' ranks not known to have ended."""
        out = {}
        for r, t in traces.items():
            pid = t.meta.get("pid")
            if t.finished is None and _pid_alive(pid):
                out[r] = pid if isinstance(pid, int) else 0
        if self.multi_node:
            ended = self._remote_ended()
            for r in range(self.world_size):
                trace = traces.get(r)
                if r in self.local_ranks or r in ended or (trace is not None and trace.finished is not None):
                    continue  # a report dir all nodes share holds the others' exit lines, mirror or not
                out[r] = 0  # another node's rank not known to have ended (its pid means nothing here)
        return out

    def _finished(self) -> set[int]:
        traces = self._traces()
        running = self._running(traces)
        done = {r for r in traces if r not in running}
        if self.multi_node:
            done |= self._remote_ended()
        return done

    def _stuck(self, done: set[int]) -> str | None:
        # Only this node's finished ranks can prove a wait hopeless from the traces here; the other nodes' ranks
        # prove it from what their nodes sent (their exit states and per-group counts).
        traces = self._traces()
        why = provably_stuck(traces, done & self.local_ranks)
        mirror = self._mirror()
        if why is None and mirror is not None:
            from distcheck.analysis.progress import progress_by_rank
            from distcheck.supervise.node_exchange import merge_summaries, stuck_on_remote

            size = len(self.local_ranks)
            merged = merge_summaries(mirror.summaries, mirror.nodes, lambda n: list(range(n * size, (n + 1) * size)),
                                     False)
            why = stuck_on_remote(progress_by_rank(traces), mirror.states(), merged.progress)
        return why

    def _mirror(self):
        """Node 0's watcher's copy of the other nodes' summaries, re-read only when it was rewritten (this runs in
        rank 0, several times a poll)."""
        from distcheck.supervise.node_exchange import mirror_path, read_mirror

        if not self.multi_node:
            return None
        path = mirror_path(self.report_dir)
        try:
            st = path.stat()
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._mirror_cache is None or self._mirror_cache[0] != key:
            self._mirror_cache = (key, read_mirror(path))
        return self._mirror_cache[1]

    def _remote_ended(self) -> set[int]:
        from distcheck.supervise.node_exchange import RUNNING

        mirror = self._mirror()
        if mirror is None:
            return set()
        return {r for r, s in mirror.states().items() if s.state != RUNNING and r not in self.local_ranks}

    def _finalize(self) -> None:
        timeout = self.opts.timeout
        while True:
            loop = WatchLoop(self.report_dir, backstop(timeout), expected=self.world_size,
                             live=lambda: self._running(self._traces()), finished=self._finished,
                             should_stop=self._stuck,
                             startup_timeout=max(backstop(timeout), STARTUP_TIMEOUT), poll=0.2,
                             ranks=sorted(self.local_ranks))
            result = loop.run()
            mirror = self._mirror()
            if (result.state == HUNG and mirror is not None
                    and time.time() - mirror.progressed_at < backstop(timeout)):
                continue  # this node is idle, another node's ranks still progress
            break
        traces = self._traces()
        if stopped_from_outside(self.report_dir, traces):
            # torchrun passed a stop signal on: the node watcher, outside the ranks, reports it with every stack.
            self.exit_rank(1)
        running = set(self._running(traces))
        outcomes = run_report.outcomes_from_traces(traces, self.world_size, result.state == HUNG, running)
        remote = None
        if self.multi_node:
            from distcheck.supervise.node_exchange import merge_summaries

            mirror = self._mirror()
            if mirror is not None:
                local_size = len(self.local_ranks)
                remote = merge_summaries(mirror.summaries, mirror.nodes,
                                         lambda n: list(range(n * local_size, (n + 1) * local_size)),
                                         result.state == HUNG)
                outcomes.update(remote.outcomes)
                remote.silent.clear()  # not gathered with a deadline: the node watcher names a silent node
        report = run_report.build_report(self.report_dir, self.opts.command, self.world_size, traces, outcomes,
                                         timeout, time.monotonic() - self.started_at,
                                         stop_reason=result.stop_reason if result.state == STOPPED else None,
                                         remote=remote)
        if remote is not None:
            import socket

            from distcheck.supervise.node_exchange import NodeEnv, nodes_json

            env = NodeEnv.from_env(os.environ, socket.gethostname())
            if env is not None:
                report.data["nodes"] = nodes_json(remote, env, str(self.report_dir.resolve()))
        self.exit_code = run_report.publish(report, self.report_dir)
        if self.multi_node:
            self._tell_other_nodes()
        self.done_marker.write_text("done\n")
        if not self.main_done.is_set():
            time.sleep(0.5)  # let the other ranks see the marker
            self.exit_rank(self.exit_code)


    def _tell_other_nodes(self) -> None:
        """Where the report is, for the other nodes' watchers to print: from here, before this rank ends, since
        torchrun's store ends with this node's agent right after (one store call, bounded)."""
        import socket

        from distcheck.supervise.node_exchange import NodeEnv, StoreChannel

        env = NodeEnv.from_env(os.environ, socket.gethostname())
        channel = StoreChannel.connect(env, timeout=2.0) if env is not None else None
        if channel is not None:
            channel.publish_report(env.host, str(self.report_dir.resolve() / "report.txt"))
            channel.await_report_seen(env.nnodes - 1, time.monotonic() + 3.0)


def stopped_from_outside(report_dir: Path, traces: dict[int, RankTrace]) -> bool:
    """Whether a rank that did not finish its script dumped its stacks on a stop signal (rank/stack_hooks.py)."""
    from distcheck.contract import stack_dump_file

    for texts in stack_dump_file.stop_dumps(report_dir).values():
        for rank in texts:
            trace = traces.get(rank)
            if trace is None or trace.finished is None:
                return True
    return False


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return True  # no pid in the trace: assume it runs, the hang limit bounds the wait
    return alive(pid)  # a zombie (the agent has not reaped it yet, or a killed rank's thread lingers) has ended
