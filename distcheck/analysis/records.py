"""Pure comparison of what a script recorded with ``distcheck.record`` in a 1-rank and an N-rank run.

    python -m distcheck compare --nproc 2 -- train.py

Reads the per-rank record files of each run (no process group), resolves each (name, step) of the N-rank run to
one value (replicas must agree; per-rank values such as local losses are averaged), aligns the two runs by
(step, name) in record order and compares with dtype tolerances. Produces the table of every record, the
``reference_mismatch`` for the first differing record (worst element, abs and rel error, hints), findings for
records present in one run only, and ``tensor_divergence`` for replicated records the ranks disagree on.

Records marked ``auto`` are the ones distcheck took by itself (the loss passed to ``backward()``, the parameters
after ``optimizer.step()``, the gradients of the first step): they are compared only when neither run recorded
anything explicitly, and every row, finding and table line built from them says "recorded automatically".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from distcheck.analysis.module_diff import dp_groups
from distcheck.analysis.replicas import Divergence, diff_chunk, divergence_finding
from distcheck.analysis.tolerance import (Comparison, Precision, Rule, compare, element_ratios, ratio_hint,
                                          rule_for)
from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract import records_file
from distcheck.contract.files import AUTO_GRADS, AUTO_LOSS, AUTO_PARAMS
from distcheck.contract.site import file_line

# Python numbers usually come from ``loss.item()`` of a float32 tensor: float64 tolerances would flag rounding.
NUMBER_TOL_DTYPE = torch.float32

# The gradients of the first optimizer step (rank/autocheck/auto_records.py records them under this name, as a list
# of parameter-named parts like auto/params': their role is "gradient" here).


# The files' names and format are contract/records_file.py's; these are the analysis's names for them.
index_path, data_path, record_files = records_file.index_path, records_file.data_path, records_file.paths


@dataclass
class Part:
    """One tensor of a record: the whole value of a tensor/number record, or one parameter/buffer/gradient."""

    key: str  # "" for tensor and number records; the parameter name (".grad" for gradients) in a module
    role: str  # "tensor", "number", "parameter", "buffer", "gradient"
    value: torch.Tensor
    tol_dtype: torch.dtype  # the dtype whose default tolerances apply

    @property
    def label(self) -> str:
        return f"{self.role} '{self.key}'" if self.key else self.role


@dataclass
class Record:
    name: str
    step: int
    seq: int
    rank: int
    kind: str  # "tensor", "number", "module"
    parts: list[Part]
    replicated: bool | None = None
    rtol: float | None = None
    atol: float | None = None
    file: str | None = None
    line: int | None = None
    auto: bool = False  # taken by distcheck itself (zero-code compare), not by a distcheck.record call
    # (index, size) of the rank's data-parallel coordinate where the rank knew it (the process groups of its
    # fully_shard/DDP wrapper): ranks with one index saw the same samples (tensor-parallel peers).
    dp: tuple[int, int] | None = None

    @property
    def site(self) -> str:
        return file_line(self.file, self.line) or ""


Key = tuple[str, int, int]  # (name, step, occurrence of that (name, step) on the rank)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _tensor(raw: memoryview, meta: records_file.PartMeta) -> torch.Tensor:
    dt = _dtype(meta.dtype)
    if not len(raw):
        return torch.empty(meta.shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(meta.shape)


def to_record(stored: records_file.StoredRecord) -> Record:
    """The record of one index line, its tensors made from their bytes."""
    entry = stored.entry
    if entry.kind == "number":
        v = entry.value
        if isinstance(v, bool) or isinstance(v, int):
            parts = [Part("", "number", torch.tensor(int(v), dtype=torch.int64), torch.int64)]
        else:
            parts = [Part("", "number", torch.tensor(float(v), dtype=torch.float64), NUMBER_TOL_DTYPE)]
    else:
        parts = []
        grads = entry.auto and entry.name == AUTO_GRADS
        for meta, raw in zip(entry.parts, stored.data):
            t = _tensor(raw, meta)
            parts.append(Part(meta.key, "gradient" if grads else meta.role, t, t.dtype))
    return Record(entry.name, entry.step, entry.seq, entry.rank, entry.kind, parts, entry.replicated, entry.rtol,
                  entry.atol, entry.file, entry.line, entry.auto, entry.dp)


def load_rank(report_dir: str | os.PathLike, rank: int) -> list[Record]:
    """One rank's records; a truncated last line, data cut short by a crash or a dtype this torch lacks is skipped,
    not fatal."""
    out = []
    for stored in records_file.read(report_dir, rank):
        try:
            out.append(to_record(stored))
        except (ValueError, TypeError, RuntimeError):
            continue
    return out


def load_run(report_dir: str | os.PathLike) -> dict[int, list[Record]]:
    return {r: load_rank(report_dir, r) for r in records_file.ranks(report_dir)}


def has_explicit(*runs: dict[int, list[Record]]) -> bool:
    """Whether any rank of any of the runs recorded something with distcheck.record."""
    return any(not rec.auto for run in runs for recs in run.values() for rec in recs)


def with_precedence(*runs: dict[int, list[Record]]) -> list[dict[int, list[Record]]]:
    """The runs without their automatic records when any of them holds an explicit one: what the script records
    itself is what its author wants compared, and keeping both would report one bug twice. The decision is taken
    over the runs together, so a run that crashed before its first explicit record is not compared on automatic
    records the other run lacks."""
    if not has_explicit(*runs):
        return list(runs)
    return [{rank: [r for r in recs if not r.auto] for rank, recs in run.items()} for run in runs]


def fold_accumulated_losses(run: dict[int, list[Record]]) -> dict[int, list[Record]]:
    """The automatic loss of a step with several backward() calls (gradient accumulation) as one record, their sum.

    Each micro-batch's loss depends on which rows the micro-batch holds, and that changes with the world size (the
    1-rank run's first micro-batch is rows 0-3 of the global batch, rank 0's in a 2-rank run rows 0-1): only the
    step's total is the same computation in both runs (each micro-batch loss divided by the number of
    micro-batches, the total is the mean over the rank's rows). The gradients and parameters are compared per step
    as before."""
    out: dict[int, list[Record]] = {}
    for rank, records in run.items():
        groups: dict[int, list[Record]] = {}
        for r in records:
            if r.auto and r.name == AUTO_LOSS and r.kind != "module" and len(r.parts) == 1:
                groups.setdefault(r.step, []).append(r)
        kept: list[Record] = []
        for r in records:
            group = groups.get(r.step) if r.auto and r.name == AUTO_LOSS else None
            if group is None or len(group) < 2:
                kept.append(r)
            elif r is group[0]:
                total = sum(g.parts[0].value.double() for g in group)
                part = r.parts[0]
                kept.append(Record(r.name, r.step, r.seq, r.rank, r.kind,
                                   [Part(part.key, part.role, total.to(part.value.dtype), part.tol_dtype)],
                                   r.replicated, r.rtol, r.atol, r.file, r.line, r.auto, r.dp))
        out[rank] = kept
    return out


def keyed(records: list[Record]) -> dict[Key, Record]:
    out: dict[Key, Record] = {}
    seen: dict[tuple[str, int], int] = {}
    for rec in records:
        n = seen.get((rec.name, rec.step), 0)
        seen[(rec.name, rec.step)] = n + 1
        out[(rec.name, rec.step, n)] = rec
    return out


@dataclass
class Resolved:
    key: Key
    record: Record  # the record whose value is compared (rank 0's, the majority's, or a mean)
    ranks: list[int]  # the ranks that recorded it
    mode: str  # "replicated", "rank R", "mean of N ranks", "majority"
    # Per-rank values that were averaged: their sum over the data-parallel ranks instead (a loss normalized by the
    # global batch or token count), which compare_runs takes when the parameters prove that convention.
    sum_record: Record | None = None
    sum_mode: str = ""


def _same(a: Part, b: Part) -> bool:
    return (a.key == b.key and a.value.dtype == b.value.dtype and a.value.shape == b.value.shape
            and torch.equal(a.value.reshape(-1).view(torch.uint8) if a.value.numel() else a.value,
                            b.value.reshape(-1).view(torch.uint8) if b.value.numel() else b.value))


def _group_by_value(recs: dict[int, Record]) -> list[list[int]]:
    """Ranks grouped by bit-identical values (replicas are bit-identical: same reduction results, same updates)."""
    groups: list[list[int]] = []
    for rank, rec in sorted(recs.items()):
        for g in groups:
            other = recs[g[0]]
            if len(other.parts) == len(rec.parts) and all(_same(a, b) for a, b in zip(other.parts, rec.parts)):
                g.append(rank)
                break
        else:
            groups.append([rank])
    return groups


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float64, or complex128 for complex values (.double() would drop their imaginary part)."""
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _mean_record(recs: dict[int, Record]) -> Record | None:
    first = recs[min(recs)]
    shapes = [[tuple(p.value.shape) for p in r.parts] for r in recs.values()]
    if any(s != shapes[0] for s in shapes) or any(len(r.parts) != len(first.parts) for r in recs.values()):
        return None
    parts = []
    for i, p in enumerate(first.parts):
        stacked = torch.stack([_wide(recs[r].parts[i].value) for r in sorted(recs)])
        parts.append(Part(p.key, p.role, stacked.mean(0), p.tol_dtype))
    return Record(first.name, first.step, first.seq, first.rank, first.kind, parts, first.replicated, first.rtol,
                  first.atol, first.file, first.line, first.auto, first.dp)


