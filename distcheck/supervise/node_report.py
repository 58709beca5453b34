"""The report of a job under torchrun: what the node watcher found, as one typed record, composed into the Report.

    torchrun --nproc-per-node 2 -m distcheck run -- train.py          # the node watcher composes and publishes it
    torchrun --nnodes 2 --nproc-per-node 2 ... -m distcheck run -- train.py   # node 0's, with every node's summary

The node watcher (supervise/node_watcher.py) watches, dumps and diagnoses a hang or a stop once, exchanges the
nodes' summaries through the store, and puts what it learned into one :class:`Evidence`. :func:`compose` turns
that into the report and says where it goes (it reads the report directory through the existing loaders and
prints nothing); :func:`publish` writes it and prints it to the job's console. Every ending takes this path: a
hang, a stop signal, a run whose ranks ended by themselves, rank 0 dying before its own report, node 0 gone.
"""
from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from distcheck.contract import files
from distcheck.contract.findings import Finding, Note, format_ranks

if TYPE_CHECKING:
    from distcheck.analysis.trace_events import RankTrace
    from distcheck.contract.report_handoff import Handed
    from distcheck.contract.node_summary import NodeSummary
    from distcheck.contract.report import Report
    from distcheck.supervise.node_exchange import MergedNodes, NodeEnv

# The analysis and the report's modules are imported where a report is composed: the watcher starts with every
# job and watches for its whole life, mostly without composing anything.

log = logging.getLogger("distcheck")

# How the watch ended.
HANG = "hang"  # no progress for --timeout: the ranks were dumped and diagnosed
NODE0_GONE = "node 0 gone"  # a hang on a node whose node 0 never wrote the job's report: this node's own
STOPPED = "stopped"  # torchrun passed a stop signal on to the ranks: they dumped their stacks and died
ENDED = "ended"  # every rank ended by itself (a `run`: this watcher writes its report)
RANK0_DIED = "rank 0 died"  # rank 0 ended before writing its own report (consistency)
NODE = "node"  # one node of several: its own report in node-<host>/, from its ranks' files only, before any exchange

# The check the watcher adds to a report, by how the watch ended.
_CHECK_OF = {HANG: "watchdog", NODE0_GONE: "watchdog", STOPPED: "stopped", RANK0_DIED: "report", ENDED: "report",
             NODE: "report"}
_STACKS = {files.STACKS_TXT: files.STACKS_TXT, files.STACKS_JSON: files.STACKS_JSON}


@dataclass
class Nodes:
    """Several nodes: what node 0 gathered from the others through the store."""

    env: NodeEnv
    merged: MergedNodes  # the other nodes' summaries, merged (supervise/node_exchange.merge_summaries)
    waited: float  # seconds node 0 waited for them


@dataclass
class Evidence:
    """What the node watcher learned by the end of its watch: everything the report is composed from besides the
    ranks' own files."""

    ending: str  # HANG | NODE0_GONE | STOPPED | ENDED | RANK0_DIED
    report_dir: Path  # the ranks' files
    out_dir: Path  # where this report goes: the report dir, or this node's node-<host>/
    world_size: int
    timeout: float
    seconds: float  # how long the watch took
    started_wall: float  # when it began (time.time()): a report.json older than that is not this job's
    note: str | None = None  # the watcher's check's note (why the run ended)
    findings: list[Finding] = field(default_factory=list)  # the diagnosis: a hang, or where stopped ranks were
    warnings: list[Note] = field(default_factory=list)
    check_seconds: float = 0.0  # from declaring the hang to its diagnosis
    running: set[int] | None = None  # ranks still running at the end; None: every rank without an exit line
    local_ranks: set[int] | None = None  # this node's ranks where the others' files are on other nodes
    command: str | None = None  # the `distcheck run` command line this watcher was given
    agent: int | None = None  # torchrun's agent: only its ranks' traces count (a reused dir may hold others)
    nodes: Nodes | None = None  # node 0 of several: the other nodes' summaries
    stopped: set[int] = field(default_factory=set)  # ranks torchrun stopped (their stop dumps), in a node's report

    @property
    def hung(self) -> bool:
        return self.ending in (HANG, NODE0_GONE)


