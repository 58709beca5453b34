"""Run a script with 1 rank (the reference) and with N ranks, and compare what it recorded.

    python -m distcheck compare --nproc 2 --report-dir out -- train.py --lr 0.1
    python -m distcheck compare --nproc 1,2,4 --rtol 1e-3 -- train.py       # each N against one reference run

The script records values with ``distcheck.record(name, value, step=None)`` (tensors, DTensors, numbers,
nn.Modules). Each run goes through ``distcheck run``'s supervised path (collective tracing, no-progress timeout,
stack dumps, rank failures) into its own sub report dir (``reference/``, ``nproc<N>/``). Records are aligned by
(step, name) and compared with dtype tolerances (``--rtol/--atol`` override them; a record's own tolerance wins):
the first differing record is a ``reference_mismatch`` with the worst element and hints, records present in one
run only are findings too, and replicated records the ranks disagree on are ``tensor_divergence``. report.txt holds
a table of every record with its error. ``--nproc 1`` in the list runs the script a second time with 1 rank: a
run-to-run determinism check. Exit codes: 0 equal, 1 findings, 2 bad input.

Zero code: a script with no ``distcheck.record`` call is compared on what distcheck records by itself in the ranks
(distcheck/rank/autocheck.py) for the first ``--steps K`` steps (default 3): the loss passed to ``backward()``
(``auto/loss``, each rank's own), every parameter after each ``optimizer.step()`` (``auto/params``, full
tensors) and, at the first step, every gradient that step used (``auto/grads``). Explicit records take precedence: when the script records anything, the automatic records are not
compared. Rows, findings and the table say which values were recorded automatically.

The ranks' own losses are judged by what the parameters and gradients prove: a loss that matches the reference as
the ranks' mean (each rank's mean over its own batch), or as their sum over the data-parallel ranks (each normalized
by the global batch or token count, as torchtitan does) while the parameters and gradients of that step match, is no
finding; the table names the convention found (``loss convention: ...``, report.json ``loss_conventions``). When
they differ, the loss row (or, where only the gradients differ, the ``auto/grads`` row) is explained as a mismatch.

At a ``reference_mismatch`` the finding also names the first module whose output (or input gradient) differs in
the first step, from per-sample summaries every run keeps (rank/autocheck/module_summaries.py,
analysis/module_diff.py; on a mesh of several dims the batch is sliced along the data-parallel ranks only and each
slice put together from its tensor-parallel shards; modules that cannot be mapped are said, never counted as
matching); each world size then runs once more, saving only that module (``reference-module/``,
``nproc<N>-module/``), for its element-wise error.
"""
from __future__ import annotations

import argparse
import os
import sys

from distcheck.errors import UsageError
from distcheck.options import (ENV_SUPERVISED, CompareOptions, RunOptions, check_capacity, in_torchrun, seconds,
                               tolerance)

DEFAULT_TIMEOUT = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", required=True, metavar="N[,M...]",
                        help="world sizes to compare with the 1-rank reference, e.g. 2 or 1,2,4")
    parser.add_argument("--rtol", type=str, default=None, help="relative tolerance (default: by dtype)")
    parser.add_argument("--atol", type=str, default=None, help="absolute tolerance (default: by dtype)")
    parser.add_argument("--steps", type=str, default=None,
                        help="compare only the first K steps (automatic records: the first K steps, default 3)")
    parser.add_argument("--timeout", default=DEFAULT_TIMEOUT,
                        help="no-progress limit in seconds for each run (default 300)")
    parser.add_argument("--report-dir", default=None, help="report directory (default: distcheck-report-<time>)")
    parser.add_argument("--native", action="store_true", help="include native frames in hang stack dumps")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="start the ranks even when that is more than the machine can run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                        help="the Python script to run, and its arguments")


def parse_nproc(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything else is a UsageError naming the expected form."""
    out: list[int] = []
    for piece in str(text).split(","):
        piece = piece.strip()
        if not piece.isdigit() or int(piece) < 1:
            raise UsageError(f"--nproc {text!r}: expected a world size >= 1 or a comma-separated list such as 1,2,4")
        if int(piece) not in out:
            out.append(int(piece))
    return sorted(out)


def parse_tolerance(flag: str, text: str | None) -> float | None:
    return tolerance(flag, text)


def parse_steps(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"--steps {text!r}: expected a whole number of steps >= 1")
    return int(text)


def options(args: argparse.Namespace) -> CompareOptions:
    """argv -> CompareOptions. Options first: they need no torch, so bad ones fail in a fraction of a second."""
    from distcheck.contract.report import command_line
    from distcheck.commands.run import validate_script

    nprocs = parse_nproc(args.nproc)
    rtol = parse_tolerance("--rtol", args.rtol)
    atol = parse_tolerance("--atol", args.atol)
    steps = parse_steps(args.steps)
    timeout = seconds("--timeout", args.timeout)
    script, script_args = validate_script(list(args.script_args))
    run = RunOptions(script, tuple(script_args), None, timeout, args.report_dir, args.native,
                     command_line(args.argv))
    return CompareOptions(run, tuple(nprocs), rtol, atol, steps)


def main(args: argparse.Namespace) -> int:
    opts = options(args)
    if in_torchrun() and os.environ.get(ENV_SUPERVISED) != "1":
        raise UsageError("compare launches its own ranks (1, then N): run it with python -m distcheck compare, "
                         "not under torchrun")
    check_capacity(opts.nprocs, args.oversubscribe)
    from distcheck.commands.run import print_report
    from distcheck.supervise.compare_runs import compare
    from distcheck.supervise.signals import StopNow, StopSignals

    try:
        with StopSignals() as interrupt:  # installed by __main__ first thing; here when called otherwise
            report, report_dir = compare(opts, interrupt)
            code = print_report(report, report_dir, interrupt)
    except StopNow as stop:
        sys.stderr.write(f"distcheck: {stop}: the ranks were killed; no report was written\n")
        return 1
    nothing = next((c for c in report.checks if c.name == "records" and not c.ok), None)
    if nothing is not None:  # both runs completed and neither recorded anything: nothing was compared
        sys.stderr.write(f"distcheck: error: nothing to compare: {nothing.note}\n")
        return 2
    return code
