"""The per-node watcher for jobs that distcheck did not launch (``consistency``, ``run`` under torchrun).

    torchrun --nproc-per-node 2 -m distcheck consistency --timeout 60     # local rank 0 starts one per node
    python -m distcheck.supervise.node_watcher --report-dir DIR --timeout 60 --parent PID   (internal)

Under plain torchrun there is no distcheck supervisor, and a thread inside a rank would starve when that rank
holds the GIL in native code. So local rank 0 starts this small process (distcheck/rank/bootstrap.py). It finds
the node's ranks from the ``stackhook-pid*.json`` files they write, runs the one watch loop over their traces,
and on a hang dumps them, writes the report and ends them (torchrun then ends the other nodes). The ranks name
their parent (torchrun's agent) as ptracer, and the watcher is a descendant of it, so the dump works under Yama
ptrace_scope=1. It ends by itself once the node's ranks have ended, and ends what they left on this node first:
the processes they started that still run (a helper in a session of its own, a stuck DataLoader worker), found
by the ranks' process trees as it watched them and by the run's id in their environment (supervise/procs.RunTree),
so that nothing of the job holds its console open after torchrun exits.

Whatever ends the watch (a hang, a stop signal, the ranks ending by themselves, rank 0 dying before its own report,
node 0 gone), the report takes one path: what the watch found goes into one typed record, composed into the report
by pure functions and published by one writer (supervise/node_report.py); this module is the watch flow only.

On several nodes (``torchrun --nnodes N``) each node's watcher reads only its node's files and exchanges summaries
with the others through torchrun's rendezvous store (supervise/node_exchange.py): the node of global rank 0 writes
the job's one report into its report dir, the others print one line saying where it is, and each node's own
stacks stay on it in ``node-<host>/``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from distcheck.contract import files, stack_dump_file, stack_hook_file, watcher_file
from distcheck.contract.findings import Finding, Note, format_ranks
from distcheck.contract.progress_token import ProgressTokens
from distcheck.contract.site import file_line
from distcheck.contract.watcher_file import WatcherState
from distcheck.processes import (RUN_ID_ENV, alive, launcher_id, read_environ, restart_count,
                                 restarts_left, start_ticks, terminate, torchrun_run_id)
from distcheck.supervise.live_stragglers import LiveStragglers
from distcheck.supervise.node_report import (ENDED, HANG, NODE, NODE0_GONE, RANK0_DIED, STOPPED, Evidence, Nodes,
                                             compare_nodes, compose, deliver, job_hang, remote_findings,
                                             written_since)
from distcheck.supervise.procs import RunTree
from distcheck.supervise.watch import HUNG, STARTUP_TIMEOUT, HangDump, WatchLoop, script_ended, script_passed

if TYPE_CHECKING:
    from distcheck.contract.node_summary import NodeSummary
    from distcheck.supervise.node_exchange import MergedNodes, NodeEnv, NodeLink, StoreChannel

log = logging.getLogger("distcheck")


def _cancel_when_orphaned(parent: int, seen: set[int], cancel: threading.Event) -> None:
    """Set ``cancel`` (from a thread of its own) when the rank that started this watcher died before any rank
    registered: there is nothing to watch."""

    def watch() -> None:
        began = time.monotonic()
        while not cancel.wait(0.5):
            if parent and not alive(parent) and not seen and time.monotonic() - began > 2.0:
                cancel.set()

    threading.Thread(target=watch, daemon=True).start()


class NodeRanks:
    """The node watcher's RankSource (supervise/watch.py): this node's ranks of one torchrun attempt.

    ``live()``: ``{rank: pid}`` from the hook files; every ask also feeds the run's process tree and ``seen``
    (every rank ever found), and a change is logged. ``script_end_ends``: a rank whose script ended (its exit line)
    no longer runs, though its process may (under ``run``, local rank 0 waits for the report after its script).

    ``finished()``: the ranks seen that no longer run. A rank can end before this watcher first looks (a short
    script on a slow start): each of ``traced`` (the ranks this node expects, or None) whose trace says it ran
    under this torchrun agent counts as seen. With ``exchange`` (several nodes: this node's NodeEnv and
    StoreChannel), each change of the ranks that ended their script (their exit line; a failed one waits for the
    report) or their process is published to the other nodes, unless this node writes the report."""

    def __init__(self, report_dir: str | os.PathLike, host: str | None, tree: RunTree, seen: set[int],
                 attempt: Attempt, script_end_ends: bool = False, *, agent: int | None = None,
                 traced: Sequence[int] | None = None,
                 exchange: tuple[NodeEnv, StoreChannel] | None = None) -> None:
        self.report_dir, self.host, self.tree, self.seen, self.attempt = report_dir, host, tree, seen, attempt
        self.script_end_ends = script_end_ends
        self.agent, self.traced, self.exchange = agent, traced, exchange
        self.last: dict[int, int] = {}
        self.published: frozenset[int] = frozenset()  # the ended ranks last published to the other nodes
        # several nodes: writes this node's own report for the ranks still running, returns its summary
        self.own_report: Callable[[set[int], bool], NodeSummary | None] | None = None
        self.deferred = False  # node 0: the failed ranks are covered once the job's report is written

    def live(self) -> dict[int, int]:
        ranks = local_ranks(self.report_dir, self.host, self.attempt.number)
        self.tree.observe(ranks)
        self.seen.update(ranks)
        self.attempt.pids.update(ranks.values())
        if ranks != self.last:
            log.info("ranks running on this node: %s", ranks)
            self.last = ranks
        if self.script_end_ends:
            return {r: pid for r, pid in ranks.items() if not script_ended(self.report_dir, r)}
        return ranks

    def finished(self) -> set[int]:
        running = self.live()
        if self.traced is not None:
            self.seen.update(r for r in self.traced
                             if r not in self.seen and _traced_under(self.report_dir, r, self.agent))
        done = self.seen - set(running)
        if self.exchange is not None:
            self._post(done, running)
        return done

    def _post(self, done: set[int], running: dict[int, int]) -> None:
        """Each change of this node's ended ranks: its own report (node-<host>/) is rewritten from its ranks' files
        first, then its summary goes to node 0, so that node 0's report learns how this node's ranks ended, not
        only that their files are elsewhere. A failed rank waits for the first (rank/entry.py)."""
        env, channel = self.exchange
        ended = frozenset(done | {r for r in running if script_ended(self.report_dir, r)})
        if ended == self.published:
            return
        newly, self.published = ended - self.published, ended
        if self.own_report is None:
            return
        if not any(not script_passed(self.report_dir, r) for r in newly):
            # Ranks whose script passed wait for nothing: the node's report comes once the watch is over (a
            # rewrite per rank would read every rank's trace again, seconds on a node of 8 long traces).
            _cover(self.report_dir, self.attempt.number, ended)
            return
        still = {r for r in running if r not in ended}
        # Never final here: the final summary, with the stop dumps of the ranks torchrun then stopped, comes once
        # the watch is over.
        summary = self.own_report(still, False)
        if summary is not None and not env.reports:
            channel.send_summary(summary)
        if env.reports and not still and self._others_final(env, channel):
            # Node 0, every other node's last summary in: the job's report comes next, and the failed ranks wait
            # for it instead (the end of the watch covers them), so that it exists when torchrun returns.
            self.deferred = True
            return
        _cover(self.report_dir, self.attempt.number, ended)

    @staticmethod
    def _others_final(env: NodeEnv, channel: StoreChannel) -> bool:
        """Whether every other node's ranks have ended, as their last summaries say (the final ones follow)."""
        from distcheck.contract.node_summary import RUNNING

        others = [n for n in range(env.nnodes) if n != env.node]
        got = channel.summaries(others)
        return all(n in got and (got[n].final or all(st.state != RUNNING for st in got[n].states.values()))
                   for n in others)


