"""The report of a ``run``: from the per-rank files and how each rank ended, to report.json and report.txt.

    python -m distcheck run --nproc 2 -- train.py                    # the launcher builds it after the ranks end
    torchrun --nproc-per-node 2 -m distcheck run -- train.py         # the node watcher of rank 0's node builds it

Every run-shaped command (``run`` with ``--nproc`` or under torchrun, each run of ``compare``) ends here: the
outcomes of the ranks, the trace alignment, the findings the ranks emitted, the zero-code checks, and the hang
diagnosis of the watch loop become one Report; contract/report.py writes its files (supervised_run.py under
``--nproc``, supervise/node_report.deliver under torchrun; both through contract/report.publish).
"""
from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from distcheck.analysis.bad_values import fold_first_bad
from distcheck.analysis import stragglers
from distcheck.analysis.check_table import judge
from distcheck.analysis.pipeline_schedule import fold_consequences
from distcheck.contract import samples_file
from distcheck.analysis.rank_outcomes import (STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, STATE_STOPPED,
                                              STATE_UNKNOWN, UNFINISHED, RankOutcome)
from distcheck.analysis.trace_align import analyze_run
from distcheck.analysis.progress import RankProgress, progress_by_rank, rank_progress
from distcheck.analysis.trace_events import RankTrace
from distcheck.contract import files
from distcheck.supervise.chrome_trace import write_chrome_trace
from distcheck.contract.findings import CheckResult, Finding, Note, format_ranks
from distcheck.contract.report import Report
from distcheck.analysis.shared_files import several_writers
from distcheck.analysis.step_counts import add_to_hang as add_uneven_steps
from distcheck.contract import autocheck_file, findings_file, saves_file
from distcheck.contract.stderr_file import tail

log = logging.getLogger("distcheck")


def outcome_from_trace(rank: int, trace: RankTrace | None) -> RankOutcome | None:
    """The outcome a rank wrote itself (its exit line), or None if it never got that far."""
    if trace is None or trace.finished is None:
        return None
    err = trace.errors[-1] if trace.errors else None
    if trace.finished.get("ok"):
        return RankOutcome(rank, STATE_OK, exit_code=0)
    return RankOutcome(rank, STATE_ERROR, exit_code=int(trace.finished.get("code", 1) or 1), error=err)


def build_report(report_dir: Path, command: str, world_size: int, traces: dict[int, RankTrace],
                 outcomes: dict[int, RankOutcome], timeout: float, seconds: float,
                 hang_findings: list[Finding] | None = None, stop_reason: str | None = None,
                 warnings: list[Note] | None = None, remote: Any = None) -> Report:
    """``remote``: what the other nodes sent (supervise/node_exchange.MergedNodes) when the ranks run on several
    nodes and ``traces`` hold this node's only: their ranks' progress and stderr tails join this node's."""
    progress = progress_by_rank(traces)  # once per rank, for every finding and the report's counts
    if remote is not None:
        progress.update({r: p for r, p in remote.progress.items() if r not in traces})
    findings = analyze_run(traces, outcomes, world_size, timeout=timeout, hang_findings=hang_findings,
                           progress=progress)
    findings = merge_same_on_ranks(merge_mesh_errors(findings + findings_file.collect(report_dir)))
    findings += several_writers(saves_file.read_all(report_dir))  # one file, several torch.save writers
    # Zero-code checks: model_check (its time), and the first NaN/Inf merged from every rank's own record.
    auto_findings, auto_checks, auto_notes = report_parts(report_dir)
    findings = fold_first_bad(findings + auto_findings)
    # A script that calls check_model itself gets the same findings from the automatic check: report them once.
    seen: set[tuple] = set()
    findings = [f for f in findings if not ((f.kind, tuple(f.ranks), f.message) in seen
                                            or seen.add((f.kind, tuple(f.ranks), f.message)))]
    # Stages whose schedules disagree fail inside step() with torch's shape errors: the disagreement is the cause.
    findings = fold_consequences(findings)
    add_stderr_tails(report_dir, findings, traces)
    for f in findings:  # ranks that ran different numbers of training steps: what a DDP hang came from
        add_uneven_steps(f, traces, progress)
    if remote is not None:
        findings = without_contradicted(findings, remote, set(traces))
        for f in findings:
            if f.kind in ("rank_failure", "hang"):
                tails = {str(r): remote.stderr_tails[r] for r in f.ranks if r in remote.stderr_tails}
                if tails:
                    f.detail.setdefault("stderr_tail", {}).update(tails)
    mismatch = any(f.kind == "collective_mismatch" for f in findings)
    failed = any(o.state != STATE_OK for o in outcomes.values())
    checks = [CheckResult("collective_order", not mismatch, seconds),
              CheckResult("ranks_completed", not failed, 0.0,
                          note=stop_reason or "")] + auto_checks
    artifacts: dict[str, str] = {}
    for r in sorted(traces):
        name = files.rank_file(report_dir, "trace", r).name
        artifacts[name.removesuffix(".jsonl")] = name
        records = files.rank_file(report_dir, "trace_events", r)
        if records.exists():
            artifacts[records.stem + "-records"] = records.name
    artifacts[files.CHROME_TRACE] = files.CHROME_TRACE  # drawn from ``traces`` when published: write_trace_view
    for kind in ("findings", "autocheck", "stderr", "flight", "samples", "saves"):
        for path in files.rank_files(report_dir, kind).values():
            artifacts[path.stem] = path.name
    outcomes_json = {str(r): {"state": o.state, "exit_code": o.exit_code, "signal": o.signal}
                     for r, o in sorted(outcomes.items())}
    late = stragglers.analyze(traces, samples_file.read_all(report_dir),
                              remote=remote.durations if remote is not None else None)
    return Report(command=command, world_size=world_size, findings=findings, checks=checks, artifacts=artifacts,
                  data={"ranks": outcomes_json, "collectives": {str(r): p.started for r, p in progress.items()},
                        "stragglers": late.to_json()},
                  warnings=list(warnings or []) + auto_notes + incomplete_notes(traces) + late.notes(),
                  sections={"stragglers (who held the others up at each collective)": late.section()})


