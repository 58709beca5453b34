"""Pre-launch consistency check: environment, collectives, model replicas, parallel vs 1-rank reference.

    torchrun --nproc-per-node 2 -m distcheck consistency
    torchrun --nproc-per-node 8 -m distcheck consistency --model my_pkg.model:build --parallel fsdp --steps 3
    torchrun --nproc-per-node 2 -m distcheck consistency --model path/to/model.py:build --report-dir out/

Exit code 0: every check passed; 1: findings (see report.txt / report.json); 2: bad input.
Run without torchrun it is a 1-rank check, and the report says which checks mean nothing there.
"""
from __future__ import annotations

import argparse
import sys

from distcheck import consistency, runtime
from distcheck.cli import command_line
from distcheck.errors import UsageError
from distcheck.models import BUILTIN, load_factory
from distcheck.parallelize import MODES
from distcheck.report import prepare_report_dir, render_text, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=BUILTIN, metavar="MODULE_OR_FILE:FACTORY",
                        help="pkg.module:fn or path/to/file.py:fn returning an unparallelized nn.Module "
                             "(default: the built-in small transformer)")
    parser.add_argument("--parallel", default="fsdp", choices=MODES,
                        help="fsdp: FSDP2 fully_shard per block and root (default); ddp; tp (built-in model)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps compared with the reference")
    parser.add_argument("--report-dir", default=None, help="default: ./distcheck-report-<timestamp>/")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds any rank may take to reach the next exchange before it is declared hung")
    parser.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: by dtype)")
    parser.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: by dtype)")


def main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: must be at least 1")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be positive")
    info = runtime.RankInfo.from_env()
    load_factory(args.model)  # bad --model fails here, on every rank, before any rank waits for another
    # An explicit --report-dir is checked on every rank so all fail together; the default is rank 0's own.
    report_dir = prepare_report_dir(args.report_dir) if (args.report_dir or info.rank == 0) else None
    options = consistency.Options(args.model, args.parallel, args.steps, args.timeout, command_line(args.argv),
                                  args.rtol, args.atol)
    session = runtime.start(args.timeout)
    try:
        local, ctx = consistency.run_checks(session, options)
        report = consistency.build_report(session, options, local, ctx)
        if session.rank == 0:
            write_report(report, report_dir)
            report.artifacts.update(consistency.report_files(report_dir))
            write_report(report, report_dir)
            sys.stdout.write(render_text(report, report_dir))
            sys.stdout.flush()
        try:
            # Nobody exits before rank 0 has written: torchrun kills the other ranks when one exits non-zero.
            session.channel.exchange("consistency/done", True, timeout=min(args.timeout, 60.0))
        except Exception:
            pass
        return report.exit_code
    finally:
        runtime.stop(session)
