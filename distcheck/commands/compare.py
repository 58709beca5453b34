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
(``auto/loss``, averaged over the ranks) and every parameter after each ``optimizer.step()`` (``auto/params``,
full tensors). Explicit records take precedence: when the script records anything, the automatic records are not
compared. Rows, findings and the table say which values were recorded automatically.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, load_report, prepare_report_dir, render_text, write_report

DEFAULT_TIMEOUT = 300.0
REFERENCE_DIR = "reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", required=True, metavar="N[,M...]",
                        help="world sizes to compare with the 1-rank reference, e.g. 2 or 1,2,4")
    parser.add_argument("--rtol", type=str, default=None, help="relative tolerance (default: by dtype)")
    parser.add_argument("--atol", type=str, default=None, help="absolute tolerance (default: by dtype)")
    parser.add_argument("--steps", type=str, default=None,
                        help="compare only the first K steps (automatic records: the first K steps, default 3)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="no-progress limit in seconds for each run (default 300)")
    parser.add_argument("--report-dir", default=None, help="report directory (default: distcheck-report-<time>)")
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
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and math.isfinite(value)):
        raise UsageError(f"{flag} {text!r}: expected a finite number >= 0, e.g. {flag} 1e-4")
    return value


def parse_steps(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"--steps {text!r}: expected a whole number of steps >= 1")
    return int(text)


@contextlib.contextmanager
def auto_record_env(steps: int) -> Iterator[None]:
    """DISTCHECK_AUTO_RECORD_STEPS for the ranks: run_supervised hands this process's environment to them."""
    from distcheck.rank.records import ENV_AUTO_STEPS

    saved = os.environ.get(ENV_AUTO_STEPS)
    os.environ[ENV_AUTO_STEPS] = str(steps)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_AUTO_STEPS, None)
        else:
            os.environ[ENV_AUTO_STEPS] = saved


def run_label(nproc: int, reference: bool = False) -> str:
    return "reference run (1 rank)" if reference else f"{nproc}-rank run"


def _clean_records(run_dir: Path) -> None:
    """Record files are appended to: a reused report dir must not mix in an earlier run."""
    from distcheck.analysis.records import record_files

    for path in record_files(run_dir):
        path.unlink(missing_ok=True)


def supervised_run(args: argparse.Namespace, script: Path, script_args: list[str], nproc: int,
                   run_dir: Path) -> tuple[Report, float, str]:
    """One traced and watched run, exactly as ``distcheck run --nproc`` does it, into ``run_dir``."""
    from distcheck.commands import run

    run_dir.mkdir(parents=True, exist_ok=True)
    _clean_records(run_dir)
    sub_args = argparse.Namespace(report_dir=str(run_dir), timeout=args.timeout,
                                  argv=["run", "--nproc", str(nproc), "--timeout", str(args.timeout),
                                        "--report-dir", str(run_dir), "--", str(script), *script_args])
    started = time.monotonic()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):  # run prints its report; ours includes its findings
        run.run_supervised(sub_args, script, script_args, nproc)
    return load_report(run_dir), time.monotonic() - started, text.getvalue()


def _prefixed(findings: list[Finding], label: str, nproc: int) -> list[Finding]:
    out = []
    for f in findings:
        detail = dict(f.detail)
        detail.setdefault("run", label)
        detail.setdefault("nproc", nproc)
        out.append(Finding(f.kind, f.ranks, f"{label}: {f.message}", detail))
    return out


def main(args: argparse.Namespace) -> int:
    # Options first: they need no torch, so bad ones fail in a fraction of a second (run's module imports torch).
    nprocs = parse_nproc(args.nproc)
    tol_rtol = parse_tolerance("--rtol", args.rtol)
    tol_atol = parse_tolerance("--atol", args.atol)
    steps = parse_steps(args.steps)
    if args.timeout is None or not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout} must be a positive number of seconds")
    from distcheck.commands.run import ENV_SUPERVISED, validate_script

    script, script_args = validate_script(list(args.script_args))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and os.environ.get(ENV_SUPERVISED) != "1":
        raise UsageError("compare launches its own ranks (1, then N): run it with python -m distcheck compare, "
                         "not under torchrun")
    return compare_command(args, script, script_args, nprocs, tol_rtol, tol_atol, steps)


