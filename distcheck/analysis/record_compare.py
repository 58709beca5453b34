"""Comparing one resolved record of the N-rank run with the reference's: the table's rows, their tolerances, and
how the ranks' own losses make the reference's (their mean, or their sum).

    from distcheck.analysis.record_compare import Tolerances, compare_records
    row = compare_records(reference_record, run_record, Tolerances(rtol=1e-4))

    python -m pytest -q tests/unit/test_records.py tests/unit/test_precision_tolerance.py

Each part (a tensor, a number, a module's parameter) is judged by a rule for its dtype and the precision the runs
computed in (analysis/tolerance.py), a record's own rtol/atol first. Parameter names that only a wrapper's prefix
tells apart are aligned (``aligned_parts``). Plain tensor math, no process group, no file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distcheck.analysis.record_resolve import Resolved
from distcheck.analysis.record_values import Key, Part, Record
from distcheck.analysis.tolerance import Comparison, Precision, Rule, compare, rule_for
from distcheck.contract.files import AUTO_INIT
from distcheck.contract.site import file_line

STATUS_OK, STATUS_DIFF = "ok", "MISMATCH"
AUTO_TEXT = "recorded automatically"
STATUS_MISSING_RUN, STATUS_MISSING_REF = "missing in N-rank run", "missing in reference"


@dataclass
class Row:
    """One line of the table: a record of either run and its error against the reference."""

    key: Key
    status: str
    abs_err: float | None = None
    rel_err: float | None = None
    part: str = ""  # the first differing parameter/buffer/gradient of a module ("" for a tensor or number)
    part_role: str = ""
    mode: str = ""
    comparison: Comparison | None = None
    actual: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    note: str = ""
    file: str | None = None
    line: int | None = None
    auto: bool = False
    convention: str = ""  # a per-rank loss: "mean" or "sum" over the ranks, as compare_runs found it
    rule: Rule | None = None  # the tolerance its (first differing, else first) part was judged with, and why

    @property
    def name(self) -> str:
        return self.key[0]

    @property
    def step(self) -> int:
        return self.key[1]

    @property
    def site(self) -> str:
        return file_line(self.file, self.line) or ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "step": self.step, "status": self.status,
                               "abs_err": self.abs_err, "rel_err": self.rel_err, "mode": self.mode}
        if self.key[2]:
            out["occurrence"] = self.key[2]
        if self.part:
            out.update(part=self.part, part_role=self.part_role)
        if self.note:
            out["note"] = self.note
        if self.site:
            out["site"] = self.site
        if self.convention:
            out["convention"] = self.convention
        if self.rule is not None:
            out["tolerance"] = self.rule.to_json()
        if self.auto:
            out["auto"] = True
            out["recorded"] = AUTO_TEXT
        return out


@dataclass
class Tolerances:
    """--rtol/--atol from the command line; None keeps the default, which follows the precision the runs computed
    in (``precision``: the lowest of both runs; analysis/tolerance.py). A record's own tolerance wins."""

    rtol: float | None = None
    atol: float | None = None
    precision: Precision | None = None

    def pick(self, ref: Record, run: Record, dtype: torch.dtype) -> Rule:
        rtol = next((v for v in (run.rtol, ref.rtol, self.rtol) if v is not None), None)
        atol = next((v for v in (run.atol, ref.atol, self.atol) if v is not None), None)
        own = any(v is not None for v in (run.rtol, ref.rtol, run.atol, ref.atol))
        why = "the record's own rtol/atol" if own else "--rtol/--atol"
        return rule_for(dtype, rtol, atol, self.precision, why)


def compare_records(ref: Record, run: Record, tol: Tolerances) -> Row:
    key = (run.name, run.step, 0)
    ref_parts, run_parts = aligned_parts({p.key: p for p in ref.parts}, {p.key: p for p in run.parts})
    worst: tuple[float, float] | None = None
    first_bad: tuple[Part, Part, Comparison] | None = None
    first_rule: Rule | None = None
    missing = [k for k in ref_parts if k not in run_parts]
    extra = [k for k in run_parts if k not in ref_parts]
    for k, rp in ref_parts.items():
        ap = run_parts.get(k)
        if ap is None:
            continue
        rule = tol.pick(ref, run, rp.tol_dtype)
        first_rule = first_rule or rule
        cmp = compare(ap.value, rp.value, rule.rtol, rule.atol, norm=rule.norm)
        # the norm-wise error where the rule is norm-wise: one near-zero element's relative error says nothing there
        rel = cmp.norm_rel if cmp.norm_rel is not None else cmp.max_rel
        if worst is None or cmp.max_abs > worst[0]:
            worst = (cmp.max_abs, rel)
        if not cmp.ok and first_bad is None:
            first_bad = (ap, rp, cmp)
            first_rule = rule
    row = Row(key, STATUS_OK, worst[0] if worst else None, worst[1] if worst else None, file=run.file or ref.file,
              line=run.line or ref.line, auto=run.auto and ref.auto, rule=first_rule)
    if first_bad is not None:
        ap, rp, cmp = first_bad
        row.status, row.comparison, row.actual, row.expected = STATUS_DIFF, cmp, ap.value, rp.value
        row.part, row.part_role = ap.key, ap.role
    elif missing or extra:
        row.status = STATUS_DIFF
        k = (missing or extra)[0]
        p = ref_parts.get(k) or run_parts[k]
        row.part, row.part_role = k, p.role
        row.note = (f"{p.role} '{k}' is in the reference but not in the N-rank run" if missing
                    else f"{p.role} '{k}' is in the N-rank run but not in the reference")
    return row