def local_ranks(report_dir: str | os.PathLike, host: str | None = None, attempt: int | None = None) -> dict[int, int]:
    """``{rank: pid}`` of this node's live ranks of torchrun's ``attempt`` (``--max-restarts``; by default this
    process's), from the hook files written by distcheck/rank/bootstrap.py.

    A stale hook file from an earlier job in the same directory is ignored: its pid is dead, or now belongs to a
    process whose RANK differs. So is a rank of another attempt.
    """
    host = host or socket.gethostname()
    out: dict[int, int] = {}
    attempt = restart_count() if attempt is None else attempt
    for hook in stack_hook_file.read_all(report_dir):
        pid, rank = hook.pid, hook.rank
        if (hook.host or host) != host or not alive(pid):
            continue
        try:
            environ = read_environ(pid)  # a zygote-forked rank's shows the zygote's: the hook names the attempt
            if int(environ.get("RANK", rank)) != rank or restart_count(hook.launch or environ) != attempt:
                continue
        except (OSError, ValueError):
            continue
        out[rank] = pid
    return out


@dataclass
class Attempt:
    """One torchrun attempt (``--max-restarts``), as the node's watcher sees it: its number
    (TORCHELASTIC_RESTART_COUNT), the environment torchrun gave its ranks (a change of membership can change the
    world between attempts), and the run id its ranks tag their processes with."""
    number: int
    environ: Mapping[str, str]
    run_id: str | None
    pids: set[int] = field(default_factory=set)  # its ranks' processes, as the watch saw them

    @property
    def world_size(self) -> int | None:
        return _int(self.environ.get("WORLD_SIZE"))

    @property
    def local_world_size(self) -> int | None:
        return _int(self.environ.get("LOCAL_WORLD_SIZE"))

    @property
    def restarts_left(self) -> bool:
        return restarts_left(dict(self.environ))


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def serve(report_dir: str, timeout: float, native: bool = False, parent: int = 0, world_size: int | None = None,
          local_world_size: int | None = None, agent: int | None = None, command: str | None = None) -> int:
    """The watcher's life: one per node for the lifetime of torchrun's agent. It watches the attempt it was started
    in; while torchrun may restart the ranks (``--max-restarts``) it then waits for the next attempt's ranks and
    watches them too, and ends when the agent does. Its state (contract/watcher_file.py) tells the ranks which
    attempt's watch is over and its exit code. Its own exit code is the last attempt's."""
    agent = agent or _parent_of(parent)
    environ = dict(os.environ)
    for name, value in (("WORLD_SIZE", world_size), ("LOCAL_WORLD_SIZE", local_world_size)):
        if value:
            environ[name] = str(value)
    attempt = Attempt(restart_count(), environ, os.environ.get(RUN_ID_ENV))
    me = os.getpid()
    global _STATE
    state = _STATE = WatcherState(me, start_ticks(me), launcher_id(agent) if agent else "", attempt.number)
    desk = None
    if command is None:  # consistency's rank 0 hands its report over to be published here, beside this watch's own
        from distcheck.supervise.report_desk import ReportDesk

        desk = ReportDesk(report_dir).start()
    try:
        return _serve_attempts(report_dir, timeout, native, parent, attempt, agent, command, state)
    finally:
        if desk is not None:  # its thread is a daemon: what it is publishing now must not end with this process
            desk.stop()