def _sum_record(recs: dict[int, Record]) -> tuple[Record, str] | None:
    """The per-rank values summed over the data-parallel ranks (each data-parallel group's mean over its
    tensor-parallel peers, which hold the same loss); without data-parallel coordinates, over every rank."""
    mean = _mean_record(recs)
    if mean is None:
        return None
    groups = dp_groups(sorted(recs), {r: rec.dp for r, rec in recs.items()})
    if groups is None:
        groups, mode = [[r] for r in sorted(recs)], f"sum of {len(recs)} ranks"
    else:
        mode = f"sum over the {len(groups)} data-parallel ranks" + \
               (f" (mean of each one's {len(groups[0])} ranks)" if len(groups[0]) > 1 else "")
    group_means = [_mean_record({r: recs[r] for r in g}) for g in groups]
    parts = [Part(p.key, p.role, torch.stack([m.parts[i].value for m in group_means]).sum(0), p.tol_dtype)
             for i, p in enumerate(mean.parts)]
    return Record(mean.name, mean.step, mean.seq, mean.rank, mean.kind, parts, mean.replicated, mean.rtol,
                  mean.atol, mean.file, mean.line, mean.auto, mean.dp), mode


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts (the divergence summary reads floats)."""
    return torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)


def _divergence_findings(key: Key, recs: dict[int, Record], groups: list[list[int]], nproc: int) -> list[Finding]:
    """tensor_divergence for the first part the ranks disagree on, named like check_consistent names it."""
    ordered = sorted(groups, key=lambda g: (-len(g), g[0]))
    majority = ordered[0]
    strict = len(majority) * 2 > sum(len(g) for g in groups)
    ref_rank = majority[0]
    ref = recs[ref_rank]
    ranks = sorted(recs)
    blamed = [r for r in ranks if r not in majority] if strict else ranks
    for i, part in enumerate(ref.parts):
        odd = [r for r in ranks if r not in majority
               and not (i < len(recs[r].parts) and _same(part, recs[r].parts[i]))]
        if not odd:
            continue
        structural = ""
        summaries = {}
        for r in odd:
            other = recs[r].parts[i] if i < len(recs[r].parts) else None
            if other is None or other.key != part.key:
                structural = f"rank {r} recorded {'no ' + part.label if other is None else other.label} there"
                break
            if (other.value.dtype, other.value.shape) != (part.value.dtype, part.value.shape):
                structural = (f"{str(part.value.dtype).replace('torch.', '')}{list(part.value.shape)} on rank "
                              f"{ref_rank} but {str(other.value.dtype).replace('torch.', '')}"
                              f"{list(other.value.shape)} on rank {r}")
                break
            shape = tuple(part.value.shape) + ((2,) if part.value.is_complex() else ())
            s = diff_chunk(r, _flat(part.value), _flat(other.value), 0, shape)
            if s is not None:
                summaries[r] = s
        name = part.key or key[0]
        role = part.role if part.key else "record"
        div = Divergence(name, role, ranks, ref_rank, blamed, {r: [0] for r in odd}, sorted(groups), structural)
        context = f"(record '{key[0]}', step {key[1]}, {nproc}-rank run{', ' + ref.site if ref.site else ''})"
        finding = divergence_finding(div, summaries, context)
        finding.detail.update(record=key[0], step=key[1], nproc=nproc, file=ref.file, line=ref.line)
        return [finding]
    return []


def resolve_run(per_rank: dict[int, list[Record]], nproc: int) -> tuple[dict[Key, Resolved], list[Finding]]:
    """One value per key, and tensor_divergence findings (at most one per record name: its first step)."""
    by_key: dict[Key, dict[int, Record]] = {}
    for rank, records in sorted(per_rank.items()):
        for key, rec in keyed(records).items():
            by_key.setdefault(key, {})[rank] = rec
    out: dict[Key, Resolved] = {}
    findings: list[Finding] = []
    diverged: set[str] = set()
    for key, recs in by_key.items():
        ranks = sorted(recs)
        first = recs[ranks[0]]
        if len(recs) == 1:
            out[key] = Resolved(key, first, ranks, f"rank {ranks[0]}" if nproc > 1 else "replicated")
            continue
        groups = _group_by_value(recs)
        if first.replicated is False or (len(groups) > 1 and first.replicated is None):
            mean = _mean_record(recs)
            if mean is not None:
                out[key] = Resolved(key, mean, ranks, "replicated" if len(groups) == 1 else f"mean of {len(ranks)} ranks")
                if len(groups) > 1 and first.kind != "module":
                    out[key].sum_record, out[key].sum_mode = _sum_record(recs) or (None, "")
                continue
        if len(groups) == 1:
            out[key] = Resolved(key, first, ranks, "replicated")
            continue
        ordered = sorted(groups, key=lambda g: (-len(g), g[0]))
        chosen = ordered[0] if len(ordered[0]) * 2 > len(ranks) else [ranks[0]]
        out[key] = Resolved(key, recs[chosen[0]], ranks, f"majority ({format_ranks(chosen)})"
                            if len(chosen) > 1 else f"rank {chosen[0]} (ranks disagree)")
        if key[0] not in diverged:
            diverged.add(key[0])
            findings.extend(_divergence_findings(key, recs, groups, nproc))
    return out, findings


# -- comparing the two runs ------------------------------------------------------------------------------------

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
    names = list(dict.fromkeys(k[0] for k in keys if k in ref and k in run and _is_loss(k[0])
                               and run[k].sum_record is not None))
    for name in names:
        mine = [k for k in keys if k[0] == name and k in ref and k in run]
        evidence = {k for k in keys if k in ref and k in run and ref[k].record.kind == "module"
                    and run[k].record.kind == "module"}
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


def _is_loss(name: str) -> bool:
    return "loss" in name.lower()


def _is_grad(row: Row) -> bool:
    return row.part_role == "gradient" or (not row.part and "grad" in row.name.lower())


def observed_factor(row: Row) -> float | None:
    """The median ratio of the differing part to the reference (where the reference is not ~0), or None."""
    if row.actual is None or row.expected is None or row.actual.shape != row.expected.shape:
        return None
    if row.actual.is_complex() or row.expected.is_complex():
        return None
    ratio = element_ratios(_wide(row.actual), _wide(row.expected))
    return float(ratio.median()) if ratio is not None else None


def hints(row: Row, rows: list[Row], nproc: int) -> list[str]:
    """Why the first differing record differs, where the pattern says so."""
    out = []
    if row.actual is not None and row.expected is not None and row.actual.shape == row.expected.shape:
        ratio = ratio_hint(_wide(row.actual), _wide(row.expected), nproc)
        if ratio and row.auto and row.name == AUTO_LOSS and ratio.startswith(f"the value is 1/{nproc} "):
            # The loss that drives backward(), not a logged copy: the generic "divided once too often" misleads,
            # the usual cause is a per-rank loss that is not a mean, and the updates shrink with it.
            ratio = (f"the loss is 1/{nproc} of the reference: each rank's loss is not the mean over its own "
                     f"batch (summed over the local batch with reduction='sum', or divided by the global batch "
                     f"size or the world size), and FSDP/DDP average the gradients over the ranks, so every "
                     f"update is 1/{nproc} of the 1-rank update")
        elif ratio and row.auto and row.name == AUTO_GRADS and ratio.startswith(f"the value is 1/{nproc} "):
            ratio = (f"the gradients are 1/{nproc} of the reference: they were divided twice (each rank's loss "
                     f"divided by the world size, or normalized by the global batch or token count, and FSDP/DDP "
                     f"average the gradients over the ranks as well), or averaged where the loss was already "
                     f"normalized globally (FSDP2: set_gradient_divide_factor(1.0) on every fully_shard module)")
        if ratio:
            out.append(ratio)
    if _is_grad(row):
        losses = [r for r in rows if r.step == row.step and _is_loss(r.name) and r is not row]
        if losses and all(r.status == STATUS_OK for r in losses):
            factor = observed_factor(row)
            if factor is not None and abs(factor - nproc) < 0.05 * nproc:
                why = f"they are {nproc}x the reference: summed over the ranks and not divided by {nproc}"
            elif factor is not None and abs(factor * nproc - 1) < 0.05:
                why = f"they are 1/{nproc} of the reference: divided by {nproc} once too often"
            else:  # no factor of the world size: name none
                seen = f"; they are {factor:.4g}x the reference, not a factor of the world size" \
                    if factor is not None else ""
                why = f"a missing or extra all-reduce, or gradients changed on some ranks{seen}"
            out.append(f"the loss matches the reference at step {row.step} but the gradients do not: the forward "
                       f"pass agrees and the gradient reduction does not ({why})")
    elif _is_loss(row.name) and not out:
        earlier = [r for r in rows if r.name == row.name and r.step < row.step]
        if not earlier:
            out.append(f"the loss differs already at its first step ({row.step}), before any update: the forward "
                       f"pass differs between world sizes (the data each rank sees, dropout or other RNG seeded "
                       f"per rank or per world size, initialization)")
    return out


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
    first = next((row for row in result.rows if row.status == STATUS_DIFF), None)
    if first is not None:
        resolved = run[first.key]
        if first.convention == "sum":  # the value compared is the sum, and the finding says so
            resolved = Resolved(resolved.key, resolved.sum_record or resolved.record, resolved.ranks,
                                resolved.sum_mode or resolved.mode)
        summed = None
        if first.convention != "sum" and _is_loss(first.name) and resolved.sum_record is not None:
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


def describe_row(row: Row) -> str:
    """What a row holds and where, in the user's terms for automatic records."""
    at = f" at {row.site}" if row.site else ""
    if row.auto and row.name == AUTO_LOSS:
        return f"the loss passed to backward(){at} ({AUTO_TEXT} as '{AUTO_LOSS}')"
    if row.auto and row.name == AUTO_PARAMS:
        what = f"parameter '{row.part}'" if row.part else "the parameters"
        return f"{what} after optimizer.step(){at} ({AUTO_TEXT} as '{AUTO_PARAMS}')"
    if row.auto and row.name == AUTO_GRADS:
        what = f"the gradient of parameter '{row.part}'" if row.part else "the gradients"
        return f"{what} at the first optimizer.step(){at} ({AUTO_TEXT} as '{AUTO_GRADS}')"
    what = f"{row.part_role} '{row.part}' of record '{row.name}'" if row.part else f"record '{row.name}'"
    return what + (f" ({row.site})" if row.site else "")