@dataclass
class Built:
    """A report built from a folder's files, with the traces it was built from (its trace.json is drawn from them
    when it is published)."""

    report: Report
    traces: dict[int, RankTrace]


@dataclass
class Publication:
    """A composed report and where it goes."""

    report: Report
    out_dir: Path
    to_stdout: bool  # a run that ended by itself prints like `run --nproc`; the watcher's diagnoses go to stderr
    diagnosis: list[Finding]  # logged to the watcher's log too
    earlier_attempts: dict[Path, Built] = field(default_factory=dict)  # built from their files: written there
    traces: dict[int, RankTrace] = field(default_factory=dict)  # what the report's trace.json is drawn from
    trace_dir: Path | None = None  # where that trace.json goes (the ranks' report dir)
    console: bool = True  # printed to the job's console (a node's own report is not: node 0 prints the job's)


def compose(e: Evidence) -> Publication:
    """The report of the watch that ``e`` describes, and where it goes."""
    if e.nodes is not None:
        return _job_report(e, e.nodes)
    if e.ending == NODE:
        return _own_node_report(e)
    if e.ending == ENDED:
        built = ended_run_report(e.report_dir, e.command or "distcheck run", e.world_size, e.timeout, e.seconds,
                                 e.agent)
        return Publication(built.report, e.report_dir, True, [], with_attempts(built.report, e.report_dir),
                           built.traces, e.report_dir)
    return _node_report(e)


# The watch's own diagnoses (its main thread) and the reports a rank hands over (supervise/report_desk.py's thread)
# are delivered one at a time: a handed report must not land between a diagnosis's read of the report so far and
# its write, nor over it.
_DELIVERING = threading.RLock()


def deliver(pub: Publication) -> int:
    """Write the report (and the earlier attempts' that were missing) and print it to the job's console; its exit
    code."""
    with _DELIVERING:
        return _deliver(pub)


def _deliver(pub: Publication) -> int:
    from distcheck.contract.report import publish as publish_report
    from distcheck.supervise.run_report import write_trace_view

    for folder, built in pub.earlier_attempts.items():
        write_trace_view(built.report, folder, built.traces)
        publish_report(built.report, folder)
    if pub.trace_dir is not None:
        write_trace_view(pub.report, pub.trace_dir, pub.traces)
    # stderr: the console of the job, through local rank 0's stderr, which torchrun shows
    console = (sys.stdout if pub.to_stdout else sys.stderr) if pub.console else None
    publish_report(pub.report, pub.out_dir, echo=console)
    for f in pub.diagnosis:
        log.warning("[%s] %s", f.kind, f.message)
    if console is sys.stdout:
        log.info("report written: %s", "PASSED" if pub.report.ok else f"FAILED ({len(pub.report.findings)} findings)")
    return pub.report.exit_code


def handed_publication(handed: Handed, report_dir: Path) -> Publication:
    """A report a rank composed and handed over (consistency's rank 0, contract/report_handoff.py): the partial
    ones (what completed, before each check) are written only; the final one is printed to the job's console
    (stdout), as the command's own report."""
    assert handed.report is not None
    return Publication(handed.report, report_dir, True, [], console=handed.final)


# What became of a handed report.
PUBLISHED, WITHDRAWN, SUPERSEDED = "published", "withdrawn", "superseded"


def deliver_handed(handed: Handed, report_dir: Path) -> str:
    """Publish a report a rank handed over, unless the watcher's own diagnosis of the run (a hang's watchdog
    report, a stop signal's) is already there: that one ended the run, and the run's rank 0 only says so (it
    prints the diagnosis itself). A withdrawn report (bad input found mid-run) removes the partial one."""
    from distcheck.contract.report import remove_report

    with _DELIVERING:
        if diagnosis_written(report_dir):
            return SUPERSEDED
        if handed.report is None:
            remove_report(report_dir)
            return WITHDRAWN
        deliver(handed_publication(handed, report_dir))
        return PUBLISHED