def compare_command(args: argparse.Namespace, script: Path, script_args: list[str], nprocs: list[int],
                    rtol: float | None, atol: float | None, steps: int | None) -> int:
    from distcheck.analysis.records import (AUTO_TEXT, Tolerances, compare_runs, has_explicit, load_run,
                                            record_files, render_table)
    from distcheck.cli import command_line
    from distcheck.rank.records import DEFAULT_AUTO_STEPS

    report_dir = prepare_report_dir(args.report_dir).resolve()
    for name in ("report.json", "report.txt"):
        (report_dir / name).unlink(missing_ok=True)
    plan = [(1, REFERENCE_DIR, True)] + [(n, f"nproc{n}", False) for n in nprocs]
    # Always recorded (cheap: K steps); dropped by the analysis when the script records anything itself. The
    # ranks cannot know that in advance, and stopping at the first explicit record could leave ranks that record
    # on rank 0 only out of step in the parameters' full_tensor() collectives.
    auto_steps = steps if steps is not None else DEFAULT_AUTO_STEPS
    findings: list[Finding] = []
    checks: list[CheckResult] = []
    artifacts: dict[str, str] = {}
    runs: dict[str, dict] = {}
    loaded: dict[str, dict] = {}
    for nproc, sub, is_ref in plan:
        label = run_label(nproc, is_ref)
        sys.stdout.write(f"distcheck compare: {label} ...\n")
        sys.stdout.flush()
        with auto_record_env(auto_steps):
            sub_report, seconds, _ = supervised_run(args, script, script_args, nproc, report_dir / sub)
        findings.extend(_prefixed(sub_report.findings, label, nproc))
        checks.append(CheckResult(label, sub_report.ok, seconds))
        runs[REFERENCE_DIR if is_ref else str(nproc)] = {"nproc": nproc, "ok": sub_report.ok,
                                                         "exit_code": sub_report.exit_code, "report_dir": sub,
                                                         "seconds": round(seconds, 3)}
        artifacts[f"{sub}/report.json"] = f"{sub}/report.json"
        for path in record_files(report_dir / sub):
            artifacts[f"{sub}/{path.stem}{path.suffix}"] = f"{sub}/{path.name}"
        loaded[sub] = load_run(report_dir / sub)
    reference = loaded[REFERENCE_DIR]
    tables: dict[str, str] = {}
    records_json: dict[str, list] = {}
    tol = Tolerances(rtol, atol)
    automatic: dict[str, list[str]] = {}
    for nproc in nprocs:
        started = time.monotonic()
        result = compare_runs(reference, loaded[f"nproc{nproc}"], nproc, tol, steps)
        findings.extend(result.findings)
        records_json[str(nproc)] = [row.to_json() for row in result.rows]
        tables[f"records: {nproc} ranks vs the 1-rank reference"] = render_table(result.rows)
        auto_names = sorted({row.name for row in result.rows if row.auto})
        if auto_names:
            automatic[str(nproc)] = auto_names
        checks.append(CheckResult(f"compare {nproc} ranks vs reference", result.ok, time.monotonic() - started,
                                  note=f"{AUTO_TEXT} for the first {auto_steps} steps: {', '.join(auto_names)}"
                                  if auto_names else ""))
    if not any(recs for run_records in loaded.values() for recs in run_records.values()):
        checks.append(CheckResult("records", False, 0.0,
                                  note="nothing was recorded: the script calls neither distcheck.record(name, value) "
                                       "nor backward() or optimizer.step() that distcheck records by itself "
                                       "(DISTCHECK_AUTOCHECK=0 turns that off)"))
    report = Report(command=command_line(args.argv), world_size=max(nprocs), findings=findings, checks=checks,
                    artifacts=artifacts, data={"runs": runs, "records": records_json,
                                               "tolerances": {"rtol": rtol, "atol": atol}, "steps": steps,
                                               "recorded_automatically": automatic,
                                               "explicit_records": has_explicit(*loaded.values())},
                    sections=tables)
    write_report(report, report_dir)
    sys.stdout.write(render_text(report, report_dir))
    sys.stdout.flush()
    return report.exit_code
