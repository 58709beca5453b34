"""The one hang-diagnosis path: dump every live rank in parallel, read their traces, write stacks.txt/.json,
and return the one ``hang`` finding (analysis/hang.py composes it).

    python -m distcheck run --nproc 4 --timeout 60 -- train.py    # a watch loop calls diagnose_hang on a hang

Called by the watch loop (supervise/watch.py) of every supervisor, and by the pytest plugin when a test cannot
progress. It never raises: when the dump itself fails, the finding says so, with each rank's last collective
from its trace, in the same shape.

The processes the ranks started (DataLoader workers, a script's own subprocesses, and their children: the ranks'
process trees, supervise/procs.rank_processes) are dumped in the same parallel pass when they run Python, each
attributed to its rank and named by what it is ("rank 1's DataLoader worker 0 (pid 4242)"), so that a rank
blocked on its worker points at the worker's line (analysis/hang.py). distcheck's own (the stderr copies, rank 0's
store host) are left out.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Sequence

from distcheck.analysis.frame_owner import DISTCHECK, owner
from distcheck.analysis.hang import diagnose, hang_finding
from distcheck.analysis.progress import RankProgress, progress_by_rank
from distcheck.analysis.stack_groups import RankStack
from distcheck.contract import files
from distcheck.contract.findings import Finding, format_ranks
from distcheck.supervise.stacks import (DEFAULT_DUMP_TIMEOUT, DumpError, DumpResult, Target, dump_all,
                                       write_stack_artifacts)

log = logging.getLogger("distcheck")


FLIGHT_WAIT = 2.0  # a rank's thread answers within its 0.1 s poll plus the dump (tens of ms for 10k entries)


def request_flight_dumps(report_dir: str | os.PathLike) -> float:
    """Ask every live rank of ``report_dir`` to dump its Flight Recorder ring (rank/flight_recorder.py answers from
    its own thread, while the main thread is blocked); returns the time of the request."""
    asked = time.time()
    try:
        path = os.path.join(report_dir, files.FLIGHT_REQUEST)
        with open(path, "a"):
            pass
        os.utime(path, (asked, asked))
    except OSError as exc:
        log.debug("cannot ask for Flight Recorder dumps: %s", exc)
    return asked


def await_flight_dumps(report_dir: str | os.PathLike, ranks: list[int], asked: float,
                       limit: float = FLIGHT_WAIT) -> set[int]:
    """Wait (bounded) until each rank's dump is newer than the request; returns the ranks that answered. A rank that
    holds the GIL, or was killed, never answers: its memory-mapped trace still says what Python called."""
    deadline = time.monotonic() + limit
    answered: set[int] = set()
    while True:
        for rank in ranks:
            try:
                if files.rank_file(report_dir, "flight", rank).stat().st_mtime >= asked - 0.01:
                    answered.add(rank)
            except OSError:
                pass
        if len(answered) == len(ranks) or time.monotonic() >= deadline:
            return answered
        time.sleep(0.05)


def load_progress(report_dir: str | os.PathLike) -> dict[int, RankProgress]:
    """Each traced rank's progress (analysis/progress.py: last started and completed collective, the one it waits
    on), from its trace."""
    from distcheck.analysis.trace_events import load_traces

    return progress_by_rank(load_traces(report_dir))


def diagnose_hang(rank_pids: dict[int, int], report_dir: str | os.PathLike, native: bool = False,
                  timeout: float | None = None, world_size: int | None = None,
                  dump_timeout: float = DEFAULT_DUMP_TIMEOUT, stem: str = files.STACKS_STEM,
                  out_dir: str | os.PathLike | None = None, stopped_by: str | None = None,
                  after: float | None = None) -> list[Finding]:
    """Dump all ranks in parallel, read their traces, write ``<stem>.txt``/``<stem>.json``; return the hang finding.

    Traces and faulthandler hooks are read from ``report_dir``; stacks are written to ``out_dir`` (default: the
    same). ``stopped_by`` (a signal name): the run did not hang but was stopped from outside ``after`` seconds.
    """
    prefix = (f"the run was stopped from outside by {stopped_by} after {after or 0:.0f}s: " if stopped_by
              else f"no progress for {timeout:g}s: " if timeout else "")
    try:
        found = _diagnose_hang(rank_pids, report_dir, native, timeout, world_size, dump_timeout, stem, out_dir,
                               prefix)
    except Exception as exc:  # never lose the chance to report the hang and end the job
        log.warning("hang diagnosis failed: %s", exc)
        try:
            progress = load_progress(report_dir)
        except Exception:
            progress = {}
        ranks = sorted(rank_pids) or sorted(progress)
        found = [hang_finding(ranks, f"{prefix or 'no progress: '}{format_ranks(ranks) if ranks else 'no rank'} "
                              f"could not be dumped ({exc})", timeout=timeout, progress=progress,
                              errors=[str(exc)])]
    if stopped_by:
        for f in found:
            f.detail["stopped_by"] = stopped_by
    return found


MAX_PROCESSES_PER_RANK = 8  # dumped per rank; more (a DataLoader with 32 workers) are listed, not dumped


def process_targets(rank_pids: dict[int, int], world_size: int | None,
                    report_dir: str | os.PathLike) -> tuple[list[Target], list[str]]:
    """Targets for the Python processes the ranks started (and their children), and one line for each process
    that is not dumped (not Python, or beyond MAX_PROCESSES_PER_RANK)."""
    from distcheck.processes import is_python, proc_name
    from distcheck.supervise.procs import rank_processes

    try:
        found = rank_processes(rank_pids)
    except OSError as exc:  # /proc unreadable: the ranks are still dumped
        log.debug("cannot list the ranks' processes: %s", exc)
        return [], []
    targets: list[Target] = []
    others: list[str] = []
    per_rank: dict[int, int] = {}
    for pid, rank in sorted(found.items(), key=lambda item: (item[1], item[0])):
        name = proc_name(pid)
        if is_python(pid) is False:
            others.append(f"rank {rank}'s child process (pid {pid}, {name}): not Python, not dumped")
            continue
        per_rank[rank] = per_rank.get(rank, 0) + 1
        if per_rank[rank] > MAX_PROCESSES_PER_RANK:
            others.append(f"rank {rank}'s child process (pid {pid}, {name}): not dumped (more than "
                          f"{MAX_PROCESSES_PER_RANK} for this rank)")
            continue
        targets.append(Target(pid, rank, "RANK", world_size, str(report_dir), name, role="child process"))
    return targets, others


def _distchecks_own(stack: RankStack) -> bool:
    """A process of distcheck's own among the ranks' children (rank 0's store host: a fork, so no role variable)."""
    main = stack.main_thread()
    return main is not None and any(not f.native and owner(f.file) == DISTCHECK for f in main.frames)


def _diagnose_hang(rank_pids: dict[int, int], report_dir: str | os.PathLike, native: bool, timeout: float | None,
                   world_size: int | None, dump_timeout: float, stem: str,
                   out_dir: str | os.PathLike | None, prefix: str) -> list[Finding]:
    t0 = time.monotonic()
    targets = [Target(pid, rank, "launcher", world_size, str(report_dir)) for rank, pid in sorted(rank_pids.items())]
    children, others = process_targets(rank_pids, world_size, report_dir)
    # The rings first (what DDP's Reducer or a compiled graph is blocked in), answered while py-spy dumps.
    asked = request_flight_dumps(report_dir)
    dumped = dump_all(targets + children, native=native, timeout=dump_timeout, report_dirs=[report_dir])
    await_flight_dumps(report_dir, sorted(rank_pids), asked)
    result, processes = _split(dumped, {t.pid for t in children}, others)
    return diagnose_dumped(result, processes, others, report_dir, native, timeout, world_size or len(rank_pids) or None,
                           stem, out_dir, prefix, t0)


def diagnose_dumped(result: DumpResult, processes: list[RankStack], others: list[str],
                    report_dir: str | os.PathLike, native: bool, timeout: float | None, world_size: int | None,
                    stem: str, out_dir: str | os.PathLike | None, prefix: str,
                    t0: float | None = None) -> list[Finding]:
    """Everything after the dumps: read the traces' progress, diagnose, write ``<stem>.txt``/``<stem>.json``; the
    hang finding. bench/_scale_hang.py times this on stored dumps, so the bench measures the path a hang takes."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        progress = load_progress(report_dir)
    except Exception as exc:  # a broken trace must not cost us the stacks
        log.warning("could not read traces in %s: %s", report_dir, exc)
        progress = {}
    title = f"distcheck watchdog: {prefix.rstrip(': ')}" if prefix else "distcheck watchdog"
    finding = hang_from_stacks(result.stacks, result.errors, progress, world_size, timeout, prefix, native=native,
                               out_dir=out_dir or report_dir, title=title, stem=stem, processes=processes,
                               others=others)
    finding.detail["dump_seconds"] = round(result.seconds, 3)
    finding.detail["diagnose_seconds"] = round(time.monotonic() - t0, 3)
    return [finding]


def hang_from_stacks(stacks: Sequence[RankStack], errors: Sequence[DumpError], progress: dict[int, RankProgress],
                     world_size: int | None, timeout: float | None, prefix: str, *, native: bool,
                     out_dir: str | os.PathLike, title: str, stem: str = files.STACKS_STEM,
                     processes: Sequence[RankStack] = (), others: Sequence[str] = (),
                     notes: Sequence[str] = ()) -> Finding:
    """The one sequence from stacks to a ``hang`` finding, whoever took them (a watchdog's dump, the stop dumps
    the ranks wrote on torchrun's SIGTERM, the stacks every node sent to node 0): diagnose, compose the finding,
    write ``<stem>.txt``/``<stem>.json`` to ``out_dir`` with the same groups and summary. ``notes``: lines for the
    finding's errors besides the dump errors (a node that sent no stacks, two nodes with the same host name)."""
    errors_by_rank = {e.rank: e.message for e in errors if e.rank is not None}
    diag = diagnose(stacks, progress, world_size, timeout, errors_by_rank, prefix, processes=list(processes))
    finding = diag.to_finding(stacks, progress, [e.message for e in errors] + list(notes))
    finding.detail["artifacts"] = write_stack_artifacts(out_dir, stacks, errors, native, progress, title, stem,
                                                        diag.groups, diag.message, processes, others,
                                                        finding.detail["last_collectives"])
    return finding


def _split(dumped: DumpResult, process_pids: set[int], others: list[str]) -> tuple[DumpResult, list[RankStack]]:
    """The ranks' dump (stacks and errors) apart from their processes' (stacks, minus distcheck's own); a process
    that could not be dumped becomes a line in ``others`` (one that exited meanwhile: nothing)."""
    ranks = DumpResult(seconds=dumped.seconds)
    processes: list[RankStack] = []
    for stack in dumped.stacks:
        if stack.pid not in process_pids:
            ranks.stacks.append(stack)
        elif not _distchecks_own(stack):
            processes.append(stack)
    for error in dumped.errors:
        if error.pid not in process_pids:
            ranks.errors.append(error)
        elif error.kind not in ("exited", "no_such_process", "not_python"):
            others.append(f"rank {error.rank}'s child process (pid {error.pid}): {error.message}")
    return ranks, processes