def diagnosis_written(report_dir: Path) -> bool:
    """Whether report_dir's report is a watcher's diagnosis of the run (it ended the run: a hang, a stop)."""
    so_far = report_so_far(report_dir)
    return so_far is not None and any(c.name in (_CHECK_OF[HANG], _CHECK_OF[STOPPED]) for c in so_far.checks)


def _node_report(e: Evidence) -> Publication:
    """This node's report on a hang, a stop signal or rank 0's death. A command that wrote a report so far
    (consistency: what completed before) keeps it, with the diagnosis added; for ``run`` the whole run report is
    built from the ranks' files, as rank 0 would have built it. ``e.local_ranks``: the other ranks' outcomes are
    not this node's to tell."""
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise import run_report

    traces = load_traces(e.report_dir)
    running = e.running
    if running is None:  # a hang: every rank without an exit line was still running
        running = {r for r, t in traces.items() if t.finished is None}
    # Still running at a hang or a stop from outside (the finding says where): hung; stopped by torchrun after a
    # rank's own failure (no finding of their own, a warning says where): stopped
    outcomes = run_report.outcomes_from_traces(traces, e.world_size, bool(e.findings), running)
    traced = bool(traces)  # by any rank: where this node's have none, the report still says so
    if e.local_ranks is not None:
        traces = {r: t for r, t in traces.items() if r in e.local_ranks}
        outcomes = {r: o for r, o in outcomes.items() if r in e.local_ranks}
    report = _with_diagnosis(e, report_so_far(e.out_dir), traces, outcomes, e.findings, hang_findings=e.findings,
                             traced=traced)
    report.artifacts.update(_STACKS)
    return Publication(report, e.out_dir, False, e.findings, with_attempts(report, e.report_dir), traces,
                       e.report_dir)


def _own_node_report(e: Evidence) -> Publication:
    """One node's own report (``node-<host>/``), from its ranks' files alone: how each of them ended or where it
    still is, its causes, its collectives compared among themselves. Written before any exchange, and again as its
    ranks end, so that what the node knows survives a failed exchange and a watcher killed with its torchrun.
    The other nodes' ranks are not this node's to tell: they are left out, never called missing."""
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise import run_report

    local = e.local_ranks or set()
    traces = {r: t for r, t in load_traces(e.report_dir).items() if r in local}
    running = e.running or set()
    outcomes = {r: o for r, o in run_report.outcomes_from_traces(traces, e.world_size, False,
                                                                 running | e.stopped).items() if r in local}
    report = run_report.build_report(e.report_dir, e.command or command_of(traces), e.world_size, traces, outcomes,
                                     e.timeout, e.seconds, stop_reason=e.note, warnings=e.warnings)
    report.findings += [f for f in e.findings if f not in report.findings]
    if running:
        report.sections["still running when this node's report was written"] = format_ranks(sorted(running))
    return Publication(report, e.out_dir, False, [], console=False)


