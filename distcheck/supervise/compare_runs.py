"""``compare``: run the script with 1 rank (the reference) and with each N, then compare what the runs recorded.

    python -m distcheck compare --nproc 2 --report-dir out -- train.py

Each run is a supervised run exactly like ``distcheck run --nproc N`` (supervise/supervised_run.py: the same
watch loop, hang diagnosis with every rank's stack, rank failures) into its own sub report dir (``reference/``,
``nproc<N>/``). A run that did not complete (it hung, a rank crashed) is reported with its own findings, and its
records are not compared: half a run's records would only add "recorded in one run only" noise on top of the
real cause. The comparison itself is pure (analysis/record_*.py: it also finds how the ranks' losses make the
reference's, their mean or their sum, from what the parameters and gradients prove, and the table and
``loss_conventions`` in report.json name it); at a mismatch, analysis/module_diff.py names the first module whose output (or input
gradient) differs in the first step.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from distcheck.contract.findings import CheckResult, Finding, Note
from distcheck.contract.report import Report, prepare_report_dir, publish, remove_report
from distcheck.options import CompareOptions
from distcheck.supervise.signals import Interrupt, stop_finding
from distcheck.supervise.supervised_run import supervised_run

REFERENCE_DIR = "reference"
DEFAULT_AUTO_STEPS = 3  # steps the ranks record by themselves (the loss, the parameters) unless --steps says


def run_label(nproc: int, reference: bool = False) -> str:
    return "reference run (1 rank)" if reference else f"{nproc}-rank run"


def _prefixed(findings: list[Finding], label: str, nproc: int) -> list[Finding]:
    out = []
    for f in findings:
        detail = dict(f.detail)
        detail.setdefault("run", label)
        detail.setdefault("nproc", nproc)
        out.append(Finding(f.kind, f.ranks, f"{label}: {f.message}", detail))
    return out


def _completed(report: Report) -> bool:
    """Whether every rank of a run ran its script to the end (findings about its values may still exist)."""
    return not any(f.kind in ("hang", "rank_failure") for f in report.findings) and all(
        c.ok for c in report.checks if c.name == "ranks_completed")


def _second_look(opts: CompareOptions, report_dir: Path, nproc: int, auto_steps: int, mismatch: Finding,
                 checks: list[CheckResult], interrupt: Interrupt | None) -> None:
    """Both world sizes once more, each saving the one module named by the summaries: its element-wise error.

    Two more runs, only when a module was named: the correct-script case never pays for them."""
    import torch

    from distcheck.analysis.module_diff import element_error
    from distcheck.contract import files
    from distcheck.contract import env as names

    module = mismatch.detail["module"]
    env = {names.AUTO_RECORD_STEPS: str(auto_steps),
           names.CAPTURE_MODULE: "" if module["name"] == "<model>" else module["name"],
           names.CAPTURE_SIDE: module["side"]}
    captured: dict[int, dict[int, dict]] = {}
    started = time.monotonic()
    for n, sub in ((1, f"{REFERENCE_DIR}-module"), (nproc, f"nproc{nproc}-module")):
        if interrupt is not None and interrupt.is_set():  # stopped from outside: no more runs
            captured.setdefault(n, {})
            continue
        run_dir = report_dir / sub
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in files.rank_files(run_dir, "module_capture").values():
            path.unlink()
        sys.stdout.write(f"distcheck compare: {run_label(n, n == 1 and sub.startswith(REFERENCE_DIR))}, "
                         f"capturing '{module['name']}' ...\n")
        sys.stdout.flush()
        supervised_run(opts.run.with_(report_dir=str(run_dir), nproc=n, env=env), n, interrupt)
        captured[n] = {}
        for rank, path in files.rank_files(run_dir, "module_capture").items():
            try:
                captured[n][rank] = torch.load(path, weights_only=True)
            except Exception:  # a rank that did not get there: no element-wise error, the summaries stand
                pass
    ok = bool(captured[1].get(0)) and len(captured[nproc]) == nproc
    error = element_error(captured[1][0], captured[nproc], module["mapping"]) if ok else \
        "the module was not captured in both runs"
    if isinstance(error, dict):
        module["element"] = error
        where = f" at {error['index']}" + (f" on rank {error['rank']}" if error["rank"] is not None else "")
        mismatch.message += (f"; element-wise (a second run of each world size, saving that module): max abs error "
                             f"{error['max_abs']:.3g}, max rel error {error['max_rel']:.2g}, largest{where}: "
                             f"{error['value']:.6g} vs reference {error['reference']:.6g}")
    else:
        module["element"] = None
        mismatch.detail.setdefault("module_notes", []).append(f"element-wise error: {error}")
        mismatch.message += f"; a second run of each world size, saving that module: {error}"
    checks.append(CheckResult(f"module capture ({nproc} ranks)", isinstance(error, dict), time.monotonic() - started,
                              note=f"'{module['name']}' saved in a second run of each world size"))


def run_precision(report_dir: Path, subs: tuple[str, ...]) -> "Precision | None":
    """The lowest precision either run computed in (the ranks' precision notes), for the default tolerances."""
    from distcheck.analysis.check_table import judge
    from distcheck.analysis.tolerance import Precision  # noqa: F811 (the annotation's name, imported lazily)
    from distcheck.contract.autocheck_file import read_all

    notes = [n for sub in subs
             for n in judge(read_all(report_dir / sub), only=("precision",)).facts.get("precision", [])]
    return Precision.from_notes(notes)


def compare(opts: CompareOptions, interrupt: Interrupt | None = None) -> tuple[Report, Path]:
    from distcheck.analysis.compare_to_reference import compare_runs
    from distcheck.analysis.record_compare import AUTO_TEXT, Tolerances
    from distcheck.analysis.record_explain import render_table
    from distcheck.analysis.record_resolve import has_explicit
    from distcheck.analysis.record_values import load_run
    from distcheck.contract.records_file import paths as record_files
    from distcheck.analysis.module_diff import explain_mismatch
    from distcheck.contract.env import AUTO_RECORD_STEPS
    from distcheck.contract.autocheck_file import read_all as load_autocheck_states

    report_dir = prepare_report_dir(opts.run.report_dir).resolve()
    remove_report(report_dir)
    plan = [(1, REFERENCE_DIR, True)] + [(n, f"nproc{n}", False) for n in opts.nprocs]
    # Always recorded (cheap: K steps); dropped by the analysis when the script records anything itself. The
    # ranks cannot know that in advance, and stopping at the first explicit record could leave ranks that record
    # on rank 0 only out of step in the parameters' full_tensor() collectives.
    auto_steps = opts.steps if opts.steps is not None else DEFAULT_AUTO_STEPS
    findings: list[Finding] = []
    warnings: list[Note] = []
    checks: list[CheckResult] = []
    artifacts: dict[str, str] = {}
    runs: dict[str, dict] = {}
    loaded: dict[str, dict] = {}
    completed: dict[str, bool] = {}
    for nproc, sub, is_ref in plan:
        label = run_label(nproc, is_ref)
        if interrupt is not None and interrupt.is_set():
            checks.append(CheckResult(label, False, 0.0, note=f"not run: stopped from outside by {interrupt.cause}"))
            if not any(f.detail.get("stopped_by") for f in findings):  # the signal stopped this run: say so once
                findings.extend(_prefixed([stop_finding(interrupt.cause, interrupt.after, range(nproc),
                                                        "it was never started")], label, nproc))
            completed[sub] = False
            loaded[sub] = {}
            continue
        sys.stdout.write(f"distcheck compare: {label} ...\n")
        sys.stdout.flush()
        run_dir = report_dir / sub
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in record_files(run_dir):  # appended to: a reused report dir must not mix in an earlier run
            path.unlink(missing_ok=True)
        started = time.monotonic()
        sub_opts = opts.run.with_(report_dir=str(run_dir), nproc=nproc, env={AUTO_RECORD_STEPS: str(auto_steps)})
        sub_report, _ = supervised_run(sub_opts, nproc, interrupt)
        seconds = time.monotonic() - started
        findings.extend(_prefixed(sub_report.findings, label, nproc))
        # A run's warnings (a trace cut short by a full disk, a teardown abort) belong in the compare report too:
        # records lost with the disk otherwise read as "present in only one run" with no reason given.
        warnings.extend(Note(w.kind, w.ranks, f"{label}: {w.message}", {**w.detail, "run": label})
                        for w in sub_report.warnings)
        completed[sub] = _completed(sub_report)
        checks.append(CheckResult(label, sub_report.ok, seconds,
                                  note="" if completed[sub] else "did not complete: see its findings"))
        runs[REFERENCE_DIR if is_ref else str(nproc)] = {"nproc": nproc, "ok": sub_report.ok,
                                                         "completed": completed[sub],
                                                         "exit_code": sub_report.exit_code, "report_dir": sub,
                                                         "seconds": round(seconds, 3)}
        artifacts[f"{sub}/report.json"] = f"{sub}/report.json"
        for key, rel in sub_report.artifacts.items():
            if key.startswith("stacks"):
                artifacts[f"{sub}/{key}"] = f"{sub}/{rel}"
        for path in record_files(run_dir):
            artifacts[f"{sub}/{path.stem}{path.suffix}"] = f"{sub}/{path.name}"
        loaded[sub] = load_run(run_dir)
    tables: dict[str, str] = {}
    records_json: dict[str, list] = {}
    tol = Tolerances(opts.rtol, opts.atol)
    automatic: dict[str, list[str]] = {}
    conventions: dict[str, dict] = {}  # nproc -> per-rank loss record -> how the ranks' losses make the reference's
    for nproc in opts.nprocs:
        name = f"compare {nproc} ranks vs reference"
        unfinished = [run_label(n, sub == REFERENCE_DIR) for n, sub in ((1, REFERENCE_DIR), (nproc, f"nproc{nproc}"))
                      if not completed[sub]]
        if unfinished:
            checks.append(CheckResult(name, False, 0.0, note=f"not compared: the {' and the '.join(unfinished)} "
                                                             "did not complete (see its findings)"))
            continue
        started = time.monotonic()
        tol.precision = run_precision(report_dir, (REFERENCE_DIR, f"nproc{nproc}"))
        result = compare_runs(loaded[REFERENCE_DIR], loaded[f"nproc{nproc}"], nproc, tol, opts.steps)
        mismatch = next((f for f in result.findings if f.kind == "reference_mismatch"), None)
        if mismatch is not None:  # which module first computes something else (analysis/module_diff.py)
            explain_mismatch(mismatch, load_autocheck_states(report_dir / REFERENCE_DIR),
                             load_autocheck_states(report_dir / f"nproc{nproc}"))
            if "module" in mismatch.detail and not (interrupt is not None and interrupt.is_set()):
                _second_look(opts, report_dir, nproc, auto_steps, mismatch, checks, interrupt)
        findings.extend(result.findings)
        records_json[str(nproc)] = [row.to_json() for row in result.rows]
        tables[f"records: {nproc} ranks vs the 1-rank reference"] = render_table(result.rows, result.conventions)
        if result.conventions:
            conventions[str(nproc)] = {name: c.to_json() for name, c in result.conventions.items()}
        auto_names = sorted({row.name for row in result.rows if row.auto})
        if auto_names:
            automatic[str(nproc)] = auto_names
        checks.append(CheckResult(name, result.ok, time.monotonic() - started,
                                  note=f"{AUTO_TEXT} for the first {auto_steps} steps: {', '.join(auto_names)}"
                                  if auto_names else ""))
    if all(completed.values()) and not any(recs for run_records in loaded.values() for recs in run_records.values()):
        checks.append(CheckResult("records", False, 0.0,
                                  note="nothing was recorded: the script calls neither distcheck.record(name, value) "
                                       "nor backward() or optimizer.step() that distcheck records by itself "
                                       "(DISTCHECK_AUTOCHECK=0 turns that off)"))
    report = Report(command=opts.run.command, world_size=max(opts.nprocs), findings=findings, checks=checks,
                    artifacts=artifacts, data={"runs": runs, "records": records_json,
                                               "tolerances": {"rtol": opts.rtol, "atol": opts.atol},
                                               "steps": opts.steps, "recorded_automatically": automatic,
                                               "explicit_records": has_explicit(*loaded.values()),
                                               "loss_conventions": conventions},
                    sections=tables, warnings=warnings)
    publish(report, report_dir)  # printed by the command
    return report, report_dir