def aligned_parts(ref: dict[str, Any], run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two runs' parts keyed alike where a wrapper only added a prefix to every name on one side: under
    Lightning the N-rank run names parameters from the LightningModule ('net.0.weight', DDP wraps it) and the 1-rank
    reference from the module that ran ('0.weight'). The known wrappers' parts (DDP's 'module.', torch.compile's
    '_orig_mod.', anywhere in a name) are already gone (rank/records.normalize_key); this takes the prefixes nobody
    can list, a user's or a framework's module holding the model. Otherwise the keys are left as they are."""
    if ref.keys() == run.keys() or not ref or not run:
        return ref, run
    for longer, shorter, swap in ((run, ref, False), (ref, run, True)):
        first = next(iter(longer))
        for cut in [i + 1 for i, ch in enumerate(first) if ch == "."]:
            prefix = first[:cut]
            if all(k.startswith(prefix) for k in longer) and {k[cut:] for k in longer} == shorter.keys():
                stripped = {k[cut:]: v for k, v in longer.items()}
                return (stripped, shorter) if swap else (shorter, stripped)
    return ref, run


@dataclass
class Convention:
    """How the ranks' own losses make the reference's: their mean (each rank's loss is the mean over its own batch)
    or their sum over the data-parallel ranks (each normalized by the global batch or token count)."""

    how: str  # "mean" or "sum"
    mode: str  # the N-rank value's description: "mean of 2 ranks", "sum over the 2 data-parallel ranks", ...
    step: int  # the step that decided it
    proven_by: list[str] = field(default_factory=list)  # records whose parameters matched at that step

    def to_json(self) -> dict[str, Any]:
        return {"convention": self.how, "mode": self.mode, "step": self.step, "proven_by": self.proven_by}

    def text(self, name: str) -> str:
        if self.how == "mean":
            return (f"loss convention: '{name}' matches the reference as the {self.mode} (each rank's loss is the "
                    f"mean over its own batch)")
        return (f"loss convention: '{name}' matches the reference as the {self.mode}, not as their mean: each "
                f"rank's loss is normalized by the global batch or token count, and "
                f"{', '.join(repr(n) for n in self.proven_by)} "
                f"match{'es' if len(self.proven_by) == 1 else ''} the reference at step {self.step}, so the "
                f"updates are the 1-rank updates")


def loss_conventions(ref: dict[Key, Resolved], run: dict[Key, Resolved], keys: list[Key],
                     tol: Tolerances) -> dict[str, Convention]:
    """Judge each per-rank loss by what the parameters and gradients prove. The convention is read at the first step
    that has the loss and parameter records (a module record, or the parameters and gradients distcheck records at
    optimizer.step()) in both runs: the mean over the ranks when it matches there and the gradients recorded at that
    step match too; the sum over the data-parallel ranks when that matches and every parameter and gradient record
    of that step matches too (so the gradients were reduced to match: parameters alone prove nothing under Adam,
    which a constant scale of every gradient leaves unchanged). Without that proof a sum is none: the loss is
    compared as the mean and explained as such."""
    out: dict[str, Convention] = {}
    names = list(dict.fromkeys(k[0] for k in keys if k in ref and k in run and is_loss(k[0])
                               and run[k].sum_record is not None))
    for name in names:
        mine = [k for k in keys if k[0] == name and k in ref and k in run]
        # The parameters before the first update (auto/init) say where the runs start, nothing about a step's update.
        evidence = {k for k in keys if k in ref and k in run and ref[k].record.kind == "module"
                    and run[k].record.kind == "module" and not (ref[k].record.auto and k[0] == AUTO_INIT)}
        proven = [k[1] for k in mine if any(e[1] == k[1] for e in evidence)]
        step = proven[0] if proven else mine[0][1]
        at_step = [k for k in mine if k[1] == step]

        def ok(record_of: Any) -> bool:
            return all(compare_records(ref[k].record, record_of(k), tol).status == STATUS_OK for k in at_step)

        params = [e for e in evidence if e[1] == step]
        grads = [e for e in params if any(p.role == "gradient" for p in ref[e].record.parts)]
        if ok(lambda k: run[k].record):
            if run[at_step[0]].mode.startswith("mean") and all(  # ranks that agree show no convention
                    compare_records(ref[e].record, run[e].record, tol).status == STATUS_OK for e in grads):
                out[name] = Convention("mean", run[at_step[0]].mode, step)
            continue
        if not proven or not all(run[k].sum_record is not None for k in at_step):
            continue
        if ok(lambda k: run[k].sum_record) and all(
                compare_records(ref[e].record, run[e].record, tol).status == STATUS_OK for e in params):
            out[name] = Convention("sum", run[at_step[0]].sum_mode, step,
                                   sorted({e[0] for e in params}))
    return out


def is_loss(name: str) -> bool:
    return "loss" in name.lower()