def write_trace_view(report: Report, report_dir: Path, traces: dict[int, RankTrace]) -> None:
    """``trace.json`` (Perfetto) of a report that lists it, from the traces the report was built from: written by
    whoever publishes the report, so that building one writes nothing. A write that fails leaves it out."""
    if files.CHROME_TRACE not in report.artifacts:
        return
    try:
        write_chrome_trace(traces, Path(report_dir) / files.CHROME_TRACE, end_time=time.time())
    except OSError as exc:
        report.artifacts.pop(files.CHROME_TRACE, None)
        log.warning("could not write %s: %s", files.CHROME_TRACE, exc)


def without_contradicted(findings: list[Finding], remote: Any, local: set[int]) -> list[Finding]:
    """Drop a collective_mismatch that says ranks of another node issued fewer collectives only because their
    traces are on that node: their progress summary says how many they issued on the group."""
    out = []
    for f in findings:
        counts = f.detail.get("counts") if f.kind == "collective_mismatch" else None
        group = f.detail.get("group_name")
        if counts and any(int(r) not in local for r in counts):
            from distcheck.analysis.progress import GroupProgress

            issued = {}
            for r in map(int, counts):
                p = remote.progress.get(r)
                if r not in local and p is not None:
                    g: GroupProgress | None = p.groups.get(str(group)) if group is not None else None
                    issued[r] = g.issued if g is not None else p.started
            if issued and len({*issued.values(), *(int(v) for k, v in counts.items() if int(k) in local)}) == 1:
                continue
        out.append(f)
    return out


def incomplete_notes(traces: dict[int, RankTrace]) -> list[Note]:
    """One warning per rank whose files a full (or failing) report file system cut short: from which collective on
    its trace holds nothing, and which other files lost writes. A warning, not a finding: the script did nothing
    wrong, and what was recorded was checked as usual (a cut trace is compared as far as it goes)."""
    notes: list[Note] = []
    for r, trace in sorted(traces.items()):
        gap = trace.incomplete
        if gap is None:
            continue
        detail: dict[str, Any] = {"from_collective": gap.from_id, "errno": gap.errno, "reason": gap.reason,
                                  "unrecorded": gap.unrecorded, "lost": list(gap.lost)}
        last = next((e for e in reversed(trace.events) if not e.extra.get("untraced")), None)
        if last is not None:
            detail["last_recorded"] = last.to_json()
        if gap.from_id is not None:
            kind = "trace_incomplete"
            message = f"trace of rank {r} is incomplete from collective #{gap.from_id} on: {gap.reason}"
            if gap.unrecorded:
                message += f" ({gap.unrecorded} later collective{'s' if gap.unrecorded != 1 else ''} not recorded)"
            message += "; collectives from there on were not compared"
            lost = [name for name in gap.lost if not name.startswith("trace lines")]
        else:
            kind = "files_incomplete"
            message = f"rank {r} could not write everything into the report directory ({gap.reason})"
            lost = list(gap.lost)
        if lost:
            message += f"; {'also ' if gap.from_id is not None else ''}lost: {', '.join(lost)}"
        notes.append(Note(kind, [r], message, detail))
    return notes


