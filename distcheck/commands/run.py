"""Run an unmodified script on every rank with collective tracing; report the first diverging collective.

    python -m distcheck run --nproc 2 --timeout 60 --report-dir out -- train.py --lr 0.1
    python -m distcheck run --nproc 2 --steps 5 -- train.py       # replicas compared after 5 steps (default 3)
    torchrun --nproc-per-node 2 -m distcheck run --report-dir out -- train.py --lr 0.1

Every rank runs SCRIPT in-process (as ``__main__``, with sys.argv = [SCRIPT, ARGS...]) with the tracer
installed. At the end, or when ranks fail or stop progressing for --timeout seconds, the per-rank traces are
aligned per process group: the first divergence is a ``collective_mismatch`` naming the position, what each rank
issued there and each rank's source line; a rank that raised or died is a ``rank_failure``; no progress is a
``hang``. Data-parallel replicas that stop being identical within the first --steps optimizer steps are a
``tensor_divergence`` (rank/autocheck/replica_drift.py). The report directory holds report.json, report.txt, trace-rank<R>.jsonl and trace.json (Perfetto).

With --nproc, distcheck starts and supervises the ranks (distcheck/supervise/supervised_run.py) and writes the report
itself, even when ranks crash or hang. Under torchrun each rank runs distcheck/rank/entry.py and only writes files;
each node's watcher (distcheck/supervise/node_watcher.py, a process outside the ranks) watches them, and the one
on the node of rank 0 writes the report once every rank has finished, failed, or stopped progressing.
Exit codes: 0 no findings, 1 findings (also when SIGTERM/SIGINT/SIGHUP stopped the run: the report then says so,
with every rank's stack; a signal after every rank had finished stops nothing and is a warning; a second signal
stops at once without a report: distcheck/supervise/signals.py), 2 bad input (missing script, not a Python file,
bad options).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from distcheck.errors import UsageError
from distcheck.options import ENV_SUPERVISED, RunOptions, check_capacity, count, in_torchrun, seconds

DEFAULT_TIMEOUT = 300.0
DEFAULT_DRIFT_STEPS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", default=None,
                        help="launch this many ranks on this machine (default: 1, or the ranks of torchrun)")
    parser.add_argument("--timeout", default=DEFAULT_TIMEOUT,
                        help="no-progress limit in seconds: after it the run is declared hung (default 300)")
    parser.add_argument("--report-dir", default=None, help="report directory (default: distcheck-report-<time>)")
    parser.add_argument("--native", action="store_true", help="include native frames in hang stack dumps")
    parser.add_argument("--steps", default=None,
                        help="check that data-parallel replicas (DDP, HSDP, TP) still hold identical parameters "
                             "after each of the first K optimizer steps (default 3; 0: do not check)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="start --nproc ranks even when that is more than the machine can run (one per GPU, "
                             "else 4 per CPU core)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                        help="the Python script to run on every rank, and its arguments")


def validate_script(script_args: list[str]) -> tuple[Path, list[str]]:
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    if not script_args:
        raise UsageError("no script given: pass it after --, e.g. distcheck run --nproc 2 -- train.py")
    script = Path(script_args[0])
    if not script.exists():
        raise UsageError(f"script {str(script)!r} does not exist: check the path (relative to {os.getcwd()})")
    if not script.is_file():
        raise UsageError(f"script {str(script)!r} is not a file: pass a Python script such as train.py")
    if script.suffix != ".py":
        try:
            head = script.open("rb").readline(200)
        except OSError as exc:
            raise UsageError(f"script {str(script)!r} cannot be read ({exc.strerror})") from None
        if not (head.startswith(b"#!") and b"python" in head):
            raise UsageError(f"script {str(script)!r} is not a Python file: pass a .py file "
                             "(or a script with a python #! line)")
    try:
        # Compiled once here, before any rank starts: a syntax error is bad input, not a crash on every rank.
        compile(script.read_bytes(), str(script), "exec")
    except SyntaxError as exc:
        raise UsageError(f"{script}:{exc.lineno}: syntax error: {exc.msg}: fix the script before running it") \
            from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"script {str(script)!r} cannot be read as Python ({exc}): pass a Python script") from None
    return script.resolve(), script_args[1:]


def options(args: argparse.Namespace) -> RunOptions:
    """argv -> RunOptions, or a UsageError naming the problem and the fix."""
    from distcheck.contract.report import command_line

    timeout = seconds("--timeout", args.timeout)
    nproc = count("--nproc", args.nproc) if args.nproc is not None else None
    steps = count("--steps", args.steps, minimum=0) if args.steps is not None else DEFAULT_DRIFT_STEPS
    script, script_args = validate_script(list(args.script_args))
    return RunOptions(script, tuple(script_args), nproc, timeout, args.report_dir, args.native,
                      command_line(args.argv), drift_steps=steps)


def main(args: argparse.Namespace) -> int:
    opts = options(args)
    if not in_torchrun() and opts.nproc is not None:
        check_capacity([opts.nproc], args.oversubscribe)
    if in_torchrun():
        if opts.nproc is not None and os.environ.get(ENV_SUPERVISED) != "1":
            raise UsageError("--nproc is for launching ranks yourself; under torchrun drop it "
                             "(torchrun's --nproc-per-node sets the ranks)")
        from distcheck.rank.entry import run_in_rank

        return run_in_rank(opts)
    from distcheck.supervise.signals import StopNow, StopSignals

    try:
        with StopSignals() as interrupt:  # installed by __main__ first thing; here when called otherwise
            if interrupt.is_set():  # stopped while starting, before any rank was launched
                report, report_dir = stopped_before_launch(opts, opts.nproc or 1, interrupt)
            else:
                from distcheck.supervise.supervised_run import supervised_run

                report, report_dir = supervised_run(opts, opts.nproc or 1, interrupt)
            return print_report(report, report_dir, interrupt)
    except StopNow as stop:
        sys.stderr.write(f"distcheck: {stop}: the ranks were killed; no report was written (per-rank traces stay "
                         f"in the report directory)\n")
        return 1


def stopped_before_launch(opts: RunOptions, nproc: int, interrupt) -> tuple:
    """The report of a run stopped from outside before any rank was launched: a stop during start-up."""
    from distcheck.contract import files
    from distcheck.contract.findings import CheckResult
    from distcheck.contract.report import Report, prepare_report_dir, publish
    from distcheck.supervise.signals import stop_finding

    report_dir = prepare_report_dir(opts.report_dir).resolve()
    files.remove_rank_files(report_dir, range(nproc))  # a reused report dir must not show an earlier run
    finding = stop_finding(interrupt.cause, interrupt.after, range(nproc),
                           "no rank was started, so none of the script ran")
    report = Report(command=opts.command, world_size=nproc, findings=[finding],
                    checks=[CheckResult("ranks_completed", False, 0.0,
                                        note=f"stopped from outside by {interrupt.cause} during start-up")])
    publish(report, report_dir)
    return report, report_dir


def print_report(report, report_dir: Path, interrupt) -> int:
    """Print the written report; a stop signal that stopped nothing (it came after every rank had finished, even
    while the report was printed) is a warning in it (supervise/signals.settle), written again."""
    from distcheck.contract.report import publish
    from distcheck.supervise.signals import settle

    rewrite = settle(report, interrupt) and report.unwritten is None
    publish(report, report_dir, echo=sys.stdout, write=rewrite)
    # It came while the report was printed: the files say so (unless they could not be written at all: then the
    # report already went to stderr).
    if settle(report, interrupt) and report.unwritten is None:
        publish(report, report_dir)
    return report.exit_code