def _job_report(e: Evidence, nodes: Nodes) -> Publication:
    """Node 0's report of the whole job: its own ranks' files and every other node's summary. The hang finding
    (``e.findings``) was diagnosed from every node's stacks; a node that sent nothing is named once."""
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise import run_report
    from distcheck.supervise.node_exchange import nodes_json, silent_nodes_finding

    env, merged = nodes.env, nodes.merged
    mine = set(env.ranks)
    traces = {r: t for r, t in load_traces(e.report_dir).items() if r in mine}
    findings = list(e.findings)
    silent = silent_nodes_finding(merged.silent, nodes.waited, f"{env.store_host}:{env.store_port}", merged.hosts,
                                  merged.dirs)
    if silent is not None:
        findings.append(silent)
    outcomes = {r: o for r, o in run_report.outcomes_from_traces(traces, env.world_size, e.hung,
                                                                 e.running or set()).items() if r in mine}
    outcomes.update(merged.outcomes)
    so_far = report_so_far(e.report_dir, e.started_wall) if e.command is None else None
    report = _with_diagnosis(e, so_far, traces, outcomes, findings, hang_findings=e.findings if e.hung else None,
                             traced=bool(traces), remote=merged)
    # The run analysis keeps a hang finding only where a rank still ran: these are the job's own findings.
    if so_far is None and traces:
        report.findings += [f for f in findings if f not in report.findings]
    from distcheck.analysis.progress import progress_by_rank

    progress = {**merged.progress, **progress_by_rank(traces)}
    report.findings = fold_node_consequences(report.findings, progress)
    if e.hung:
        report.artifacts.update(_STACKS)
    report.artifacts.setdefault(f"node-{env.host}", f"node-{env.host}")  # this node's own stacks
    # The other nodes' files stay on their nodes: where, by host.
    report.data["nodes"] = nodes_json(merged, env, str(e.report_dir.resolve()))
    return Publication(report, e.report_dir, False, findings, traces=traces, trace_dir=e.report_dir)


def fold_node_consequences(findings: list[Finding], progress: dict) -> list[Finding]:
    """Node 0's findings with the consequences folded into their cause, as on one node: a rank that failed or died
    in or after a collective that differs across nodes failed because of it; a rank that only lost its peer, while
    that peer's node sent nothing, is not the cause either (the silent node is: its own report says why)."""
    from distcheck.analysis.torch_errors import brief, lost_peer

    crossed = [f for f in findings if f.kind == "collective_mismatch" and f.detail.get("across_nodes")
               and f.detail.get("position")]
    silent = next((f for f in findings if f.kind == "rank_failure" and f.detail.get("silent_nodes")), None)
    out = []
    for f in findings:
        if f.kind != "rank_failure" or f is silent:
            out.append(f)
            continue
        cause = next((x for x in crossed if all(_in_or_after(progress.get(r), x) for r in f.ranks)), None)
        said = f.detail.get("error") or ""
        if cause is None and silent is not None and said and lost_peer(said):
            cause = silent
        if cause is None:
            out.append(f)
            continue
        what = brief(said) if said else None
        cause.message += (f"; then {format_ranks(f.ranks)} " + (f"failed ({what})" if what else
                                                                "failed" if said else "died") + " there")
        cause.detail.setdefault("consequences", []).append({"ranks": f.ranks, "message": f.message})
    return out


def _in_or_after(p, mismatch: Finding) -> bool:
    """Whether a rank's last collective is the mismatched one (or a later one of its group)."""
    last = p.last_started if p is not None else None
    return (last is not None and last.seq is not None and last.group == mismatch.detail.get("group_name")
            and last.seq >= int(mismatch.detail["position"]))


def _with_diagnosis(e: Evidence, so_far: Report | None, traces: dict[int, RankTrace], outcomes: dict,
                    findings: list[Finding], hang_findings: list[Finding] | None, traced: bool,
                    remote: MergedNodes | None = None) -> Report:
    """The report so far with the watcher's diagnosis and check added; else the run's report from the ranks'
    files; else (no rank got as far as its trace: ``traced`` False) the diagnosis alone."""
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report
    from distcheck.supervise import run_report

    check = CheckResult(_CHECK_OF[e.ending], False, e.check_seconds, note=e.note)
    if so_far is not None:
        so_far.findings = superseded_by_diagnosis(so_far) + findings
        so_far.checks.append(check)
        return so_far
    if not traced:
        return Report(command="distcheck (under torchrun)", world_size=e.world_size, findings=findings,
                      checks=[check])
    report = run_report.build_report(e.report_dir, e.command or command_of(traces), e.world_size, traces, outcomes,
                                     e.timeout, e.seconds, hang_findings=hang_findings, stop_reason=e.note,
                                     warnings=e.warnings, remote=remote)
    report.findings = without_lost_peers(report.findings, findings)
    return report