def mismatch_finding(row: Row, rows: list[Row], resolved: Resolved, nproc: int, summed: str | None = None,
                     extra: list[str] | None = None) -> Finding:
    """``summed``: the per-rank losses match the reference as this sum (while the parameters do not); ``extra``:
    more hints, last."""
    what = describe_row(row)
    cmp = row.comparison
    text = row.note if cmp is None else cmp.describe()
    message = (f"step {row.step}: {what} differs between the {nproc}-rank run and the 1-rank reference: "
               f"{text}")
    if resolved.mode != "replicated":
        message += f" [{nproc}-rank value: {resolved.mode}]"
    found = hints(row, rows, nproc)
    if summed:
        found.append(f"the ranks' losses match the reference as their {summed}, but the "
                     f"parameters do not: a loss normalized by the global batch or token count needs its gradients "
                     f"summed over the data-parallel ranks, not averaged (FSDP2: set_gradient_divide_factor(1.0) "
                     f"on every fully_shard module)")
    found += extra or []
    if found:
        message += "; " + "; ".join(found)
    detail: dict[str, Any] = {"name": row.name, "step": row.step, "nproc": nproc, "mode": resolved.mode,
                              "file": row.file, "line": row.line}
    if row.auto:
        detail["auto"] = True
    if row.part:
        detail.update(part=row.part, part_role=row.part_role)
    if cmp is not None:
        detail.update(abs_err=cmp.max_abs, rel_err=cmp.max_rel, index=cmp.index, value=cmp.actual,
                      reference=cmp.expected, rtol=cmp.rtol, atol=cmp.atol)
        if cmp.actual_imag is not None:  # complex: value/reference hold the real parts
            detail.update(value_imag=cmp.actual_imag, reference_imag=cmp.expected_imag)
        if cmp.note:
            detail["structural"] = cmp.note
    if row.note:
        detail["structural"] = row.note
    if found:
        detail["hints"] = found
    return Finding("reference_mismatch", resolved.ranks, message, detail)