def _serve_attempts(report_dir: str, timeout: float, native: bool, parent: int, attempt: Attempt, agent: int | None,
                    command: str | None, state: WatcherState) -> int:
    while True:
        _write_state(report_dir, state)
        code = watch(report_dir, timeout, native, parent, attempt, agent, command)
        state.reported, state.code, state.ranks = attempt.number, code, sorted(attempt.pids)
        _write_state(report_dir, state)
        following = next_attempt(report_dir, agent, attempt) if attempt.restarts_left and agent else None
        if following is None:
            return code
        log.info("attempt %d of torchrun's ranks started%s: watching it", following.number,
                 " (the same count: a change of membership)" if following.number == attempt.number else "")
        attempt, parent = following, 0
        state.watching = attempt.number


_STATE: WatcherState | None = None  # this watcher's state, as serve() keeps it


_STATE_LOCK = threading.Lock()  # the watch and the exchange's thread both rewrite the state


def _cover(report_dir: str | os.PathLike, attempt: int, ranks: Iterable[int]) -> None:
    """This node's own report now holds the end of ``ranks``: the failed ones among them may exit."""
    if _STATE is not None:
        _STATE.covered, _STATE.covered_attempt = sorted(ranks), attempt
        _write_state(str(report_dir), _STATE)


def _exchange_ready(report_dir: str | os.PathLike, attempt: int) -> None:
    """The exchange of ``attempt`` is in place (or given up): a failed rank no longer waits for it."""
    if _STATE is not None and _STATE.exchange_attempt < attempt:
        _STATE.exchange_attempt = attempt
        _write_state(str(report_dir), _STATE)


def _write_state(report_dir: str, state: WatcherState) -> None:
    try:
        with _STATE_LOCK:
            watcher_file.write(report_dir, state)
    except OSError as exc:  # a full report disk: the ranks then wait for this process itself (rank/entry.py)
        log.warning("could not write the watcher's state: %s", exc)


def next_attempt(report_dir: str, agent: int, after: Attempt, poll: float = 0.1) -> Attempt | None:
    """The next attempt torchrun starts on this node, or None once the agent has ended (the job is over). Its ranks'
    hook files name a later restart count, or the same one from new processes: torchrun restarts the ranks without
    counting a restart when a node joins (``--nnodes 1:2``)."""
    host = socket.gethostname()
    while alive(agent):
        for hook in stack_hook_file.read_all(report_dir):
            if hook.agent != agent or (hook.host or host) != host or not alive(hook.pid):
                continue
            number = restart_count(hook.launch)
            if number > after.number or number == after.number and hook.pid not in after.pids:
                # The ranks' run id is in no file: each computes it from its agent and attempt, as this does.
                return Attempt(number, hook.launch, torchrun_run_id(number, agent))
        time.sleep(poll)
    return None


def watch(report_dir: str, timeout: float, native: bool, parent: int, attempt: Attempt, agent: int | None = None,
          command: str | None = None) -> int:
    """Watch one attempt of the node's ranks until they end, and publish what that found. ``command``: the
    ``distcheck run`` command line when this watcher writes the run's report (one node: the ranks only write
    files, and end as they would without distcheck); None for ``consistency``, whose rank 0 composes its own
    report and hands it to this watcher's desk (supervise/report_desk.py)."""
    tree = RunTree(attempt.run_id)
    try:
        return _watch(report_dir, timeout, native, parent, attempt, tree, agent, command)
    finally:
        ended = tree.end()  # whatever the ranks left on this node, then their stderr copies once drained
        if ended:
            log.info("ended %d processes the ranks left running: %s", len(ended), ended)