def without_lost_peers(found: list[Finding], diagnosis: list[Finding]) -> list[Finding]:
    """A stop's diagnosis places a rank whose collective failed only because another rank ended first on the stop
    (node_watcher.diagnose_stop: ``lost_peer_ranks``) where it waited: its own rank_failure ("gloo lost its
    connection") is that diagnosis's consequence, not a finding of its own."""
    lost = {r for f in diagnosis for r in f.detail.get("lost_peer_ranks", ())}
    return [f for f in found if not (lost and f.kind == "rank_failure" and f.ranks and set(f.ranks) <= lost)]


def ended_run_report(report_dir: Path, command: str, world_size: int, timeout: float, seconds: float,
                     agent: int | None, require_traces: bool = False) -> Built:
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
    return Built(run_report.build_report(report_dir, command, world_size, traces, outcomes, timeout, seconds), traces)


def with_attempts(report: Report, report_dir: Path) -> dict[Path, Built]:
    """A restarted torchrun job's report lists every attempt (the earlier ones from their folders); its verdict and
    exit code are the last attempt's. Returns the earlier attempts' reports built from their files, where their
    watcher could not leave one (it ended with that attempt's ranks before writing, or wrote it after the next
    attempt had moved the files): they are written there too."""
    from distcheck.contract.report import load_report

    earlier = files.attempt_dirs(report_dir)
    built: dict[Path, Built] = {}
    if not earlier:
        return built
    rows = []
    for attempt, folder in earlier.items():
        try:
            if (folder / files.REPORT_JSON).exists():
                old = load_report(folder)
            else:
                built[folder] = ended_run_report(folder, report.command, report.world_size, 0.0, 0.0, None,
                                                 require_traces=True)
                old = built[folder].report
        except Exception as exc:  # neither its report nor a readable trace
            log.warning("attempt %d: no report: %s", attempt, exc)
            rows.append({"attempt": attempt, "ok": None, "summary": "no report (see its files)",
                         "folder": folder.name})
            continue
        rows.append({"attempt": attempt, "ok": old.ok, "summary": verdict_line(old), "folder": folder.name})
    rows.append({"attempt": len(earlier) and max(earlier) + 1, "ok": report.ok, "summary": verdict_line(report),
                 "folder": "."})
    report.data["attempts"] = rows
    report.sections["attempts (torchrun --max-restarts; the verdict is the last one's)"] = "\n".join(
        f"attempt {r['attempt']}: {r['summary'][:300]}" + (f" ({r['folder']}/)" if r["folder"] != "." else "")
        for r in rows)
    for folder in earlier.values():
        report.artifacts.setdefault(folder.name, folder.name)
    return built


def verdict_line(report: Report) -> str:
    """PASSED, or the finding that names a line of the user's code (the cause: a rank that raised, before a rank
    torchrun killed before it could say where it was), else the first."""
    if report.ok:
        return "PASSED"
    if not report.findings:
        return "FAILED"
    return next((f for f in report.findings if f.detail.get("line")), report.findings[0]).message


def superseded_by_diagnosis(report: Report) -> list[Finding]:
    """The findings of a command's report so far (consistency's: what completed before the run stopped) that stay
    once the watcher's own diagnosis joins them: all but the one saying which check was interrupted (a
    rank_failure naming a check the report marks "interrupted"), which the diagnosis says better."""
    interrupted = {c.name for c in report.checks if c.note == "interrupted"}
    return [f for f in report.findings if not (f.kind == "rank_failure" and f.detail.get("check") in interrupted)]


def command_of(traces: dict[int, RankTrace]) -> str:
    """The user's distcheck command, from a rank's argv in its trace."""
    for trace in traces.values():
        argv = trace.meta.get("argv") or []
        if len(argv) > 1 and str(argv[0]).endswith("__main__.py"):
            return "distcheck " + " ".join(map(str, argv[1:]))
    return "distcheck (under torchrun)"