def _steps_text(steps: list[int]) -> str:
    return format_ranks(steps).replace("ranks ", "steps ").replace("rank ", "step ")


def missing_finding(name: str, status: str, rows: list[Row], run: dict[Key, Resolved], nproc: int) -> Finding:
    steps = sorted({r.step for r in rows})
    site = next((r.site for r in rows if r.site), "")
    where = f" ({site})" if site else ""
    auto = " (" + AUTO_TEXT + ")" if rows[0].auto else ""
    if status == STATUS_MISSING_RUN:
        ranks = list(range(nproc))
        message = (f"record '{name}'{auto}{where} at {_steps_text(steps)} is in the 1-rank reference but not in the "
                   f"{nproc}-rank run (it stopped early, or records conditionally on the world size)")
    else:
        ranks = sorted({rk for r in rows for rk in run[r.key].ranks})
        message = (f"record '{name}'{auto}{where} at {_steps_text(steps)} is in the {nproc}-rank run "
                   f"({format_ranks(ranks)}) but not in the 1-rank reference")
    detail = {"name": name, "steps": steps, "nproc": nproc,
              "missing_in": "reference" if status == STATUS_MISSING_REF else f"{nproc}-rank run"}
    first = rows[0]
    detail.update(file=first.file, line=first.line)
    if first.auto:
        detail["auto"] = True
    return Finding("reference_mismatch", ranks, message, detail)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def render_table(rows: list[Row], conventions: dict[str, Convention] | None = None) -> str:
    """Every record with its error against the reference; for a module, the first differing parameter; and how
    the ranks' own losses were found to make the reference's (their mean, or their sum)."""
    if not rows:
        return "(no records)"
    names = [r.name + (f" #{r.key[2] + 1}" if r.key[2] else "") for r in rows]
    width = max(6, max(len(n) for n in names))
    lines = [f"{'step':<5} {'record':<{width}} {'status':<21} {'max abs err':<11} {'rel err':<9} value / note"]
    for row, name in zip(rows, names):
        note = row.mode
        if row.status == STATUS_DIFF:
            note = (f"first differing {row.part_role} '{row.part}'" if row.part else "differs") + \
                   (f" ({row.note})" if row.note else "") + (f"; {row.mode}" if row.mode else "")
        if row.auto:
            note = f"{note}, {AUTO_TEXT}" if note else AUTO_TEXT
        lines.append(f"{row.step:<5} {name:<{width}} {row.status:<21} {_num(row.abs_err):<11} "
                     f"{_num(row.rel_err):<9} {note}")
    auto_names = sorted({r.name for r in rows if r.auto})
    if auto_names:
        what = {AUTO_LOSS: f"{AUTO_LOSS} = the loss passed to backward() (summed over a step's backward() calls "
                           f"when there are several, gradient accumulation; each rank's own: compared as "
                           f"their mean, or as their sum where a loss convention below says so)",
                AUTO_PARAMS: f"{AUTO_PARAMS} = every parameter after optimizer.step() (full tensors)",
                AUTO_GRADS: f"{AUTO_GRADS} = every parameter's gradient at the first optimizer.step() (full "
                            f"tensors)"}
        lines.append(f"{AUTO_TEXT} (the script records nothing itself): "
                     + "; ".join(what.get(n, n) for n in auto_names))
    for name, convention in (conventions or {}).items():
        lines.append(convention.text(name))
    rules = list(dict.fromkeys(r.rule.text() for r in rows if r.rule is not None and r.rule.why != "exact: integers"))
    if rules:
        lines.append("tolerance: " + "; ".join(rules))
    return "\n".join(lines)
