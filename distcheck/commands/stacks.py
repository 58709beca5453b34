"""Dump and group the Python stacks of every rank of a running job that distcheck did not start.

    python -m distcheck stacks PID [PID ...] [--native] [--json] [--report-dir DIR]
    python -m distcheck stacks $(pgrep -f torchrun)            # a torchrun agent: its workers are found

PID may be a torchrun agent (its rank processes are found among its descendants), a rank process, or several of
either; each process's rank is read from RANK (else LOCAL_RANK) in /proc/PID/environ. All processes are dumped in
parallel with py-spy. Identical stacks are grouped with their rank lists; minority groups are marked; torch and
distcheck internals are collapsed. When the ranks are not all in the same place, a ``hang`` finding names the odd
ones (exit 1); when they are, exit 0. A pid that cannot be dumped gets a one-line message and the others are
still dumped; exit 2 only when nothing could be dumped.

Multi-node: run it on each node with ``--report-dir dumps/$(hostname)``, then ``distcheck report dumps/*`` merges
the per-node dumps into one grouping.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time

from distcheck.analysis.hang import diagnose
from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding
from distcheck.supervise.stacks import (
    DEFAULT_DUMP_TIMEOUT, document_text, dump_all, find_pyspy, render_stacks_text, resolve_targets, stacks_document,
    write_stack_artifacts,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pids", nargs="+", metavar="PID", help="rank processes and/or torchrun agent processes")
    parser.add_argument("--native", action="store_true", help="include native (C/C++) frames (py-spy --native)")
    parser.add_argument("--json", action="store_true", help="print the JSON form instead of text")
    parser.add_argument("--report-dir", default=None,
                        help="also write stacks.txt, stacks.json, report.json and report.txt here")
    parser.add_argument("--dump-timeout", type=float, default=DEFAULT_DUMP_TIMEOUT,
                        help=f"seconds allowed for each process's dump (default {DEFAULT_DUMP_TIMEOUT:g})")


def parse_pids(values: list[str]) -> list[int]:
    pids = []
    for v in values:
        try:
            pid = int(v, 10)
        except ValueError:
            raise UsageError(f"PID {v!r} is not a process id: pass numeric pids, e.g. from 'pgrep -f torchrun'") from None
        if pid <= 0:
            raise UsageError(f"PID {v!r} is not a process id: pids are positive integers")
        pids.append(pid)
    return pids


def main(args: argparse.Namespace) -> int:
    from distcheck.contract.report import Report, command_line, prepare_report_dir, publish
    from distcheck.supervise.hang import load_progress

    pids = parse_pids(args.pids)
    if args.dump_timeout <= 0:
        raise UsageError(f"--dump-timeout {args.dump_timeout:g} must be positive: pass seconds, e.g. 8")
    report_dir = prepare_report_dir(args.report_dir) if args.report_dir else None
    t0 = time.monotonic()
    targets, errors = resolve_targets(pids)
    report_dirs = sorted({t.report_dir for t in targets if t.report_dir})
    result = dump_all(targets, native=args.native, timeout=args.dump_timeout, report_dirs=report_dirs)
    errors = errors + result.errors
    for e in errors:
        sys.stderr.write(f"distcheck: {e.message}\n")
    if not result.stacks:
        if targets and find_pyspy() is None:
            raise UsageError("nothing could be dumped: py-spy is not installed (pip install py-spy, or set "
                             "DISTCHECK_PYSPY to its path)")
        raise UsageError(f"nothing could be dumped ({len(errors)} problem{'s' if len(errors) != 1 else ''} above)")

    # Jobs started under distcheck (DISTCHECK_REPORT_DIR in their environment) have traces: use their last
    # collectives for sequence numbers and process groups.
    progress = {}
    for d in report_dirs:
        try:
            progress.update(load_progress(d))
        except Exception:  # a missing or broken trace only costs us the sequence numbers
            pass
    ranks = {s.rank for s in result.stacks}
    progress = {r: p for r, p in progress.items() if r in ranks}
    diag = diagnose(result.stacks, progress, None, None, {e.rank: e.message for e in errors if e.rank is not None})
    findings: list[Finding] = []
    if len(diag.groups) > 1:
        findings.append(diag.to_finding(result.stacks, progress, [e.message for e in errors]))
    seconds = time.monotonic() - t0

    ws = max([s.world_size or 0 for s in result.stacks] + [len(result.stacks)])
    if args.json:
        doc = stacks_document(result.stacks, errors, args.native, progress, None, diag.groups, diag.message)
        doc["findings"] = [f.to_json() for f in findings]
        sys.stdout.write(document_text(doc))
    else:
        title = f"distcheck stacks on {socket.gethostname()} ({seconds:.2f}s)"
        sys.stdout.write(render_stacks_text(result.stacks, errors, title, progress, diag.groups, diag.message))
    if report_dir is not None:
        artifacts = write_stack_artifacts(report_dir, result.stacks, errors, args.native, progress,
                                          f"distcheck stacks on {socket.gethostname()}", "stacks", diag.groups,
                                          diag.message)
        report = Report(command=command_line(getattr(args, "argv", ["stacks", *args.pids])), world_size=ws,
                        findings=findings, checks=[CheckResult("stacks", not findings, seconds)],
                        artifacts=artifacts, data={"dump_errors": [e.to_json() for e in errors]})
        written = publish(report, report_dir)  # its text is the stack groups printed above
        if not args.json:  # a report that could not be written went to stderr with its reason: never name it
            sys.stdout.write(f"report: {written}\n" if written is not None else
                             f"report: not written ({report.unwritten}); report.json went to stderr\n")
    return 1 if findings else 0