def _watch(report_dir: str, timeout: float, native: bool, parent: int, attempt: Attempt, tree: RunTree,
           agent: int | None = None, command: str | None = None) -> int:
    host = socket.gethostname()
    world_size, local_world_size = attempt.world_size, attempt.local_world_size
    multi_node = bool(world_size and local_world_size and world_size > local_world_size)
    if multi_node:
        from distcheck.supervise.node_exchange import NodeEnv, StoreChannel

        env = NodeEnv.from_env(attempt.environ, host)
        channel = StoreChannel.connect(env) if env is not None else None
        if env is not None and channel is not None:
            log.info("node %d of %d (ranks %s), exchanging through the store at %s:%d", env.node, env.nnodes,
                     format_ranks(env.ranks), env.store_host, env.store_port)
            return _watch_nodes(report_dir, timeout, native, parent, env, channel, tree, attempt, agent, command)
        # No store to reach: this node's own report, as before the exchange (the stacks stay named by host).
    out_dir = Path(report_dir) / f"node-{host}" if multi_node else Path(report_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    # This watcher writes the run's report: the run is over once every rank ended its script (its exit line: local
    # rank 0 waits for this report after its own) or its process, seen or not (a short script can end before the
    # first look).
    writes_run = command is not None and bool(world_size) and not multi_node
    agent = agent or _parent_of(parent)
    expected = world_size if writes_run else None
    source = NodeRanks(report_dir, host, tree, seen, attempt, script_end_ends=writes_run, agent=agent,
                       traced=range(expected) if expected is not None else None)
    cancel = threading.Event()

    _cancel_when_orphaned(parent, seen, cancel)
    started = time.monotonic()
    started_wall = time.time()
    # Traces and hooks are read from the (possibly shared) report dir; this node's stacks and report go to out_dir.
    # Before any rank opened its trace the ranks are still importing torch (seconds each on a loaded machine):
    # the start-up limit, not --timeout, applies to them.
    loop = WatchLoop(report_dir, timeout, source=source, expected=expected, ranks=None,
                     startup_timeout=max(timeout, STARTUP_TIMEOUT), dump=HangDump(native, world_size, out_dir),
                     poll=0.1, cancel=cancel, stragglers=LiveStragglers(report_dir))
    result = loop.run()
    cancel.set()
    if command is None:
        _publish_offers(report_dir)

    def evidence(ending: str, world: int | None = None, **found) -> Evidence:
        return Evidence(ending, Path(report_dir), out_dir, world or world_size or len(seen), timeout,
                        time.monotonic() - started, started_wall, **found)

    if result.state == HUNG:
        pids = local_ranks(report_dir, host, attempt.number)
        try:
            deliver(compose(evidence(HANG, world=world_size or len(pids), note=f"no progress for {timeout:g}s",
                                     findings=result.hang_findings,
                                     check_seconds=(result.diagnosed_at or 0) - (result.declared_at or 0))))
        finally:  # whatever the report met, the hung ranks end: a watcher that died here left the job hung
            terminate(list(pids.values()), grace=2.0)
        files.tidy(report_dir)
        return 1
    stop = StopEnding.of(diagnose_stop(report_dir, out_dir, native, world_size))
    if stop.stopped is not None:  # torchrun passed a stop signal on to the ranks: they dumped their stacks and died
        deliver(compose(evidence(STOPPED, note=stop.note, findings=stop.findings, warnings=stop.warnings,
                                 command=command, running=stop.ranks)))
        files.tidy(report_dir)
        return 1
    if expected is not None:  # the run's report: every rank ended by itself
        code = deliver(compose(evidence(ENDED, world=expected, command=command, agent=agent)))
        files.tidy(report_dir)
        return code
    rank0_here = 0 in seen or _traced_under(report_dir, 0, agent)  # a rank 0 that died before this watch's first look
    if rank0_here and not written_since(out_dir, started_wall):
        # Rank 0 died before it could write the report (SIGKILLed, or stopped by torchrun after another rank
        # died): the run's report, from the ranks' files, so that the death is still named.
        deliver(compose(evidence(RANK0_DIED, note="rank 0 ended before writing the report", running=set())))
        files.tidy(report_dir)
        return 1
    return 0


def _watch_nodes(report_dir: str, timeout: float, native: bool, parent: int, env: NodeEnv, channel: StoreChannel,
                 tree: RunTree, attempt: Attempt, agent: int | None = None, command: str | None = None) -> int:
    """One node of several: watch this node's ranks, exchange summaries through torchrun's store
    (supervise/node_exchange.py); node 0 writes the job's one report, the others print where it is.

    ``command`` (``distcheck run``): node 0's watcher writes the run's report once every node's ranks ended their
    scripts, from its own ranks' files and the other nodes' final summaries; its exit code is the verdict. Each
    node's local rank 0 waits for its watcher after its script, so a script-ended rank counts as ended here."""
    from distcheck.supervise.node_exchange import ExchangeHost, NodeLink, summarize_node, wait_for_report, where_line

    host = env.host
    out_dir = Path(report_dir) / f"node-{host}"  # this node's own report and artifacts (its stacks), named by host
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    cancel = threading.Event()
    link = NodeLink(env, channel, report_dir, ProgressTokens(report_dir, env.ranks).sizes,
                    cancel, on_exchange=lambda: _exchange_ready(report_dir, attempt.number))
    if env.reports:  # node 0's own store for the exchange, which outlives torchrun's agents (rank 0 forked it)
        link.host = ExchangeHost(report_dir, attempt.number)
    agent = agent or _parent_of(parent)
    source = NodeRanks(report_dir, host, tree, seen, attempt, script_end_ends=command is not None, agent=agent,
                       traced=env.ranks, exchange=(env, channel))
    _cancel_when_orphaned(parent, seen, cancel)
    link.start()
    started = time.monotonic()
    started_wall = time.time()
    ended_by_rank = threading.Event()

    def own_report(running: set[int], final: bool, findings: Sequence[Finding] = (), warnings: Sequence[Note] = (),
                   note: str | None = None, stopped: Iterable[int] = ()) -> NodeSummary | None:
        """This node's own report from its ranks' files alone, then the summary it sends (and keeps beside it)."""
        return write_own_report(env, report_dir, out_dir, timeout, time.monotonic() - started, started_wall, running,
                                final, command, findings, warnings, note, stopped)

    if command is not None:
        source.own_report = own_report
    threading.Thread(target=_warm_imports, daemon=True).start()

    def on_term(signum, frame) -> None:  # consistency ends its watcher once the run is over (SIGTERM)
        ended_by_rank.set()
        cancel.set()

    signal.signal(signal.SIGTERM, on_term)
    stragglers = LiveStragglers(report_dir)  # one for the whole watch: its streaks outlive each loop below
    try:
        limit = timeout
        while True:
            # No dump inside the loop: a node whose ranks are idle while another node's progress (a pipeline
            # stage waiting for its input) is not hung; the job is hung once no node progressed for `timeout`.
            result = WatchLoop(report_dir, limit, source=source, expected=None, ranks=None,
                               startup_timeout=limit, dump=None, poll=0.2, cancel=cancel,
                               stragglers=stragglers).run()
            idle = link.job_idle()
            if result.state == HUNG and link.remote_hang is None and idle < timeout - link.poll:
                log.info("no progress on this node, but another node progressed %.1fs ago: watching on",
                         time.monotonic() - link.others_progressed)
                limit = max(timeout - idle, 2 * link.poll)
                continue
            break
        if ended_by_rank.is_set() and link.remote_hang is None:
            # The command is over and its rank 0 wrote the report: say where, within the rank's grace (5 s).
            if env.reports:
                if written_since(Path(report_dir), started_wall):
                    channel.post_report_path(host, str(Path(report_dir).resolve() / files.REPORT_TXT))
                    channel.await_report_seen(env.nnodes - 1, time.monotonic() + 2.0)
            else:
                location = wait_for_report(channel, link, time.monotonic() + 3.0)
                if location is not None:
                    _say(where_line(location, 3.0))
            return 0
        hung = result.state == HUNG or link.remote_hang is not None
        log.info("the watch of this node's ranks ended (%s)", "hung" if hung else "ranks ended")
        if command is None:
            _publish_offers(report_dir)

        def evidence(ending: str, out: Path = out_dir, **found) -> Evidence:
            return Evidence(ending, Path(report_dir), out, env.world_size, timeout, time.monotonic() - started,
                            started_wall, **found)

        if hung:
            if link.remote_hang is None:
                channel.announce_hang(env.node, host)
            pids = local_ranks(report_dir, host, attempt.number)
            try:
                _report_hang(pids, env, channel, link, report_dir, out_dir, native, timeout, attempt.number, evidence)
            finally:  # whatever the report met, the hung ranks end: a watcher that died here left the job hung
                terminate(list(pids.values()), grace=2.0)
            files.tidy(report_dir)
            return 1
        stop = StopEnding.of(diagnose_stop(report_dir, out_dir, native, env.world_size, local_only=True))
        stopped, findings, warnings, note = stop.stopped, stop.findings, stop.warnings, stop.note
        stopped_ranks = stop.ranks
        # Every rank of this node has ended: cut their trace records' unwritten tails before reading them, or a
        # record file still at its preallocated size reads as a big job's, whose traces are only summarized.
        files.tidy(report_dir)
        rank0_died = command is None and env.reports and 0 in seen and not written_since(Path(report_dir),
                                                                                           started_wall)
        if command is None and env.reports and stopped is None and not rank0_died:
            if written_since(Path(report_dir), started_wall):  # consistency's rank 0 wrote the job's report
                channel.post_report_path(host, str(Path(report_dir).resolve() / files.REPORT_TXT))
            return 0
        # This node's own report first, from its ranks' files alone (node-<host>/), before any exchange: what the
        # node knows survives a failed exchange, and a watcher killed right after torchrun exits.
        summary = (own_report(set(), True, findings, warnings, note, stopped_ranks)
                   if command is not None or stopped else None)
        if summary is None:
            summary = summarize_node(env, report_dir, set(), final=True, digests=True)
        if not env.reports:
            channel.send_summary(summary)
            location = _serve_node0(channel, link, env, report_dir, agent)
            _say(where_line(location, 0.0, env, gone=channel.broken, own=out_dir / files.REPORT_TXT
                            if (out_dir / files.REPORT_JSON).exists() else None))
            return 1 if stopped is not None else 0
        if rank0_died:
            note = "rank 0 ended before writing the report"
        ending = STOPPED if stopped is not None else (RANK0_DIED if rank0_died else ENDED)
        code = _deliver_job_report(evidence(ending, Path(report_dir), command=command, note=note, findings=findings,
                                            warnings=warnings, running=stopped_ranks), env, channel, native,
                                   attempt.number, agent, summary, source.deferred)
        return 1 if stopped is not None or rank0_died else code
    finally:
        link.stop.set()
        cancel.set()
        if not env.reports:
            channel.say_bye(env.node)
        if source.deferred:
            _cover(report_dir, attempt.number, env.ranks)


def _publish_offers(report_dir: str) -> None:
    """The report a rank handed over just before it ended (consistency's rank 0, SIGKILLed right after offering
    what completed), published now, before this watch decides how the run ended from what report.json holds: the
    desk's thread may not have polled since."""
    from distcheck.supervise.report_desk import take

    try:
        take(report_dir)
    except Exception:
        log.exception("publishing a handed report")


def _warm_imports() -> None:
    """What composing a report imports, loaded while the ranks run: a failed rank waits for its node's report."""
    try:
        import numpy  # noqa: F401  (the trace slots' reader; 0.5 s here, cold)
        import numpy.ma  # noqa: F401  (np.unique's first call imports it)

        import distcheck.analysis.collective_digests  # noqa: F401
        import distcheck.supervise.run_report  # noqa: F401
    except Exception:
        pass


def write_own_report(env: NodeEnv, report_dir: str | os.PathLike, out_dir: Path, timeout: float, seconds: float,
                     started_wall: float, running: set[int], final: bool, command: str | None,
                     findings: Sequence[Finding] = (), warnings: Sequence[Note] = (),
                     note: str | None = None, stopped: Iterable[int] = ()) -> NodeSummary | None:
    """This node's own report (out_dir = node-<host>/) and its summary (node-<host>/summary.json), both from its
    ranks' files; the summary. Never raises: a report that cannot be written costs the report, not the watch."""
    from distcheck.contract import node_summary
    from distcheck.supervise.node_exchange import summarize_node

    try:
        pub = compose(Evidence(NODE, Path(report_dir), out_dir, env.world_size, timeout, seconds, started_wall,
                               note=note, findings=list(findings), warnings=list(warnings), running=set(running),
                               local_ranks=set(env.ranks), command=command, stopped=set(stopped)))
        deliver(pub)
        own = [f for f in pub.report.findings if f.kind not in ("rank_failure", "hang")]
        summary = summarize_node(env, report_dir, set(running), final=final, findings=own + list(findings),
                                 digests=final, stopped=stopped)
        node_summary.write(out_dir, summary)
        return summary
    except Exception:
        log.exception("this node's own report failed")
        return None


def _serve_node0(channel: StoreChannel, link: NodeLink, env: NodeEnv, report_dir: str, agent: int | None,
                 poll: float = 0.05) -> str | None:
    """Another node than node 0, its ranks ended and its summary sent: answer node 0's questions (the signatures
    of a window where the digests differ) until node 0 says where its report is. Bounded: torchrun's agents wait
    for each other at exit (300 s), and once this node's agent has ended, AFTER_AGENT seconds more."""
    from distcheck.supervise.node_exchange import AFTER_AGENT, window_answer

    deadline = time.monotonic() + 300.0
    agent_gone: float | None = None
    answered = False
    while True:
        found = link.report or channel.report_location()
        if found:
            return found
        if not answered:
            asks = channel.asked(env.node)
            if asks is not None:
                channel.answer_windows(env.node, window_answer(report_dir, asks, env.ranks))
                answered = True
        now = time.monotonic()
        if agent_gone is None and agent and not alive(agent):
            agent_gone = now
        if channel.broken or now >= deadline or agent_gone is not None and now - agent_gone >= AFTER_AGENT:
            return None
        time.sleep(poll)


def _report_hang(pids: Mapping[int, int], env: NodeEnv, channel: StoreChannel, link: NodeLink, report_dir: str,
                 out_dir: Path, native: bool, timeout: float, attempt: int, evidence: Callable[..., Evidence]) -> None:
    """One node of several, hung: dump this node's ranks, send the summary; node 0 writes the job's report, the
    others wait for its location (or write their own once node 0 is gone)."""
    from distcheck.supervise.hang import diagnose_hang
    from distcheck.supervise.node_exchange import GATHER_TIMEOUT, summarize_node, wait_for_report, where_line

    findings = diagnose_hang(pids, report_dir, native=native, timeout=timeout, world_size=env.world_size,
                             out_dir=out_dir)
    channel.send_summary(summarize_node(env, report_dir, set(pids), hung=True, stacks_path=out_dir / files.STACKS_JSON))
    note = f"no progress for {timeout:g}s"
    if env.reports:
        _deliver_job_report(evidence(HANG, Path(report_dir), note=note), env, channel, native, attempt)
        return
    waited = GATHER_TIMEOUT + 15.0
    location = wait_for_report(channel, link, time.monotonic() + waited)
    if location is None:  # node 0 is gone: this node's report, with what it knows
        _say(where_line(location, waited, env, gone=channel.broken))
        deliver(compose(evidence(NODE0_GONE, note=note, findings=findings, local_ranks=set(env.ranks))))
    else:
        _say(where_line(location, waited))


def _parent_of(pid: int) -> int | None:
    """The parent of local rank 0: torchrun's agent on this node (its ranks' traces name it as their ppid)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _traced_under(report_dir: str, rank: int, agent: int | None) -> bool:
    """Whether the rank's trace (its first line, the meta record) comes from a rank of this torchrun agent."""
    try:
        with open(files.rank_file(report_dir, "trace", rank), "rb") as fh:
            meta = json.loads(fh.readline() or b"{}")
    except (OSError, ValueError):
        return False
    return agent is not None and meta.get("ppid") == agent


def _say(line: str) -> None:
    sys.stderr.write(line)
    sys.stderr.flush()


def _deliver_job_report(evidence: Evidence, env: NodeEnv, channel: StoreChannel, native: bool, attempt: int,
                        agent: int | None = None, own: NodeSummary | None = None, deferred: bool = False) -> int:
    """Node 0's report of the whole job: gather every other node's summary through the store (with a deadline,
    and no longer than AFTER_AGENT once node 0's torchrun agent has ended), compare the nodes' collectives by their
    digests, diagnose a hang once from every node's stacks, compose and publish the report, then tell the other
    nodes where it is. ``deferred``: this node's failed ranks wait for this report (NodeRanks.deferred). Its exit
    code."""
    from distcheck.supervise.node_exchange import AFTER_AGENT, GATHER_TIMEOUT, merge_summaries

    others = [n for n in range(env.nnodes) if n != env.node]
    began = time.monotonic()
    stop = _after_agent(agent, AFTER_AGENT)
    if deferred:
        # Every node's ranks had ended when this node's last rank did, and that rank waits for this report: the
        # other nodes' final summaries (their stop dumps, digests) get a second, not the agent's lifetime.
        stop = _either(stop, _after(time.monotonic() + 1.0))
    log.info("gathering the other nodes' summaries (torchrun's agent: %s)", agent)
    got = channel.gather(others, began + GATHER_TIMEOUT, ready=lambda s: s.final or (s.hung and s.stacks is not None
                                                                                    or s.hung and bool(s.note)),
                         stop=stop)
    waited = time.monotonic() - began
    merged = merge_summaries(got, others, env.node_ranks, evidence.hung)
    log.info("summaries from %d of %d other nodes after %.1fs", len(got), len(others), waited)
    if evidence.hung:
        evidence.findings = [job_hang(evidence, env, merged, native)]
        evidence.running = set(local_ranks(evidence.report_dir, env.host, attempt))
    elif evidence.running is None:
        evidence.running = set()
    if not evidence.hung and any(o.state in ("error", "died") for o in merged.outcomes.values()):
        # A rank of another node failed: torchrun stopping this node's ranks then is its consequence (its agent
        # lost the rendezvous), where they were is a warning.
        for f in [f for f in evidence.findings if f.detail.get("stopped_by")]:
            evidence.findings.remove(f)
            evidence.warnings.append(as_warning(f))
    if own is not None and not evidence.hung:
        evidence.findings += compare_nodes(env, {env.node: own, **got},
                                           lambda asks: _ask_nodes(env, channel, evidence.report_dir, asks, stop,
                                                                   1.0 if deferred else 2.0))
        evidence.findings += remote_findings(got, env)
    evidence.nodes = Nodes(env, merged, waited)
    code = deliver(compose(evidence))
    channel.post_report_path(env.host, str(evidence.report_dir.resolve() / files.REPORT_TXT))
    if deferred:  # the failed ranks may go now: the report exists
        _cover(evidence.report_dir, attempt, env.ranks)
    channel.await_report_seen(len(others) - len(merged.silent), time.monotonic() + (0.5 if stop() else 3.0))
    return code


def _after(deadline: float) -> Callable[[], bool]:
    return lambda: time.monotonic() >= deadline


def _either(a: Callable[[], bool], b: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: a() or b()


def _after_agent(agent: int | None, grace: float) -> Callable[[], bool]:
    """True once torchrun's ``agent`` has been gone for ``grace`` seconds: a watcher never outlives its agent by
    more (what it has not got by then, it reports as missing)."""
    gone: list[float] = []

    def stop() -> bool:
        if agent is None:
            return False
        if not gone:
            if alive(agent):
                return False
            gone.append(time.monotonic())
        return time.monotonic() - gone[0] >= grace

    return stop


def _ask_nodes(env: NodeEnv, channel: StoreChannel, report_dir: Path, asks: Mapping[int, list],
               stop: Callable[[], bool], limit: float = 2.0) -> dict[int, dict]:
    """The nodes' answers (their ranks' signatures in the windows asked), this node's read from its own files, the
    others' asked through the store, bounded by ``limit`` and ``stop``."""
    from distcheck.supervise.node_exchange import window_answer

    asks = dict(asks)
    answers: dict[int, dict] = {}
    if env.node in asks:
        answers[env.node] = window_answer(report_dir, asks.pop(env.node), env.ranks)
    for node, node_asks in asks.items():
        channel.ask_windows(node, node_asks)
    deadline = time.monotonic() + limit
    while asks and time.monotonic() < deadline and not stop() and not channel.broken:
        answers.update(channel.answers([n for n in asks if n not in answers]))
        if all(n in answers for n in asks):
            break
        time.sleep(0.05)
    return answers


def diagnose_stop(report_dir: str, out_dir: Path, native: bool, world_size: int | None, local_only: bool = False):
    """The ``hang`` finding for ranks that dumped their stacks on a stop signal (rank/stack_hooks.py), or None
    when no rank of this node got one (or every rank had finished its script anyway). ``local_only``: the other
    ranks are on other nodes, not missing."""
    from distcheck.analysis.stack_groups import RankStack, parse_faulthandler
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise.hang import hang_from_stacks, load_progress

    host = socket.gethostname()
    traces = load_traces(report_dir)
    stacks, signals = [], set()
    for name, texts in stack_dump_file.stop_dumps(report_dir).items():
        for rank, text in texts.items():
            trace = traces.get(rank)
            if trace is not None and trace.finished is not None:
                continue
            threads = parse_faulthandler(text)
            if threads:
                pid = trace.meta.get("pid", 0) if trace is not None else 0
                stacks.append(RankStack(rank, int(pid or 0), host, f"faulthandler ({name})", threads, "RANK",
                                        world_size))
                signals.add(name)
    if not stacks:
        return None
    cause = "/".join(sorted(signals))
    progress = load_progress(report_dir)
    dumped = sorted(s.rank for s in stacks)
    stacks, progress, lost, notes = _placed_by_lost_collective(stacks, progress, traces)
    # A rank that ended unfinished without dumping got no stop signal: it died first (SIGKILL, the OOM killer),
    # and torchrun then stopped the others. That death is the cause, and this finding says it is the consequence.
    dead = sorted(r for r, t in traces.items() if t.finished is None and r not in dumped)
    failed = sorted(r for r, t in traces.items() if t.finished is not None and not t.finished.get("ok")
                    and r not in lost)
    if failed:
        first = traces[failed[0]].errors[-1] if traces[failed[0]].errors else None
        what = f" ({first.exc_type} at {file_line(first.file, first.line) or '?'})" \
            if first is not None and first.file else ""
        prefix = (f"torchrun stopped {format_ranks(dumped)} ({cause}) after {format_ranks(failed)} failed{what}; "
                  f"where each stopped rank was: ")
    elif dead:
        prefix = (f"torchrun stopped {format_ranks(dumped)} ({cause}) after {format_ranks(dead)} ended without "
                  f"finishing its script: ")
    else:
        prefix = f"the run was stopped from outside by {cause} (torchrun passed it on to the ranks): "
    if failed:  # the ranks that failed by themselves have their own findings: this describes the stopped ones
        progress = {r: p for r, p in progress.items() if r not in failed}
    finding = hang_from_stacks(stacks, [], progress, None if local_only or failed else world_size, None, prefix,
                               native=native, out_dir=out_dir, title=f"distcheck: stopped by {cause}", notes=notes)
    finding.detail["stopped_by"] = cause
    finding.detail["stopped_ranks"] = dumped
    finding.detail["died_first"] = dead
    finding.detail["failed_first"] = failed
    finding.detail["lost_peer_ranks"] = sorted(lost)  # their own rank_failure is this stop's consequence
    return finding


def _placed_by_lost_collective(stacks: list, progress: dict, traces: dict) -> tuple[list, dict, set[int], list[str]]:
    """Stop signals reach the ranks one by one (torchrun signals each worker in turn; a zygote-forked rank hears it
    through its stand-in), and a rank that fails ends the others' collectives too: a rank's pending collective
    fails ("Connection closed by peer") once a peer died, before its own stop signal arrives, and its dump then
    shows its way out, or it ends with that error itself. Such a rank is placed by the collective it lost its peer
    in, where it waited until then; its failure is the consequence, never a cause, and its dump stays in its
    stop-dump file. The stacks, progress, those ranks and the notes to diagnose with."""
    import dataclasses

    from distcheck.analysis.torch_errors import lost_peer

    progress = dict(progress)
    lost: set[int] = set()
    notes = []
    for rank, trace in traces.items():
        p = progress.get(rank)
        if p is None or p.last_failed is None or p.first_open is not None:
            continue
        # The collective's own error (the rank may be stopped before it wrote the exception's), else the rank's
        failure = p.last_failed.error or (trace.errors[-1].message if trace.errors else "")
        if not lost_peer(failure):
            continue
        lost.add(rank)
        progress[rank] = dataclasses.replace(p, first_open=p.last_failed)
        notes.append(f"rank {rank}'s {p.last_failed.op} #{p.last_failed.seq} failed once another rank had ended "
                     f"(gloo lost its connection to it): it is placed there, where it waited")
    return [s for s in stacks if s.rank not in lost], progress, lost, notes


@dataclass
class StopEnding:
    """How a run torchrun stopped ends, on one node or several (the one ladder both watchers climb): a stop after
    a rank's own failure is its consequence (where the stopped ranks were is a warning, the failure the finding);
    a stop from outside is the finding."""

    stopped: Finding | None = None
    findings: list[Finding] = field(default_factory=list)
    warnings: list[Note] = field(default_factory=list)
    note: str | None = None
    ranks: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, stopped: Finding | None) -> StopEnding:
        if stopped is None:
            return cls()
        dead, failed = stopped.detail["died_first"], stopped.detail.get("failed_first", [])
        note = (f"{format_ranks(failed or dead)} ended first; torchrun stopped the others" if failed or dead
                else f"stopped from outside by {stopped.detail['stopped_by']}")
        findings, warnings = ([], [as_warning(stopped)]) if failed else ([stopped], [])
        return cls(stopped, findings, warnings, note, set(stopped.detail["stopped_ranks"]))


def as_warning(stopped: Finding) -> Note:
    """Where each rank torchrun stopped was (its stop dump), as a warning: a rank failed first, and that failure
    is the finding."""
    return Note("stopped_by_torchrun", stopped.ranks, stopped.message, stopped.detail)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcheck.supervise.node_watcher")
    parser.add_argument("--report-dir", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--parent", type=int, default=0, help="pid of the rank that started this watcher")
    parser.add_argument("--agent", type=int, default=None, help="pid of torchrun's agent (the ranks' parent)")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--local-world-size", type=int, default=None)
    parser.add_argument("--log", default=None, help="log file (default: stderr)")
    parser.add_argument("--command", default=None, help="write the report of this `distcheck run` command")
    args = parser.parse_args(argv)
    from distcheck.supervise.console import survive_lost_console

    survive_lost_console()  # the job's console may go away; the watcher still ends a hung job (console.py)
    logging.basicConfig(level=logging.INFO, format=f"[distcheck watcher {socket.gethostname()}] %(message)s",
                        filename=args.log)
    return serve(args.report_dir, args.timeout, args.native, args.parent, args.world_size, args.local_world_size,
                 args.agent, args.command)


if __name__ == "__main__":
    sys.exit(main())
