"""How each rank of a run ended and where it was: its outcome, its position, its failure as a finding, and the hang
as the traces show it.

    from distcheck.analysis.rank_outcomes import RankOutcome, STATE_OK, failure_findings, position_of
    python -m pytest -q tests/unit/test_progress.py tests/unit/test_torch_errors.py

A rank's outcome (STATE_*) is the supervisor's (supervise/run_report.py, supervise/node_exchange.py); where it is
(last started, last completed, the collective it waits on) is analysis/progress.py's. Ranks that raised the same
error at the same line make one ``rank_failure``, with every other rank's position; a torch error is put in the
user's terms (analysis/torch_errors.py). Pure: no process group, no file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from distcheck.analysis.group_sequences import cut_note, group_label
from distcheck.analysis.hang import hang_finding
from distcheck.analysis.progress import FAILED, ISSUED, ISSUED_NOTE, CollectiveRef, RankProgress, progress_by_rank
from distcheck.analysis.torch_errors import brief, first_line, translate, worker_error
from distcheck.analysis.trace_events import RankError, RankTrace
from distcheck.contract.findings import Finding, format_ranks

STATE_OK = "ok"  # the script returned
STATE_ERROR = "error"  # the script raised
STATE_DIED = "died"  # ended without its exit record (signal, os._exit, segfault)
STATE_HUNG = "hung"  # still running at the no-progress timeout; killed by distcheck
STATE_STOPPED = "stopped"  # killed by distcheck: waited in a collective that provably could not complete
STATE_UNKNOWN = "unknown"


@dataclass
class RankOutcome:
    rank: int
    state: str
    exit_code: int | None = None
    signal: str | None = None
    error: RankError | None = None


# A rank that ended with neither its exit record nor a signal distcheck saw: it never got back from its script.
UNFINISHED = "ended without finishing its script: os._exit or a signal"
# Under torchrun the agent, not distcheck, reaps the ranks: a rank without its exit record has no exit code here.
UNKNOWN_EXIT = "SIGKILL, the OOM killer, a hard crash; only torchrun's agent saw its exit code"


def unfinished(o: RankOutcome) -> str:
    return f"{UNFINISHED} ({f'exit code {o.exit_code}' if o.exit_code is not None else UNKNOWN_EXIT})"


def state_phrase(o: RankOutcome | None) -> str:
    if o is None or o.state == STATE_UNKNOWN:
        return "never reported back"
    return {STATE_OK: "finished its script", STATE_ERROR: "raised", STATE_DIED: "died",
            STATE_HUNG: "was still running", STATE_STOPPED: "was stopped while waiting"}.get(o.state, o.state)


def failure_text(o: RankOutcome) -> str:
    if o.error is not None:
        return f"{o.error.exc_type}: {o.error.message}"
    if o.signal:
        return f"died from {o.signal} (exit code {o.exit_code})"
    if o.state == STATE_ERROR:
        return f"raised (exit code {o.exit_code})"
    return unfinished(o)


def _ref_json(ref: CollectiveRef | None) -> dict[str, Any] | None:
    if ref is None:
        return None
    return {**(ref.event.to_json() if ref.event is not None else ref.to_json()), "state": ref.state}


def _ref_where(ref: CollectiveRef) -> str:
    return f" at {ref.site}" if ref.site else ""


def position_of(rank: int, progress: RankProgress | None, outcome: RankOutcome | None) -> dict[str, Any]:
    """Where a rank is: its state, the collective it waits in (if any), its last started and completed ones."""
    p = progress if progress is not None else RankProgress(rank)
    return {
        "state": outcome.state if outcome is not None else STATE_UNKNOWN,
        "waiting_in": _ref_json(p.pending),
        "last_started": _ref_json(p.last_started),
        "last_completed": _ref_json(p.last_completed),
        "started": p.started,
        "completed": p.completed,
    }


def describe_position(rank: int, progress: RankProgress | None, outcome: RankOutcome | None,
                      trace: RankTrace | None = None) -> str:
    p = progress if progress is not None else RankProgress(rank)
    if outcome is not None and outcome.state == STATE_OK:
        return f"rank {rank} finished its script"
    pending = p.pending  # the first op not completed: later async ops queue behind it
    if pending is not None:
        return (f"rank {rank} waits in {pending.op} #{pending.seq} on group {group_label(pending.pg)}"
                f"{_ref_where(pending)}")
    last = p.last_started
    if last is not None and last.state == FAILED:
        return (f"rank {rank} failed in {last.op} #{last.seq} on group {group_label(last.pg)}{_ref_where(last)} "
                f"({brief(last.error or '') or first_line(last.error or '', 80)})")
    if last is not None and last.state == ISSUED:
        return (f"rank {rank} is outside traced collectives, last issued {last.op} #{last.seq} on group "
                f"{group_label(last.pg)}{_ref_where(last)} ({ISSUED_NOTE})")
    done = p.last_completed
    if done is not None:
        return f"rank {rank} is outside collectives, last completed {done.op} #{done.seq}{_ref_where(done)}"
    if trace is not None and not trace.flight_dumped:
        # What DDP's Reducer or a compiled graph issued reaches the report through the ring's dump only (an
        # os._exit or a SIGKILL skips it): not seen is not "none".
        return (f"rank {rank} issued no traced collective (what torch issued for it, DDP's or compiled code's, "
                "is unknown: its Flight Recorder ring was never dumped)")
    return f"rank {rank} issued no collective"


def _translation(o: RankOutcome, traces: dict[int, RankTrace],
                 progress: dict[int, RankProgress]) -> dict[str, Any] | None:
    """A rank's error in terms of its model and trace (analysis/torch_errors.py), or None for an unknown error."""
    if o.error is None:
        return None
    trace = traces.get(o.rank)
    return translate(o.error.exc_type, o.error.message,
                     {**(o.error.context or {}), "events": trace.events if trace is not None else [],
                      "progress": progress.get(o.rank)})