def written_since(out_dir: Path, since: float) -> bool:
    """Whether ``out_dir``'s report.json was written after ``since`` (time.time()), by this job."""
    try:
        return (out_dir / files.REPORT_JSON).stat().st_mtime >= since - 1.0
    except OSError:
        return False


def report_so_far(out_dir: Path, since: float | None = None) -> Report | None:
    """The report a command wrote before the watcher's (consistency's rank 0: what completed), or None."""
    from distcheck.contract.report import load_report

    if not (out_dir / files.REPORT_JSON).exists() or since is not None and not written_since(out_dir, since):
        return None
    try:
        return load_report(out_dir)
    except Exception:  # a report being rewritten right now, or not ours: start a fresh one
        return None


def compare_nodes(env: NodeEnv, summaries: Mapping[int, NodeSummary],
                  answer: Callable[[dict[int, list]], dict[int, dict]]) -> list[Finding]:
    """Collectives compared op by op across nodes: the digests of every node's summary first, then the signatures
    of the first differing window of each group, asked of the nodes whose ranks differ there (``answer``: the
    store under torchrun, the nodes' own folders for ``distcheck report``)."""
    from distcheck.analysis.collective_digests import (RankDigests, cross_node_divergence, event_from_json,
                                                       first_windows)

    # Ranks with the same digests share one decoded entry (contract/node_summary's digest_table): decoded once
    decoded: dict[int, RankDigests] = {}

    def rank_digests(d: Any) -> RankDigests:
        got = decoded.get(id(d))
        if got is None:
            got = decoded[id(d)] = RankDigests.from_json(d)
        return got

    digests = {int(r): {g: rank_digests(d) for g, d in groups.items()}
               for s in summaries.values() for r, groups in s.digests.items()}

    def node_of(rank: int) -> int:
        return rank // max(env.local_world_size, 1)

    asks = first_windows(digests, node_of)
    if not asks:
        return []
    by_node: dict[int, list] = {}
    for ask in asks:
        for node in sorted({node_of(r) for r in ask.ranks}):
            by_node.setdefault(node, []).append(ask)
    answers = answer(by_node)
    hosts = {n: s.host for n, s in summaries.items()}
    out = []
    for ask in asks:
        events = {}
        for r in ask.ranks:
            sent = (answers.get(node_of(r)) or {}).get(str(r), {}).get(ask.group)
            if sent is not None:
                events[r] = {int(p): event_from_json(r, e) for p, e in sent.items()}
        finding = cross_node_divergence(ask, events, lambda r: hosts.get(node_of(r), f"node {node_of(r)}"))
        if finding is None and len(events) < len(ask.ranks):
            silent = sorted({node_of(r) for r in ask.ranks if r not in events})
            finding = Finding("collective_mismatch", sorted(ask.ranks), (
                f"collectives #{ask.lo + 1} to #{ask.hi} on group {ask.group} differ across nodes (their signatures' "
                f"digests differ), but node{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not "
                f"say what its ranks issued there: compare the traces in each node's report dir"),
                {"group_name": ask.group, "window": [ask.lo + 1, ask.hi], "across_nodes": True})
        if finding is not None:
            out.append(finding)
    return out


def remote_findings(got: Mapping[int, NodeSummary], env: NodeEnv) -> list[Finding]:
    """What the other nodes' own reports found about their ranks alone (a collective mismatch among them, a
    zero-code check), which their states do not carry."""
    out = []
    for node, summary in sorted(got.items()):
        mine = set(summary.ranks)
        for data in summary.findings:
            try:
                f = Finding.from_json(data)
            except (KeyError, TypeError, ValueError):
                continue
            if f.kind not in ("rank_failure", "hang") and set(f.ranks) <= mine:
                f.detail.setdefault("node", summary.host)
                out.append(f)
    return out


