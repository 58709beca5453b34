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
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from distcheck.contract import files, stack_dump_file, stack_hook_file
from distcheck.contract.findings import format_ranks
from distcheck.processes import RUN_ID_ENV, alive, read_environ, restart_count, terminate
from distcheck.supervise.live_stragglers import LiveStragglers
from distcheck.supervise.procs import RunTree
from distcheck.supervise.watch import HUNG, STARTUP_TIMEOUT, HangDump, WatchLoop, script_ended

if TYPE_CHECKING:
    from distcheck.supervise.node_exchange import NodeEnv, StoreChannel

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


class _LiveRanks:
    """This node's live ranks (``{rank: pid}``) each time the watch loop asks; every ask also feeds the run's process
    tree and ``seen`` (every rank ever found), and a change is logged. ``script_end_ends``: a rank whose script
    ended (its exit line) no longer runs, though its process may (under ``run``, local rank 0 waits for the report
    after its script)."""

    def __init__(self, report_dir: str | os.PathLike, host: str | None, tree: RunTree, seen: set[int],
                 script_end_ends: bool = False) -> None:
        self.report_dir, self.host, self.tree, self.seen = report_dir, host, tree, seen
        self.script_end_ends = script_end_ends
        self.last: dict[int, int] = {}

    def __call__(self) -> dict[int, int]:
        ranks = local_ranks(self.report_dir, self.host)
        self.tree.observe(ranks)
        self.seen.update(ranks)
        if ranks != self.last:
            log.info("ranks running on this node: %s", ranks)
            self.last = ranks
        if self.script_end_ends:
            return {r: pid for r, pid in ranks.items() if not script_ended(self.report_dir, r)}
        return ranks


def local_ranks(report_dir: str | os.PathLike, host: str | None = None) -> dict[int, int]:
    """``{rank: pid}`` of this node's live ranks, from the hook files written by distcheck/rank/bootstrap.py.

    A stale hook file from an earlier job in the same directory is ignored: its pid is dead, or now belongs to a
    process whose RANK differs. So is a rank of another torchrun attempt (``--max-restarts``) than this watcher's.
    """
    host = host or socket.gethostname()
    out: dict[int, int] = {}
    attempt = restart_count()
    for hook in stack_hook_file.read_all(report_dir):
        pid, rank = hook.pid, hook.rank
        if (hook.host or host) != host or not alive(pid):
            continue
        try:
            environ = read_environ(pid)
            if int(environ.get("RANK", rank)) != rank or restart_count(environ) != attempt:
                continue
        except (OSError, ValueError):
            continue
        out[rank] = pid
    return out


def watch(report_dir: str, timeout: float, native: bool = False, parent: int = 0, world_size: int | None = None,
          local_world_size: int | None = None, agent: int | None = None, command: str | None = None) -> int:
    """``command``: the ``distcheck run`` command line when this watcher writes the run's report (one node: the
    ranks only write files, and end as they would without distcheck); None for ``consistency``, whose rank 0
    writes its own report."""
    tree = RunTree(os.environ.get(RUN_ID_ENV))
    try:
        return _watch(report_dir, timeout, native, parent, world_size, local_world_size, tree, agent, command)
    finally:
        ended = tree.end()  # whatever the ranks left on this node, then their stderr copies once drained
        if ended:
            log.info("ended %d processes the ranks left running: %s", len(ended), ended)


