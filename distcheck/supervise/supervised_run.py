"""A run that distcheck launches itself: start N ranks, watch them with the one watch loop, write the report.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py
    python -m distcheck compare --nproc 2 -- train.py      # each of its runs comes through here

Every rank runs ``python -m distcheck run ... -- SCRIPT`` with DISTCHECK_SUPERVISED=1 (rank/entry.py): traced,
zero-code checked, writing its per-rank files. This process is their parent: it hosts the rendezvous store,
dumps their stacks on a hang (py-spy may attach to children even under Yama ptrace_scope=1), ends them and
whatever they started (supervise/launcher.py), and builds the report from what they wrote
(supervise/run_report.py), so a rank that crashes or hangs never takes the report with it. The report is built
once the ranks' stderr copies have drained, so its stderr tails hold what the ranks wrote last.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from distcheck.analysis.stop_rule import provably_stuck
from distcheck.analysis.trace_events import load_traces
from distcheck.options import ENV_SUPERVISED, RunOptions
from distcheck.contract import files
from distcheck.contract.report import Report, prepare_report_dir, publish
from distcheck.contract import env as env_names
from distcheck.supervise import run_report
from distcheck.supervise.launcher import Supervisor
from distcheck.supervise.signals import Interrupt
from distcheck.supervise.watch import HangDump



def supervised_run(opts: RunOptions, nproc: int, interrupt: Interrupt | None = None) -> tuple[Report, Path]:
    """Launch, watch and report one run of ``opts.script`` on ``nproc`` ranks; returns the written report."""
    report_dir = prepare_report_dir(opts.report_dir).resolve()
    run_report.clean(report_dir, range(nproc))
    files.clear_shared(report_dir)
    argv = [sys.executable, "-m", "distcheck", "run", "--timeout", str(opts.timeout), "--steps", str(opts.drift_steps),
            "--report-dir", str(report_dir), "--", str(opts.script), *opts.script_args]
    env = dict(os.environ)
    env.update(opts.env)
    env[ENV_SUPERVISED] = "1"
    env[env_names.REPORT_DIR] = str(report_dir)

    def should_stop(codes: dict[int, int | None]) -> str | None:
        finished = {r for r, c in codes.items() if c is not None}
        return provably_stuck(load_traces(report_dir), finished)

    supervisor = Supervisor(nproc, lambda rank: argv, report_dir=report_dir, timeout=opts.timeout, env=env,
                            dump=HangDump(native=opts.native, world_size=nproc), should_stop=should_stop,
                            interrupt=interrupt)
    result = supervisor.run()
    files.tidy(report_dir)
    traces = load_traces(report_dir)
    outcomes, notes = run_report.outcomes_from_exits(result.exits, traces, report_dir)
    report = run_report.build_report(report_dir, opts.command, nproc, traces, outcomes, opts.timeout,
                                     result.seconds, result.hang_findings, result.stop_reason, notes)
    for finding in result.hang_findings:
        report.artifacts.update(finding.detail.get("artifacts", {}))
    run_report.write_trace_view(report, report_dir, traces)
    publish(report, report_dir)  # printed by the command (a compare's runs are not)
    return report, report_dir
