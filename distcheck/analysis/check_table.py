"""The one table from the zero-code checks' states to the report: each check's name, the pure function that judges it.

    python -m distcheck run --nproc 2 -- train.py              # run_report.report_parts (and under torchrun)
    python -m distcheck compare --nproc 2 -- train.py          # compare_runs: the precision the runs computed in
    pytest -n 2 tests/                                         # the pool's rank 0 (rank/autocheck test_findings)

Each rank's ``autocheck-rank<R>.json`` (contract/autocheck_file.py) holds its run-level fields and, under each
check's name (rank/autocheck/registry.py), that check's state. :func:`judge` hands every entry below, in order,
``{rank: its state}``, every rank's run-level fields and the facts of the entries before it
(analysis/check_verdict.py), and joins their Verdicts: findings, the report's checks (in this order: model_check,
bad_values, frozen_model, replica_drift) and warnings (one per kind and message, whatever ranks wrote it). A check
absent here reports by itself in the ranks (async_work, checkpoint_load, tp_inputs), or is read by compare alone
(modules: analysis/module_diff.py; auto_records).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from distcheck.analysis.bad_values import first_bad_verdict, model_check_verdict
from distcheck.analysis.check_verdict import Judge, Verdict, notes_verdict
from distcheck.analysis.pipeline_schedule import pipeline_verdict
from distcheck.analysis.replica_drift import drift_verdict, frozen_verdict, prewrap_verdict
from distcheck.contract.autocheck_file import RunFields, parts_of, runs_of


def precision_verdict(states: Mapping[int, list[dict[str, Any]]], runs: Mapping[int, RunFields],
                      facts: Mapping[str, Any]) -> Verdict:
    """Where the ranks computed in 16 bits (rank/autocheck/precision.py), as the fact ``precision``: compare's
    default tolerances follow it (analysis/tolerance.Precision.from_notes)."""
    return Verdict(facts={"precision": [note for rank in states for note in states[rank]]})


TABLE: dict[str, Judge] = {
    "models": model_check_verdict,  # the first-forward model checks ran, and their warnings
    "nan_watch": first_bad_verdict,  # the first NaN/Inf step
    "frozen": frozen_verdict,  # optimizer steps with nothing to update (hides the drift check)
    "prewrap": prewrap_verdict,  # models that differed before parallelizing (the drift is their consequence)
    "replica_drift": drift_verdict,  # replicas that drifted apart after a step
    "pipeline": pipeline_verdict,  # pipeline stages whose schedules disagree
    "dp_inputs": notes_verdict,  # data-parallel ranks fed the same batch (a warning)
    "precision": precision_verdict,  # 16-bit computation, for compare
}


def judge(docs: Mapping[int, Mapping[str, Any]], only: Iterable[str] | None = None) -> Verdict:
    """Every entry's Verdict (``only``: those entries alone) from ``{rank: document}``, joined."""
    out = Verdict()
    if not docs:
        return out
    names = set(TABLE if only is None else only)
    runs = runs_of(docs)
    notes: dict[tuple[str, str], Any] = {}
    for name, entry in TABLE.items():
        if name not in names:
            continue
        found = entry(parts_of(docs, name), runs, out.facts)
        out.findings += found.findings
        out.checks += found.checks
        out.facts.update(found.facts)
        for note in found.notes:
            notes.setdefault((note.kind, note.message), note)
    out.notes = list(notes.values())
    return out