def job_report_from_nodes(dirs: list[Path]) -> Report | None:
    """``distcheck report nodeA/rep nodeB/rep``: the job's report as node 0's watcher would have composed it, from
    each node's own folder (``node-<host>/summary.json``, written before any exchange) and node 0's ranks' files,
    for a job whose exchange failed or whose watchers were killed. None unless the folders hold node 0's summary
    and at least one other node's."""
    from distcheck.analysis.rank_outcomes import STATE_STOPPED
    from distcheck.contract import node_summary
    from distcheck.supervise.node_exchange import NodeEnv, merge_summaries, window_answer

    found: dict[int, tuple[NodeSummary, Path]] = {}
    for d in dirs:
        for folder in [d, *sorted(d.glob("node-*"))]:
            summary = node_summary.read(folder)
            if summary is not None and summary.job:
                found.setdefault(summary.node, (summary, d))
    if 0 not in found or len(found) < 2:
        return None
    own, node0_dir = found[0]
    env = NodeEnv.from_json(own.job)
    others = {n: s for n, (s, _) in found.items() if n != 0}
    hung = any(s.hung for s, _ in found.values())
    merged = merge_summaries(others, [n for n in range(env.nnodes) if n != 0], env.node_ranks, hung)

    def answer(asks: dict[int, list]) -> dict[int, dict]:
        out = {}
        for node, node_asks in asks.items():
            if node in found:
                s, folder = found[node]
                out[node] = window_answer(folder, node_asks, s.ranks)
        return out

    findings = [] if hung else compare_nodes(env, {n: s for n, (s, _) in found.items()}, answer)
    findings += remote_findings(others, env)
    stopped = {r for r, st in own.states.items() if st.state == STATE_STOPPED}
    so_far = report_so_far(node0_dir)
    e = Evidence(HANG if hung else ENDED, node0_dir, node0_dir, env.world_size,
                 so_far.data.get("timeout", 0.0) if so_far is not None else 0.0, 0.0, 0.0,
                 findings=findings, running=stopped, command=so_far.command if so_far is not None else None,
                 nodes=Nodes(env, merged, 0.0))
    if hung:
        e.findings = [job_hang(e, env, merged, False)] + findings
    report = _job_report(e, e.nodes).report
    report.data["merged_from"] = [str(d) for d in dirs]
    return report


def job_hang(evidence: Evidence, env: NodeEnv, merged: MergedNodes, native: bool) -> Finding:
    """The job's one hang finding, from the stacks of every node (this node's stacks.json and the ones the others
    sent), grouped together; stacks.txt/.json of the whole job go to the report dir."""
    from distcheck.analysis.progress import progress_by_rank
    from distcheck.analysis.trace_events import load_traces
    from distcheck.supervise.hang import hang_from_stacks
    from distcheck.supervise.node_exchange import merge_stack_documents, stacks_from_document
    from distcheck.supervise.stacks import load_stacks_document

    report_dir, timeout = evidence.report_dir, evidence.timeout
    traces = {r: t for r, t in load_traces(report_dir).items() if r in set(env.ranks)}
    progress = progress_by_rank(traces)
    progress.update(merged.progress)
    docs = []
    local_stacks = report_dir / f"node-{env.host}" / files.STACKS_JSON
    if local_stacks.exists():
        docs.append(load_stacks_document(local_stacks))
    docs += [stacks_from_document(d) for d in merged.stack_docs]
    stacks, errors, _, clashes = merge_stack_documents(docs)
    hosts = {env.host: env.ranks, **{merged.hosts[n]: env.node_ranks(n) for n in merged.hosts}}
    return hang_from_stacks(
        stacks, errors, progress, env.world_size, timeout, f"no progress for {timeout:g}s: ", native=native,
        out_dir=report_dir, title=f"distcheck watchdog: no progress for {timeout:g}s (stacks of {len(hosts)} "
        f"nodes: {', '.join(sorted(hosts))})", notes=clashes + merged.notes)
