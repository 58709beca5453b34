"""Pure comparison of what a script recorded with ``distcheck.record`` in a 1-rank and an N-rank run.

    python -m distcheck compare --nproc 2 -- train.py
    python -m pytest -q tests/unit/test_records.py

``compare_runs`` takes each run's records (analysis/record_values.py, read by contract/records_file.py), resolves each
(name, step) of the N-rank run to one value (replicas must agree; per-rank values such as local losses are
averaged: analysis/record_resolve.py), aligns the two runs by (step, name) in record order and compares with dtype
tolerances (analysis/record_compare.py). It gives the table of every record, the ``reference_mismatch`` for the
first differing record (worst element, abs and rel error, hints: analysis/record_explain.py), findings for records
present in one run only, and ``tensor_divergence`` for replicated records the ranks disagree on.

Records marked ``auto`` are the ones distcheck took by itself (the loss passed to ``backward()``, the parameters
after ``optimizer.step()``, the gradients of the first step): they are compared only when neither run recorded
anything explicitly, and every row, finding and table line built from them says "recorded automatically".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from distcheck.analysis.record_compare import (STATUS_DIFF, STATUS_MISSING_REF, STATUS_MISSING_RUN, STATUS_OK,
                                               Convention, Row, Tolerances, compare_records, is_loss,
                                               loss_conventions)
from distcheck.analysis.record_explain import mismatch_finding, missing_finding
from distcheck.analysis.record_resolve import Resolved, fold_accumulated_losses, resolve_run, with_precedence
from distcheck.analysis.record_values import Key, Record
from distcheck.contract.files import AUTO_INIT, AUTO_PARAMS
from distcheck.contract.findings import Finding


@dataclass
class RunComparison:
    """Everything compare found for one world size."""

    nproc: int
    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    conventions: dict[str, Convention] = field(default_factory=dict)  # per-rank loss record name -> convention

    @property
    def ok(self) -> bool:
        return not self.findings


def _order(ref: dict[Key, Resolved], run: dict[Key, Resolved]) -> list[Key]:
    """(step, record order): a name's position is its first appearance in the reference (else the N-rank run)."""
    first_seen: dict[str, tuple[int, int]] = {}
    for src, table in ((0, ref), (1, run)):
        for key, res in table.items():
            pos = (src, res.record.seq)
            if key[0] not in first_seen or pos < first_seen[key[0]]:
                first_seen[key[0]] = pos
    seq: dict[Key, int] = {}
    for table in (ref, run):
        for key, res in table.items():
            seq.setdefault(key, res.record.seq)
    return sorted(set(ref) | set(run), key=lambda k: (k[1], first_seen[k[0]], seq[k], k[2]))


def compare_runs(ref_run: dict[int, list[Record]], nproc_run: dict[int, list[Record]], nproc: int,
                 tol: Tolerances | None = None, steps: int | None = None) -> RunComparison:
    """Compare the N-rank run with the 1-rank reference: rows for every record, findings for what differs."""
    tol = tol or Tolerances()
    ref_run, nproc_run = with_precedence(fold_accumulated_losses(ref_run), fold_accumulated_losses(nproc_run))
    ref, _ = resolve_run(ref_run, 1)
    run, divergences = resolve_run(nproc_run, nproc)
    keys = _order(ref, run)
    if steps is not None:
        allowed = set(sorted({k[1] for k in keys})[:steps])
        keys = [k for k in keys if k[1] in allowed]
        divergences = [f for f in divergences if f.detail.get("step") in allowed]
    result = RunComparison(nproc, findings=list(divergences), conventions=loss_conventions(ref, run, keys, tol))
    missing: dict[tuple[str, str], list[Row]] = {}
    for key in keys:
        r, a = ref.get(key), run.get(key)
        if r is None or a is None:
            rec = (a or r).record
            status = STATUS_MISSING_REF if r is None else STATUS_MISSING_RUN
            row = Row(key, status, mode=a.mode if a else "", file=rec.file, line=rec.line, auto=rec.auto)
            missing.setdefault((key[0], status), []).append(row)
        else:
            convention = result.conventions.get(key[0])
            summed = convention is not None and convention.how == "sum" and a.sum_record is not None
            row = compare_records(r.record, a.sum_record if summed else a.record, tol)
            row.key, row.mode = key, a.sum_mode if summed else a.mode
            row.convention = convention.how if convention is not None else ""
        result.rows.append(row)
    # Different starting parameters explain whatever differs after them (step 0's loss included): they go first.
    first = next((row for row in result.rows if row.status == STATUS_DIFF and row.auto and row.name == AUTO_INIT),
                 None) or next((row for row in result.rows if row.status == STATUS_DIFF), None)
    if first is not None:
        resolved = run[first.key]
        if first.convention == "sum":  # the value compared is the sum, and the finding says so
            resolved = Resolved(resolved.key, resolved.sum_record or resolved.record, resolved.ranks,
                                resolved.sum_mode or resolved.mode)
        summed = None
        if first.convention != "sum" and is_loss(first.name) and resolved.sum_record is not None:
            if compare_records(ref[first.key].record, resolved.sum_record, tol).status == STATUS_OK:
                summed = resolved.sum_mode
        grads = _gradients_behind(first, result.rows) if summed else None
        if grads is not None:  # the loss adds up and the parameters match: what differs is the gradients
            finding = mismatch_finding(grads, result.rows, run[grads.key], nproc, extra=[
                f"the ranks' losses match the reference as their {summed} and the parameters match too, but the "
                f"gradients do not: the optimizer (Adam and its kind) is invariant to a constant scale of every "
                f"gradient, so the parameters hide the factor here, but gradient-norm clipping, Adam's eps and any "
                f"other optimizer see it"])
        else:
            finding = mismatch_finding(first, result.rows, resolved, nproc, summed)
        result.findings.insert(0, finding)
    for (name, status), rows in missing.items():
        result.findings.append(missing_finding(name, status, rows, run, nproc))
    return result


def _gradients_behind(loss: Row, rows: list[Row]) -> Row | None:
    """The differing gradient record of the loss's step when every other module record of that step (the
    parameters) matches: a loss that matches as the sum over the ranks, with 1/N of the gradients (divided twice)."""
    at_step = [r for r in rows if r.step == loss.step and r is not loss]
    grads = [r for r in at_step if r.status == STATUS_DIFF and r.part_role == "gradient"]
    params = [r for r in at_step if r.auto and r.name == AUTO_PARAMS]
    if not grads or not params or any(r.status != STATUS_OK for r in params):
        return None
    return grads[0]
