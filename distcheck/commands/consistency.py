"""Pre-launch consistency check: environment, collectives, model replicas, parallel vs 1-rank reference.

    torchrun --nproc-per-node 2 -m distcheck consistency
    torchrun --nproc-per-node 8 -m distcheck consistency --model my_pkg.model:build --parallel fsdp --steps 3
    torchrun --nproc-per-node 2 -m distcheck consistency --model path/to/model.py:build --report-dir out/

Exit code 0: every check passed; 1: findings (see report.txt / report.json); 2: bad input.
Run without torchrun it is a 1-rank check, and the report says which checks mean nothing there.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distcheck.contract import files
from distcheck.errors import UsageError
from distcheck.options import (BUILTIN_MODEL, PARALLEL_MODES, ConsistencyOptions, backstop, count, seconds,
                               tolerance)
from distcheck.contract.report import Report, command_line, default_report_dir, load_report, prepare_report_dir

if TYPE_CHECKING:
    from distcheck.rank.bootstrap import NodeWatcher
    from distcheck.rank.checks import consistency
    from distcheck.rank import runtime

# How long rank 0 waits for its node watcher to publish the report it handed over before it publishes it itself
# (a watcher that is gone or stuck). Publishing takes milliseconds; torchrun's grace after SIGTERM is 30 s.
HANDOVER_LIMIT = 10.0

# torch (and FSDP2's torch._dynamo) is imported only once the options are valid: bad input exits 2 in a fraction
# of a second instead of after seconds of imports.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=BUILTIN_MODEL, metavar="MODULE_OR_FILE:FACTORY",
                        help="pkg.module:fn or path/to/file.py:fn returning an unparallelized nn.Module "
                             "(default: the built-in small transformer)")
    parser.add_argument("--parallel", default="fsdp", choices=PARALLEL_MODES,
                        help="fsdp: FSDP2 fully_shard per block and root (default); ddp; tp (built-in model)")
    parser.add_argument("--steps", default=3, help="optimizer steps compared with the reference")
    parser.add_argument("--report-dir", default=None, help="default: ./distcheck-report-<timestamp>/")
    parser.add_argument("--timeout", default=300.0,
                        help="no-progress limit in seconds: then every rank's stack is dumped and the run ends")
    parser.add_argument("--native", action="store_true", help="include native frames in hang stack dumps")
    parser.add_argument("--rtol", default=None, help="relative tolerance (default: by dtype)")
    parser.add_argument("--atol", default=None, help="absolute tolerance (default: by dtype)")


def _on_sigterm(signum, frame):
    from distcheck.rank.checks import consistency

    raise consistency.Terminated()


def _shared_report_dir(session: runtime.Session, given: Path | None) -> Path:
    """Every rank needs the same directory (traces, the node watcher): rank 0 names the default one."""
    if given is not None:
        return given
    name = session.channel.exchange("report-dir", str(default_report_dir()) if session.rank == 0 else None)[0]
    return prepare_report_dir(name)


def _clear_earlier_run(session: runtime.Session, report_dir: Path) -> None:
    if session.rank == 0:
        files.clear_shared(report_dir)


def options(args: argparse.Namespace) -> ConsistencyOptions:
    return ConsistencyOptions(args.model, args.parallel, count("--steps", args.steps), seconds("--timeout", args.timeout),
                              args.report_dir, args.native, tolerance("--rtol", args.rtol),
                              tolerance("--atol", args.atol), command_line(args.argv))


def main(args: argparse.Namespace) -> int:
    opts = options(args)
    given = prepare_report_dir(opts.report_dir) if opts.report_dir else None
    from distcheck.rank.checks import consistency
    from distcheck.rank.checks.models import load_factory
    from distcheck.rank import runtime

    load_factory(opts.model)  # bad --model fails here, on every rank, before any rank waits for another
    bound = backstop(opts.timeout)
    check_options = dataclasses.replace(opts, timeout=bound)  # the checks' waits end at the backstop
    session = runtime.start(bound)
    watcher = None
    report_dir = None
    try:
        report_dir = _shared_report_dir(session, given)
        _clear_earlier_run(session, report_dir)
        from distcheck.rank.bootstrap import rank_bootstrap

        # Traces (progress, last collectives) and, on local rank 0, a watcher process outside the ranks that dumps
        # every rank's stack with py-spy when nothing moves for --timeout seconds, even if a rank holds the GIL.
        watcher = rank_bootstrap(report_dir, opts.timeout, native=opts.native)
        return _run(opts, session, check_options, report_dir, watcher)
    finally:
        from distcheck.rank import tracer as trace

        # The run is over: nothing left to watch. The watcher goes first: once rank 0's hook file is gone it counts
        # rank 0 as ended, and a rank 0 that ended with no report (bad --model found mid-run, which removes it) was
        # reported by the watcher as "rank 0 ended before writing the report" when it looked in between.
        if watcher is not None:
            watcher.stop()
        trace.uninstall()
        if report_dir is not None:  # this rank's hook file, empty dump files and progress counter are not artifacts
            from distcheck.contract import files
            from distcheck.rank.stack_hooks import remove_rank_hooks

            remove_rank_hooks(report_dir, session.rank)
            files.rank_file(report_dir, "flight_status", session.rank).unlink(missing_ok=True)
        runtime.stop(session)


def _run(opts: ConsistencyOptions, session: runtime.Session, check_options: ConsistencyOptions,
         report_dir: Path, watcher: NodeWatcher | None = None) -> int:
    """The checks, then the report. Rank 0 composes it and hands it to its node watcher, which publishes it
    (:func:`_hand_over`): one process writes every report of a watched job."""
    from distcheck.rank.checks import consistency

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    ctx = consistency.Context(session, check_options)
    current = {"check": consistency.CHECKS[0].name}

    def before_check(name: str, results: list) -> None:
        current["check"] = name
        if session.rank == 0:  # a report that survives SIGKILL: how far the run got
            partial = consistency.interrupted_report(
                session, check_options, ctx, name, "the process was killed before it finished (by a signal, the "
                "launcher after another rank failed, or the watchdog)", [])
            partial.artifacts.update(consistency.report_files(report_dir))
            _hand_over(partial, report_dir, watcher, final=False)

    try:
        try:
            local, ctx = consistency.run_checks(session, check_options, ctx, before_check)
            report = consistency.build_report(session, check_options, local, ctx)
        except UsageError:
            # Bad input found mid-run (a factory that raises): exit 2 with its message, and no partial report
            # pretending the run was killed.
            if session.rank == 0:
                _hand_over(None, report_dir, watcher)
            raise
        except consistency.Terminated:
            behind = consistency.ranks_behind(session)
            gone = [] if behind else _ranks_gone(report_dir, session.rank)
            why = "torchrun stopped this rank (SIGTERM), typically because another rank exited"
            if behind:
                why += f"; rank {session.rank} was waiting for rank(s) {','.join(map(str, behind))}, which never " \
                       f"arrived (see torchrun's output for their exit code)"
            elif gone:  # stopped before it waited for anyone (a slow rank 0): who had died is still known here
                why += f"; rank(s) {','.join(map(str, gone))} on this host had exited before rank {session.rank} " \
                       f"reached the check's exchange (see torchrun's output for their exit code)"
                behind = gone
            report = consistency.interrupted_report(session, check_options, ctx, current["check"], why, behind)
            if session.rank == 0:
                watched = _watchdog_report(report_dir)
                if watched is not None:  # the watchdog ended the run: its diagnosis is the report
                    _echo(watched, report_dir)
                else:
                    _write(report, report_dir, watcher)
            else:  # rank 0 may have died (SIGKILL) right after handing over what completed: torchrun waits for this
                from distcheck.rank.entry import wait_for_handed_report

                wait_for_handed_report(report_dir)
            return 1
        if session.rank == 0:
            _write(report, report_dir, watcher)
        try:
            # Nobody exits before rank 0 has written: torchrun kills the other ranks when one exits non-zero.
            session.channel.exchange("consistency/done", True, timeout=min(opts.timeout, 60.0))
        except Exception:
            pass
        return report.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ranks_gone(report_dir: Path, rank: int) -> list[int]:
    """The other ranks of this torchrun attempt on this host whose process has ended without its normal end: a rank
    removes its stack-hook file when it ends normally, so a hook file whose process is gone is a rank that died."""
    import socket

    from distcheck.contract import stack_hook_file
    from distcheck.processes import agent_pid, alive, restart_count

    if "TORCHELASTIC_RUN_ID" not in os.environ:  # only torchrun's agent tells this job's hook files from stale ones
        return []
    host, agent, attempt = socket.gethostname(), agent_pid(), restart_count()
    return sorted({h.rank for h in stack_hook_file.read_all(report_dir)
                   if h.rank != rank and h.host == host and h.agent == agent
                   and restart_count(h.launch) == attempt and not alive(h.pid)})


def _watchdog_report(report_dir: Path) -> Report | None:
    try:
        report = load_report(report_dir)
    except UsageError:
        return None
    return report if any(c.name == "watchdog" for c in report.checks) else None


def _write(report: Report, report_dir: Path, watcher: NodeWatcher | None) -> None:
    from distcheck.rank.checks import consistency

    report.artifacts.update(consistency.report_files(report_dir))
    report.artifacts.setdefault("report.json", "report.json")
    _hand_over(report, report_dir, watcher)


def _hand_over(report: Report | None, report_dir: Path, watcher: NodeWatcher | None, final: bool = True) -> None:
    """Hand ``report`` (None: withdraw the partial one) to the node watcher, which publishes it
    (contract/report_handoff.py, supervise/report_desk.py). The final one is waited for: the other ranks end only
    once it is written, and so does torchrun. A watcher that is gone, or has not published it within
    HANDOVER_LIMIT: this rank delivers it itself, through the same function the watcher calls."""
    from distcheck.contract import report_handoff

    if final:  # what this rank printed comes before the report, which the watcher prints to the same console
        sys.stdout.flush()
    report_handoff.offer(report_dir, report, final)
    if not final:
        return
    claimer_alive = watcher.running if watcher is not None else (lambda: False)
    if report_handoff.wait_published(report_dir, HANDOVER_LIMIT, claimer_alive):
        return
    from distcheck.supervise.node_report import deliver_handed

    report_handoff.clear(report_dir)
    deliver_handed(report_handoff.Handed(report, final, os.getpid()), report_dir)


def _echo(report: Report, report_dir: Path) -> None:
    """Print a report already written (the watchdog's, which ended the run) as this command's own."""
    from distcheck.contract.report import publish

    publish(report, report_dir, echo=sys.stdout, write=False)