def add_stderr_tails(report_dir: Path, findings: list[Finding], traces: dict[int, RankTrace] | None = None) -> None:
    """Every rank_failure and hang carries the last lines of its ranks' stderr (rank/stderr_tee.py). A rank killed
    by torch itself (NCCL's watchdog aborts the process) said why only there: known texts are translated."""
    from distcheck.analysis.torch_errors import translate

    paths = files.rank_files(report_dir, "stderr")
    for f in findings:
        if f.kind not in ("rank_failure", "hang"):
            continue
        tails = {str(r): lines for r in f.ranks if r in paths and (lines := tail(paths[r]))}
        if tails:
            f.detail["stderr_tail"] = tails
        if f.kind == "rank_failure" and UNFINISHED in f.message and len(f.ranks) == 1:
            # No exception reached the trace (it was raised before the script ran: an import in distcheck's own
            # start-up, a broken environment), but Python printed it: say it.
            raised = last_exception(tails.get(str(f.ranks[0]), []))
            if raised is not None:
                f.message += f"; its stderr ends with: {raised}"
                f.detail["stderr_exception"] = raised
        if not (f.kind == "rank_failure" and f.detail.get("signal") and len(f.ranks) == 1 and f.ranks[0] in paths):
            continue
        trace = (traces or {}).get(f.ranks[0])
        said = translate("", "\n".join(tails.get(str(f.ranks[0]), [])), {"events": trace.events if trace else []})
        if said is not None:
            f.message += f"; its stderr says: {said['message']}"
            f.detail.update(said["detail"])
        crash = crash_site(paths[f.ranks[0]])
        if crash is not None:  # faulthandler printed the Python stack of the fatal signal: name the line
            died = f"died from {f.detail['signal']} (exit code {f.detail.get('exit_code')})"
            where = f" in {crash.name} at {crash.where}"
            f.message = (f.message.replace(died, died + where, 1) if died in f.message
                         else f"{f.message}; it crashed{where}")
            f.detail.update(file=crash.file, line=crash.line, crashed_in=crash.name)


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning))(: .*)?$")


def last_exception(lines: list[str]) -> str | None:
    """The exception line of the last Python traceback in a stderr tail (``ImportError: cannot import name ...``)."""
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()[:300]
    return None