def _watch(report_dir: str, timeout: float, native: bool, parent: int, world_size: int | None,
           local_world_size: int | None, tree: RunTree, agent: int | None = None, command: str | None = None) -> int:
    host = socket.gethostname()
    multi_node = bool(world_size and local_world_size and world_size > local_world_size)
    if multi_node:
        from distcheck.supervise.node_exchange import NodeEnv, StoreChannel

        env = NodeEnv.from_env(os.environ, host)
        channel = StoreChannel.connect(env) if env is not None else None
        if env is not None and channel is not None:
            log.info("node %d of %d (ranks %s), exchanging through the store at %s:%d", env.node, env.nnodes,
                     format_ranks(env.ranks), env.store_host, env.store_port)
            return _watch_nodes(report_dir, timeout, native, parent, env, channel, tree, agent, command)
        # No store to reach: this node's own report, as before the exchange (the stacks stay named by host).
    out_dir = Path(report_dir) / f"node-{host}" if multi_node else Path(report_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    # This watcher writes the run's report: the run is over once every rank ended its script (its exit line: local
    # rank 0 waits for this report after its own) or its process, seen or not (a short script can end before the
    # first look).
    writes_run = command is not None and bool(world_size) and not multi_node
    live = _LiveRanks(report_dir, host, tree, seen, script_end_ends=writes_run)
    agent = agent or _parent_of(parent)
    expected = world_size if writes_run else None

    def finished() -> set[int]:
        running = live()
        if expected is not None:
            seen.update(r for r in range(expected) if r not in seen and _traced_under(report_dir, r, agent))
        return seen - set(running)

    cancel = threading.Event()

    _cancel_when_orphaned(parent, seen, cancel)
    started = time.monotonic()
    started_wall = time.time()
    # Traces and hooks are read from the (possibly shared) report dir; this node's stacks and report go to out_dir.
    # Before any rank opened its trace the ranks are still importing torch (seconds each on a loaded machine):
    # the start-up limit, not --timeout, applies to them.
    loop = WatchLoop(report_dir, timeout, live=live, finished=finished, expected=expected, ranks=None,
                     startup_timeout=max(timeout, STARTUP_TIMEOUT), dump=HangDump(native, world_size, out_dir),
                     poll=0.1, cancel=cancel, stragglers=LiveStragglers(report_dir))
    result = loop.run()
    cancel.set()
    if result.state == HUNG:
        pids = local_ranks(report_dir, host)
        write_node_report(report_dir, out_dir, result.hang_findings, world_size or len(pids), timeout,
                          time.monotonic() - started, "watchdog", f"no progress for {timeout:g}s",
                          (result.diagnosed_at or 0) - (result.declared_at or 0))
        terminate(list(pids.values()), grace=2.0)
        files.tidy(report_dir)
        return 1
    stopped = stop_finding(report_dir, out_dir, native, world_size)
    if stopped is not None:  # torchrun passed a stop signal on to the ranks: they dumped their stacks and died
        dead, failed = stopped.detail["died_first"], stopped.detail.get("failed_first", [])
        note = (f"{format_ranks(failed or dead)} ended first; torchrun stopped the others" if failed or dead
                else f"stopped from outside by {stopped.detail['stopped_by']}")
        # After a rank's own failure the stop is its consequence: where the stopped ranks were is a warning,
        # the failure is the finding.
        findings, warnings = ([], [stopped_note(stopped)]) if failed else ([stopped], [])
        write_node_report(report_dir, out_dir, findings, world_size or len(seen), timeout,
                          time.monotonic() - started, "stopped", note, running=set(stopped.detail["stopped_ranks"]),
                          warnings=warnings, command=command)
        files.tidy(report_dir)
        return 1
    if expected is not None:  # the run's report: every rank ended by itself
        return write_run_report(report_dir, command or "distcheck run", expected, timeout,
                                time.monotonic() - started, agent)
    if 0 in seen and not _written_since(out_dir, started_wall):
        # Rank 0 died before it could write the report (SIGKILLed, or stopped by torchrun after another rank
        # died): the run's report, from the ranks' files, so that the death is still named.
        write_node_report(report_dir, out_dir, [], world_size or len(seen), timeout, time.monotonic() - started,
                          "report", "rank 0 ended before writing the report", running=set())
        files.tidy(report_dir)
        return 1
    return 0


def _watch_nodes(report_dir: str, timeout: float, native: bool, parent: int, env: NodeEnv, channel: StoreChannel,
                 tree: RunTree, agent: int | None = None, command: str | None = None) -> int:
    """One node of several: watch this node's ranks, exchange summaries through torchrun's store
    (supervise/node_exchange.py); node 0 writes the job's one report, the others print where it is.

    ``command`` (``distcheck run``): node 0's watcher writes the run's report once every node's ranks ended their
    scripts, from its own ranks' files and the other nodes' final summaries; its exit code is the verdict. Each
    node's local rank 0 waits for its watcher after its script, so a script-ended rank counts as ended here."""
    from distcheck.supervise.node_exchange import (GATHER_TIMEOUT, NodeLink, summarize_node, wait_for_report,
                                                   where_line)
    from distcheck.supervise.hang import diagnose_hang

    host = env.host
    out_dir = Path(report_dir) / f"node-{host}"  # this node's own artifacts (its stacks), named by host
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    cancel = threading.Event()
    link = NodeLink(env, channel, report_dir, lambda: tuple(files.trace_progress(report_dir, r) for r in env.ranks),
                    cancel)
    published: list[frozenset] = [frozenset()]
    live = _LiveRanks(report_dir, host, tree, seen, script_end_ends=command is not None)
    agent = agent or _parent_of(parent)

    def finished() -> set[int]:
        running = live()
        # A rank can end before this watcher first looks (a short script on a slow start): its trace says it ran
        # under this torchrun agent.
        seen.update(r for r in env.ranks if r not in seen and _traced_under(report_dir, r, agent))
        done = seen - set(running)
        # A rank that ended its script (its exit line; a failed one waits for the report) or its process: node 0's
        # report learns how, not only that its files are elsewhere.
        ended = frozenset(done | {r for r in running if script_ended(report_dir, r)})
        if not env.reports and ended != published[0]:
            published[0] = ended
            channel.publish(summarize_node(env, report_dir, set(running), final=bool(seen) and not running))
        return done

    _cancel_when_orphaned(parent, seen, cancel)
    link.start()
    started = time.monotonic()
    started_wall = time.time()
    ended_by_rank = threading.Event()

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
            result = WatchLoop(report_dir, limit, live=live, finished=finished, expected=None, ranks=None,
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
                if _written_since(Path(report_dir), started_wall):
                    channel.publish_report(host, str(Path(report_dir).resolve() / files.REPORT_TXT))
                    channel.await_report_seen(env.nnodes - 1, time.monotonic() + 2.0)
            else:
                location = wait_for_report(channel, link, time.monotonic() + 3.0)
                if location is not None:
                    _say(where_line(location, 3.0))
            return 0
        hung = result.state == HUNG or link.remote_hang is not None
        if hung:
            if link.remote_hang is None:
                channel.announce_hang(env.node, host)
            pids = local_ranks(report_dir, host)
            findings = diagnose_hang(pids, report_dir, native=native, timeout=timeout, world_size=env.world_size,
                                     out_dir=out_dir)
            channel.publish(summarize_node(env, report_dir, set(pids), hung=True,
                                           stacks_path=out_dir / files.STACKS_JSON))
            if env.reports:
                write_job_report(report_dir, env, channel, native, timeout, time.monotonic() - started,
                                 started_wall, hung=True, note=f"no progress for {timeout:g}s")
            else:
                waited = GATHER_TIMEOUT + 15.0
                location = wait_for_report(channel, link, time.monotonic() + waited)
                if location is None:  # node 0 is gone: this node's report, with what it knows
                    _say(where_line(location, waited, env, gone=channel.broken))
                    write_node_report(report_dir, out_dir, findings, env.world_size, timeout,
                                      time.monotonic() - started, "watchdog", f"no progress for {timeout:g}s",
                                      ranks=set(env.ranks))
                else:
                    _say(where_line(location, waited))
            terminate(list(pids.values()), grace=2.0)
            files.tidy(report_dir)
            return 1
        stopped = stop_finding(report_dir, out_dir, native, env.world_size, local_only=True)
        if stopped is not None:
            # torchrun passed a stop signal on: its store goes down with node 0's agent, so each node reports its
            # own ranks in node-<host>/ (`distcheck report` merges them), naming no other node's rank.
            dead = stopped.detail["died_first"]
            note = (f"{format_ranks(dead)} ended first; torchrun stopped the others" if dead
                    else f"stopped from outside by {stopped.detail['stopped_by']}")
            write_node_report(report_dir, out_dir, [stopped], env.world_size, timeout, time.monotonic() - started,
                              "stopped", note, running=set(stopped.detail["stopped_ranks"]), ranks=set(env.ranks))
            files.tidy(report_dir)
            return 1
        # Every rank of this node has ended: cut their trace records' unwritten tails before reading them, or a
        # record file still at its preallocated size reads as a big job's, whose traces are only summarized.
        files.tidy(report_dir)
        if env.reports and command is not None:  # the run's report: every rank of this node ended its script
            code = write_job_report(report_dir, env, channel, native, timeout, time.monotonic() - started,
                                    started_wall, hung=False, note=None, command=command)
            return code
        if env.reports:
            if 0 in seen and not _written_since(Path(report_dir), started_wall):
                # Rank 0 died before it could write the report: the job's report, from every node's summary.
                write_job_report(report_dir, env, channel, native, timeout, time.monotonic() - started,
                                 started_wall, hung=False, note="rank 0 ended before writing the report")
                return 1
            if _written_since(Path(report_dir), started_wall):
                channel.publish_report(host, str(Path(report_dir).resolve() / files.REPORT_TXT))
            return 0
        if seen:
            channel.publish(summarize_node(env, report_dir, set(), final=True))
            # torchrun's agents wait for each other at exit (300 s), so the report comes within that.
            waited = 300.0
            location = wait_for_report(channel, link, time.monotonic() + waited)
            _say(where_line(location, waited, env, gone=channel.broken))
        return 0
    finally:
        link.stop.set()
        cancel.set()


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


def write_job_report(report_dir: str, env: NodeEnv, channel: StoreChannel, native: bool, timeout: float, seconds: float,
                     started_wall: float, hung: bool, note: str | None, command: str | None = None) -> int:
    """Node 0's report of the whole job: its own ranks' files, and every other node's summary gathered through
    the store with a deadline. The stacks of all nodes are grouped together into the one hang finding; a node
    that sent nothing is named once. Its exit code."""
    from distcheck.analysis.progress import progress_by_rank
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, render_text, write_report
    from distcheck.supervise import run_report
    from distcheck.supervise.hang import hang_from_stacks
    from distcheck.supervise.node_exchange import (GATHER_TIMEOUT, merge_stack_documents, merge_summaries,
                                                   nodes_json, silent_nodes_finding, stacks_from_document)
    from distcheck.supervise.stacks import load_stacks_document

    out_dir = Path(report_dir) / f"node-{env.host}"
    others = [n for n in range(env.nnodes) if n != env.node]
    began = time.monotonic()
    got = channel.gather(others, began + GATHER_TIMEOUT, ready=lambda s: s.final or (s.hung and s.stacks is not None
                                                                                    or s.hung and bool(s.note)))
    waited = time.monotonic() - began
    merged = merge_summaries(got, others, env.node_ranks, hung)
    log.info("summaries from %d of %d other nodes after %.1fs", len(got), len(others), waited)
    traces = {r: t for r, t in load_traces(report_dir).items() if r in set(env.ranks)}
    progress = progress_by_rank(traces)
    progress.update(merged.progress)
    findings = []
    if hung:
        docs = []
        local_stacks = out_dir / files.STACKS_JSON
        if local_stacks.exists():
            docs.append(load_stacks_document(local_stacks))
        docs += [stacks_from_document(d) for d in merged.stack_docs]
        stacks, errors, _, clashes = merge_stack_documents(docs)
        hosts = {env.host: env.ranks, **{merged.hosts[n]: env.node_ranks(n) for n in merged.hosts}}
        findings.append(hang_from_stacks(
            stacks, errors, progress, env.world_size, timeout, f"no progress for {timeout:g}s: ", native=native,
            out_dir=report_dir, title=f"distcheck watchdog: no progress for {timeout:g}s (stacks of {len(hosts)} "
            f"nodes: {', '.join(sorted(hosts))})", notes=clashes + merged.notes))
    silent = silent_nodes_finding(merged.silent, waited, f"{env.store_host}:{env.store_port}")
    if silent is not None:
        findings.append(silent)
    running = set(local_ranks(report_dir, env.host)) if hung else set()
    outcomes = {r: o for r, o in run_report.outcomes_from_traces(traces, env.world_size, hung, running).items()
                if r in set(env.ranks)}
    outcomes.update(merged.outcomes)
    report = _report_so_far(Path(report_dir), started_wall) if command is None else None
    if report is not None:  # consistency wrote what completed before: keep it, with the diagnosis added
        report.findings = superseded_by_diagnosis(report) + findings
        report.checks.append(CheckResult("watchdog" if hung else "report", False, 0.0, note=note))
    elif traces:
        report = run_report.build_report(Path(report_dir), command or command_of(traces), env.world_size, traces,
                                         outcomes, timeout, seconds, hang_findings=findings[:1] if hung else None,
                                         stop_reason=note, remote=merged)
        # The run analysis keeps a hang finding only where a rank still ran: these are the job's own findings.
        report.findings += [f for f in findings if f not in report.findings]
    else:
        report = Report(command="distcheck (under torchrun)", world_size=env.world_size, findings=findings,
                        checks=[CheckResult("watchdog" if hung else "report", False, 0.0, note=note)])
    if hung:
        report.artifacts.update({files.STACKS_TXT: files.STACKS_TXT, files.STACKS_JSON: files.STACKS_JSON})
    report.artifacts.setdefault(f"node-{env.host}", f"node-{env.host}")  # this node's own stacks
    # The other nodes' files stay on their nodes: where, by host.
    report.data["nodes"] = nodes_json(merged, env, str(Path(report_dir).resolve()))
    write_report(report, Path(report_dir))
    channel.publish_report(env.host, str(Path(report_dir).resolve() / files.REPORT_TXT))
    channel.await_report_seen(len(others) - len(merged.silent), time.monotonic() + 3.0)
    for f in findings:
        log.warning("[%s] %s", f.kind, f.message)
    _say(render_text(report, Path(report_dir)))
    return report.exit_code


def _written_since(out_dir: Path, since: float) -> bool:
    try:
        return (out_dir / files.REPORT_JSON).stat().st_mtime >= since - 1.0
    except OSError:
        return False


def stop_finding(report_dir: str, out_dir: Path, native: bool, world_size: int | None, local_only: bool = False):
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
    # A rank that ended unfinished without dumping got no stop signal: it died first (SIGKILL, the OOM killer),
    # and torchrun then stopped the others. That death is the cause, and this finding says it is the consequence.
    dead = sorted(r for r, t in traces.items() if t.finished is None and r not in dumped)
    failed = sorted(r for r, t in traces.items() if t.finished is not None and not t.finished.get("ok"))
    if failed:
        first = traces[failed[0]].errors[-1] if traces[failed[0]].errors else None
        what = f" ({first.exc_type} at {os.path.basename(first.file)}:{first.line})" \
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
                               native=native, out_dir=out_dir, title=f"distcheck: stopped by {cause}")
    finding.detail["stopped_by"] = cause
    finding.detail["stopped_ranks"] = dumped
    finding.detail["died_first"] = dead
    finding.detail["failed_first"] = failed
    return finding


def superseded_by_diagnosis(report) -> list:
    """The findings of a command's report so far (consistency's: what completed before the run stopped) that stay
    once the watcher's own diagnosis joins them: all but the one saying which check was interrupted (a
    rank_failure naming a check the report marks "interrupted"), which the diagnosis says better."""
    interrupted = {c.name for c in report.checks if c.note == "interrupted"}
    return [f for f in report.findings if not (f.kind == "rank_failure" and f.detail.get("check") in interrupted)]


def write_node_report(report_dir: str, out_dir: Path, findings: list, world_size: int, timeout: float,
                      seconds: float, check_name: str, note: str, check_seconds: float = 0.0,
                      running: set[int] | None = None, ranks: set[int] | None = None, warnings: list | None = None,
                      command: str | None = None) -> None:
    """This node's report on a hang or a stop signal, printed to the console (stderr) too. ``ranks``: this node's
    ranks where the others' files are on other nodes (their outcomes are not this node's to tell).

    A command that wrote a partial report (consistency: what completed before) keeps it, with the diagnosis added;
    for ``run`` the whole run report is built from the ranks' files, as rank 0 would have built it.
    """
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, render_text, write_report
    from distcheck.supervise import run_report

    check = CheckResult(check_name, False, check_seconds, note=note)
    report = _report_so_far(out_dir)
    traces = load_traces(report_dir)
    if report is not None:
        report.findings = superseded_by_diagnosis(report) + findings
        report.checks.append(check)
    elif traces:
        if running is None:  # a hang: every rank without an exit line was still running
            running = {r for r, t in traces.items() if t.finished is None}
        # Still running at a hang or a stop from outside (the finding says where): hung; stopped by torchrun
        # after a rank's own failure (no finding of their own, a warning says where): stopped
        outcomes = run_report.outcomes_from_traces(traces, world_size, bool(findings), running)
        if ranks is not None:
            traces = {r: t for r, t in traces.items() if r in ranks}
            outcomes = {r: o for r, o in outcomes.items() if r in ranks}
        report = run_report.build_report(Path(report_dir), command or command_of(traces), world_size, traces,
                                         outcomes, timeout, seconds, hang_findings=findings, stop_reason=note,
                                         warnings=warnings)
    else:
        report = Report(command="distcheck (under torchrun)", world_size=world_size, findings=findings,
                        checks=[check])
    report.artifacts.update({files.STACKS_TXT: files.STACKS_TXT, files.STACKS_JSON: files.STACKS_JSON})
    with_attempts(report, Path(report_dir))
    write_report(report, out_dir)
    for f in findings:
        log.warning("[%s] %s", f.kind, f.message)
    sys.stderr.write(render_text(report, out_dir))  # the console of the job, through rank 0's stderr
    sys.stderr.flush()


def write_run_report(report_dir: str, command: str, world_size: int, timeout: float, seconds: float,
                     agent: int | None) -> int:
    """The report of a ``run`` whose ranks all ended by themselves (passed, or failed with torchrun ending the
    others without a stop dump), printed to the job's console; its exit code (rank 0 exits with it)."""
    from distcheck.supervise import run_report

    report = _ended_run_report(Path(report_dir), command, world_size, timeout, seconds, agent)
    with_attempts(report, Path(report_dir))
    code = run_report.publish(report, Path(report_dir))
    log.info("report written: %s", "PASSED" if report.ok else f"FAILED ({len(report.findings)} findings)")
    files.tidy(report_dir)
    return code


def with_attempts(report, report_dir: Path) -> None:
    """A restarted torchrun job's report lists every attempt (the earlier ones from their folders); its verdict and
    exit code are the last attempt's."""
    from distcheck.contract.report import load_report

    earlier = files.attempt_dirs(report_dir)
    if not earlier:
        return
    rows = []
    for attempt, folder in earlier.items():
        try:
            old = load_report(folder) if (folder / files.REPORT_JSON).exists() else _attempt_report(folder, report)
        except Exception as exc:  # neither its report nor a readable trace
            log.warning("attempt %d: no report: %s", attempt, exc)
            rows.append({"attempt": attempt, "ok": None, "summary": "no report (see its files)",
                         "folder": folder.name})
            continue
        rows.append({"attempt": attempt, "ok": old.ok, "summary": _verdict_line(old), "folder": folder.name})
    rows.append({"attempt": len(earlier) and max(earlier) + 1, "ok": report.ok,
                 "summary": _verdict_line(report),
                 "folder": "."})
    report.data["attempts"] = rows
    report.sections["attempts (torchrun --max-restarts; the verdict is the last one's)"] = "\n".join(
        f"attempt {r['attempt']}: {r['summary'][:300]}" + (f" ({r['folder']}/)" if r["folder"] != "." else "")
        for r in rows)
    for attempt, folder in earlier.items():
        report.artifacts.setdefault(folder.name, folder.name)


def _verdict_line(report) -> str:
    """PASSED, or the finding that names a line of the user's code (the cause: a rank that raised, before a rank
    torchrun killed before it could say where it was), else the first."""
    if report.ok:
        return "PASSED"
    if not report.findings:
        return "FAILED"
    return next((f for f in report.findings if f.detail.get("line")), report.findings[0]).message


def _attempt_report(folder: Path, current):
    """An earlier attempt's report from its files, where its watcher could not leave one (it ended with the ranks
    of that attempt before writing, or wrote it after the next attempt had moved the files): written there too."""
    from distcheck.contract.report import write_report

    report = _ended_run_report(folder, current.command, current.world_size, 0.0, 0.0, None, require_traces=True)
    write_report(report, folder)
    return report


def _ended_run_report(report_dir: Path, command: str, world_size: int, timeout: float, seconds: float,
                      agent: int | None, require_traces: bool = False):
    """The report of a run whose ranks have all ended, from their files (traces of torchrun ``agent``'s ranks only,
    when given: a reused directory may hold another job's). ``require_traces``: no trace is an error, not a report
    of ranks that never started."""
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise import run_report

    traces = {r: t for r, t in load_traces(report_dir).items()
              if r < world_size and (agent is None or t.meta.get("ppid", agent) == agent)}
    if require_traces and not traces:
        raise FileNotFoundError(f"no trace in {report_dir}")
    outcomes = run_report.outcomes_from_traces(traces, world_size, False, set())
    return run_report.build_report(report_dir, command, world_size, traces, outcomes, timeout, seconds)


def stopped_note(stopped) -> "Note":
    """Where each rank torchrun stopped was (its stop dump), as a warning: a rank failed first, and that failure
    is the finding."""
    from distcheck.contract.findings import Note

    return Note("stopped_by_torchrun", stopped.ranks, stopped.message, stopped.detail)


def command_of(traces: dict) -> str:
    """The user's distcheck command, from a rank's argv in its trace."""
    for trace in traces.values():
        argv = trace.meta.get("argv") or []
        if len(argv) > 1 and str(argv[0]).endswith("__main__.py"):
            return "distcheck " + " ".join(map(str, argv[1:]))
    return "distcheck (under torchrun)"


def _report_so_far(out_dir: Path, since: float | None = None):
    from distcheck.contract.report import load_report

    if not (out_dir / "report.json").exists() or since is not None and not _written_since(out_dir, since):
        return None
    try:
        return load_report(out_dir)
    except Exception:  # a report being rewritten right now, or not ours: start a fresh one
        return None


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
    logging.basicConfig(level=logging.INFO, format=f"[distcheck watcher {socket.gethostname()}] %(message)s",
                        filename=args.log)
    return watch(args.report_dir, args.timeout, args.native, args.parent, args.world_size, args.local_world_size,
                 args.agent, args.command)


if __name__ == "__main__":
    sys.exit(main())
