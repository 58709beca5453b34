"""Resolving a run's records: which are compared, and one value per (name, step) out of every rank's.

    from distcheck.analysis.record_resolve import resolve_run
    resolved, divergences = resolve_run(load_run("report/nproc2"), nproc=2)

    python -m pytest -q tests/unit/test_records.py -k "replicated or mean or precedence or accumulated"

Replicas must agree bit for bit (a ``tensor_divergence`` names the first part they do not); per-rank values such as
local losses are averaged, and also summed over the data-parallel ranks for the loss convention
(analysis/record_compare.loss_conventions). Explicit records win over automatic ones (``with_precedence``), and a
step's accumulated automatic losses are folded into their sum. Plain tensor math, no process group, no file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from distcheck.analysis.module_diff import dp_groups
from distcheck.analysis.record_values import Key, Part, Record, wide
from distcheck.analysis.replicas import Divergence, diff_chunk, divergence_finding
from distcheck.contract.files import AUTO_LOSS
from distcheck.contract.findings import Finding, format_ranks


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


def _mean_record(recs: dict[int, Record]) -> Record | None:
    first = recs[min(recs)]
    shapes = [[tuple(p.value.shape) for p in r.parts] for r in recs.values()]
    if any(s != shapes[0] for s in shapes) or any(len(r.parts) != len(first.parts) for r in recs.values()):
        return None
    parts = []
    for i, p in enumerate(first.parts):
        stacked = torch.stack([wide(recs[r].parts[i].value) for r in sorted(recs)])
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