def crash_site(stderr_path: Path):
    """The user's innermost frame in the last "Fatal Python error" stack a rank printed (faulthandler), or None."""
    from distcheck.analysis.stack_groups import innermost_user_frame, parse_faulthandler

    try:
        with open(stderr_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - 256 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    cut = text.rfind("Fatal Python error:")
    if cut < 0:
        return None
    threads = parse_faulthandler(text[cut:])
    current = next((t for t in threads if t.name == "current"), threads[-1] if threads else None)
    return innermost_user_frame(current)


# Findings each rank writes for itself, about the same line of code, whose message does not name the rank.
PER_RANK_CAUSES = frozenset({"async_not_waited", "state_dict_not_loaded"})


def merge_same_on_ranks(findings: list[Finding]) -> list[Finding]:
    """One finding for what several ranks each found at the same line (rank/autocheck/async_work.py), with every
    one of those ranks."""
    first: dict[tuple, Finding] = {}
    out: list[Finding] = []
    for f in findings:
        if f.detail.get("cause") not in PER_RANK_CAUSES:
            out.append(f)
            continue
        key = (f.kind, f.message, f.detail.get("file"), f.detail.get("line"))
        if key in first:
            first[key].ranks = sorted(set(first[key].ranks) | set(f.ranks))
            continue
        first[key] = f
        out.append(f)
    return out


def merge_mesh_errors(findings: list[Finding]) -> list[Finding]:
    """One mesh_mismatch per failing init_device_mesh call (every rank raises the same error), and no
    rank_failure for the ranks whose failure it explains."""
    merged: dict[tuple, Finding] = {}
    out: list[Finding] = []
    for f in findings:
        if f.kind != "mesh_mismatch" or "torch_error" not in f.detail:
            out.append(f)
            continue
        key = (f.detail.get("file"), f.detail.get("line"), f.detail["torch_error"])
        if key in merged:
            first = merged[key]
            ranks = sorted(set(first.ranks) | set(f.ranks))
            first.message = first.message.replace(f"failed on {format_ranks(first.ranks)}",
                                                  f"failed on {format_ranks(ranks)}", 1)
            first.ranks = ranks
            continue
        merged[key] = f
        out.append(f)
    explained = {(r, f.detail["torch_error"].split(":", 1)[0]) for f in merged.values() for r in f.ranks}
    return [f for f in out if not (f.kind == "rank_failure"
                                   and all((r, f.detail.get("exception")) in explained for r in f.ranks))]


def outcomes_from_exits(exits: dict, traces: dict[int, RankTrace],
                        report_dir: Path | None = None) -> tuple[dict[int, RankOutcome], list[Note]]:
    """Each rank's outcome when distcheck launched it: its own exit line, else its exit code or signal.

    A rank that died after its script returned, with every collective complete, did not fail: torch's
    process-group teardown aborted (gloo's "terminate called without an active exception"). That is a warning.
    """
    outcomes: dict[int, RankOutcome] = {}
    notes: list[Note] = []
    for r, ex in exits.items():
        trace = traces.get(r)
        if ex.killed in ("hang", "interrupt"):  # still running when the hang or the stop signal was declared
            outcomes[r] = RankOutcome(r, STATE_HUNG)
            continue
        if ex.killed == "stop":
            outcomes[r] = RankOutcome(r, STATE_STOPPED)
            continue
        own = outcome_from_trace(r, trace)
        if (own is not None and own.state == STATE_OK and ex.returncode not in (0, None)
                and _all_ended(rank_progress(r, trace.events))):
            outcomes[r] = RankOutcome(r, STATE_OK, exit_code=0)
            notes.append(teardown_note(r, ex, report_dir))
            continue
        if own is not None and not (own.state == STATE_OK and ex.returncode not in (0, None)):
            own.exit_code = ex.returncode
            outcomes[r] = own
        elif ex.returncode == 0 and not ended_unfinished(trace):
            outcomes[r] = RankOutcome(r, STATE_OK, exit_code=0)
        else:
            err = trace.errors[-1] if trace is not None and trace.errors else None
            outcomes[r] = RankOutcome(r, STATE_ERROR if err else STATE_DIED, ex.returncode, ex.signal, err)
    return outcomes, notes


def ended_unfinished(trace: RankTrace | None) -> bool:
    """The rank started its script (its meta line) but ended without its exit record, which the tracer writes when
    the script returns or raises: os._exit() or a signal ended it, whatever its exit code says. Where even the
    record file's header could not be written (a full disk from the start), that cannot be told: not unfinished."""
    if trace is None or not trace.meta or trace.finished is not None:
        return False
    return trace.exit_recordable or trace.incomplete is None


def _all_ended(progress: RankProgress) -> bool:
    """No collective of the rank is still waiting to complete."""
    return progress.pending is None


def teardown_note(rank: int, ex: Any, report_dir: Path | None) -> Note:
    how = f"died from {ex.signal}" if ex.signal else f"exited with code {ex.returncode}"
    detail: dict[str, Any] = {"exit_code": ex.returncode, "signal": ex.signal}
    path = files.rank_file(report_dir, "stderr", rank) if report_dir is not None else None
    if path is not None and (lines := tail(path)):
        detail["stderr_tail"] = lines
    return Note("teardown_abort", [rank], f"rank {rank} {how} after its script had returned with every collective "
                f"complete: torch's process-group teardown, not your code", detail)


def outcomes_from_traces(traces: dict[int, RankTrace], world_size: int, hung: bool,
                         running: set[int]) -> dict[int, RankOutcome]:
    """Each rank's outcome under torchrun, where only the traces (and, on one node, pids) tell how ranks ended."""
    outcomes: dict[int, RankOutcome] = {}
    for r in range(world_size):
        trace = traces.get(r)
        o = outcome_from_trace(r, trace)
        if o is None:
            if r in running:
                o = RankOutcome(r, STATE_HUNG if hung else STATE_STOPPED)
            else:
                err = trace.errors[-1] if trace is not None and trace.errors else None
                # Under torchrun only the trace says how a rank ended: no exit line means os._exit or a signal it
                # could not write about (its exit code went to torchrun's agent: trace_align.UNKNOWN_EXIT).
                o = RankOutcome(r, STATE_DIED if trace is not None else STATE_UNKNOWN, error=err)
        outcomes[r] = o
    return outcomes


def clean(report_dir: Path, ranks) -> None:
    """A reused report dir must not mix in an earlier run: per-rank files are appended to."""
    files.remove_rank_files(report_dir, ranks)


def report_parts(report_dir: str | os.PathLike) -> tuple[list[Finding], list[CheckResult], list[Note]]:
    """The zero-code checks' findings, checks (model_check, bad_values, ...) and warnings (parameters on mixed
    meshes in a correct model: what would break, and the fix), from the ranks' autocheck files through
    analysis/check_table.py; a warning every rank wrote is reported once."""
    found = judge(autocheck_file.read_all(report_dir))
    return found.findings, found.checks, found.notes