def _same_error_key(o: RankOutcome, translated: dict[str, Any] | None) -> tuple | None:
    """Ranks whose failures have this key failed with one cause (the same error at the same line); None: its own."""
    err = o.error
    if err is None or o.signal:
        return None
    text = (translated or {}).get("message") or re.sub(r"\brank \d+", "rank N", first_line(err.message),
                                                         flags=re.IGNORECASE)
    return (err.exc_type, err.file, err.line, text)


def failure_findings(failed: list[RankOutcome], traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                     progress: dict[int, RankProgress] | None = None) -> list[Finding]:
    """One ``rank_failure`` per cause: ranks that raised the same error at the same line are one finding."""
    progress = progress if progress is not None else progress_by_rank(traces)
    groups: dict[Any, list[tuple[RankOutcome, dict[str, Any] | None]]] = {}
    for o in failed:
        translated = _translation(o, traces, progress)
        key = _same_error_key(o, translated)
        groups.setdefault(key if key is not None else ("rank", o.rank), []).append((o, translated))
    return [failure_finding(members[0][0], traces, outcomes, [o.rank for o, _ in members], members[0][1], progress)
            for members in groups.values()]


def failure_finding(o: RankOutcome, traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                    ranks: list[int] | None = None, translated: dict[str, Any] | None = None,
                    progress: dict[int, RankProgress] | None = None) -> Finding:
    """The failure of rank ``o`` (and of ``ranks``, which failed the same way), with where every other rank was;
    ``translated``: its error in the user's terms (analysis/torch_errors.py), torch's text kept in detail."""
    progress = progress if progress is not None else progress_by_rank(traces)
    ranks = sorted(ranks or [o.rank])
    everyone = sorted(set(traces) | set(outcomes))
    others = [r for r in everyone if r not in ranks]
    detail: dict[str, Any] = {"exit_code": o.exit_code, "signal": o.signal,
                              "positions": {r: position_of(r, progress.get(r), outcomes.get(r)) for r in everyone}}
    whose = ""  # "'s DataLoader worker 0": the process of the rank that raised, when not the rank itself
    if o.error is not None:
        err = o.error
        detail.update(exception=err.exc_type, error=err.message, traceback=err.traceback)
        where = f" at {err.site}" if err.site else ""
        what = f"raised {err.exc_type}: {first_line(err.message)}{where}"
        worker = worker_error(err.message)
        file, line = err.file, err.line
        if translated and translated.get("message"):  # torch's text stays in detail["error"]
            what = f"raised {err.exc_type}{where}: {translated['message']}"
            detail.update(translated.get("detail") or {})
        elif worker is not None and worker.site:  # the worker's own line, not the main process's `for x in loader`
            whose = f"'s DataLoader worker {worker.worker}"
            what = (f"raised {worker.exc_type}: {worker.text} at {worker.site} (in {worker.func}), re-raised in the "
                    f"rank{where}")
            detail.update(worker=worker.worker, loader_file=err.file, loader_line=err.line)
            file, line = worker.file, worker.line
        if line is not None:
            detail.update(file=file, line=line)
    elif o.signal:
        what = f"died from {o.signal}" + (f" (exit code {o.exit_code})" if o.exit_code is not None else "")
    elif o.state == STATE_ERROR:  # its exit record says it raised, but the error line was lost (a full disk)
        what = (f"raised an exception (exit code {o.exit_code}) whose traceback could not be written to the report "
                "directory (see the rank's console output)")
    else:  # no exit record and no signal: os._exit(), or a signal handler that exited
        what = unfinished(o)
    p = progress.get(o.rank)
    last = p.last_started if p is not None else None
    if o.error is None and last is not None:
        what += f" after {last.op} #{last.seq}{_ref_where(last)}"
        if last.line and "line" not in detail:
            detail.update(file=last.file, line=last.line)
    if len(ranks) == 1 and o.error is None:
        what += cut_note(traces.get(o.rank))
    positions = "; ".join(describe_position(r, progress.get(r), outcomes.get(r), traces.get(r))
                          + cut_note(traces.get(r)) for r in others)
    message = f"{format_ranks(ranks)}{whose} {what}" + (f"; {positions}" if positions else "")
    if len(ranks) > 1:
        detail["errors"] = {r: outcomes[r].error.message for r in ranks
                            if r in outcomes and outcomes[r].error is not None}
    return Finding("rank_failure", ranks, message, detail)


def hang_from_traces(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome], timeout: float,
                 progress: dict[int, RankProgress] | None = None) -> Finding:
    """No progress for ``timeout`` seconds: every rank's position, from the traces alone."""
    progress = progress if progress is not None else progress_by_rank(traces)
    ranks = sorted(set(traces) | set(outcomes))
    hung = [r for r in ranks if outcomes.get(r) is not None and outcomes[r].state == STATE_HUNG] or ranks
    positions = {r: position_of(r, progress.get(r), outcomes.get(r)) for r in ranks}
    site = None
    for r in hung:
        pending = progress[r].pending if r in progress else None
        if pending is not None and pending.line:
            site = (pending.file, pending.line)
            break
    message = (f"no progress for {timeout:g}s: "
               + "; ".join(describe_position(r, progress.get(r), outcomes.get(r), traces.get(r))
                           + cut_note(traces.get(r)) for r in ranks))
    return hang_finding(hung, message, timeout=timeout, progress=progress, site=site, positions=positions)
