"""Explaining what differs from the reference: the finding of the first differing record with its hints, the
findings of records one run lacks, and the table of every record.

    from distcheck.analysis.record_explain import mismatch_finding, render_table
    python -m pytest -q tests/unit/test_records.py tests/unit/test_precision_tolerance.py -k "hint or table or missing"

A hint is said only where the pattern shows it: a value that is 1/N or N times the reference (a loss that is not a
mean over the rank's batch, gradients divided twice or summed and not divided), gradients that differ while the
loss matches (the reduction), a loss that differs before any update (the forward pass). Plain tensor math, no
process group, no file.
"""
from __future__ import annotations

from typing import Any

from distcheck.analysis.record_compare import (AUTO_TEXT, STATUS_DIFF, STATUS_MISSING_REF, STATUS_MISSING_RUN,
                                               STATUS_OK, Convention, Row, is_loss)
from distcheck.analysis.record_resolve import Resolved
from distcheck.analysis.record_values import Key, wide
from distcheck.analysis.tolerance import element_ratios, ratio_hint
from distcheck.contract.files import AUTO_GRADS, AUTO_INIT, AUTO_LOSS, AUTO_PARAMS
from distcheck.contract.findings import Finding, format_ranks


def _is_grad(row: Row) -> bool:
    return row.part_role == "gradient" or (not row.part and "grad" in row.name.lower())


def observed_factor(row: Row) -> float | None:
    """The median ratio of the differing part to the reference (where the reference is not ~0), or None."""
    if row.actual is None or row.expected is None or row.actual.shape != row.expected.shape:
        return None
    if row.actual.is_complex() or row.expected.is_complex():
        return None
    ratio = element_ratios(wide(row.actual), wide(row.expected))
    return float(ratio.median()) if ratio is not None else None


def _same_shards(t: Any, nproc: int) -> bool:
    """Whether a full tensor's ``nproc`` chunks along dim 0 (FSDP2's and a Shard(0) DTensor's split) hold the same
    values: every rank drew its shard from the same random state."""
    if t is None or t.dim() == 0 or t.shape[0] < nproc or not t.is_floating_point():
        return False
    chunks = t.chunk(nproc)
    size = min(c.shape[0] for c in chunks)
    first = chunks[0][:size]
    return len(chunks) == nproc and bool(first.abs().sum() > 0) and all(c[:size].equal(first) for c in chunks[1:])


def init_hints(row: Row, nproc: int) -> list[str]:
    """The runs start from different parameters (``auto/init`` differs): what that means, and the random init of a
    sharded model whose shards came out alike."""
    what = f"parameter '{row.part}'" if row.part else "the parameters"
    out = [f"the runs start from different parameters: {what} already differs before the first optimizer.step(), so "
           f"every later difference (loss, gradients, updates) follows from it; make the N-rank model's initial "
           f"values the 1-rank model's (the same seed before the model is built, or rank 0's weights broadcast)"]
    if _same_shards(row.actual, nproc) and not _same_shards(row.expected, nproc):
        out.append(f"its {nproc} shards along dim 0 hold the same values in the {nproc}-rank run: each rank drew its "
                   f"shard from the same random state. That is DTensor's random init on a CPU mesh (torch warns its "
                   f"random ops 'may not have complete support on cpu device mesh'): a model sharded with "
                   f"fully_shard or distribute_tensor and then initialized (to_empty, init_weights or "
                   f"reset_parameters) on CPU. Initialize the full model before sharding it, or on a GPU mesh, where "
                   f"DTensor offsets each shard's draws")
    return out


def hints(row: Row, rows: list[Row], nproc: int) -> list[str]:
    """Why the first differing record differs, where the pattern says so."""
    if row.auto and row.name == AUTO_INIT:
        return init_hints(row, nproc)
    out = []
    if row.actual is not None and row.expected is not None and row.actual.shape == row.expected.shape:
        ratio = ratio_hint(wide(row.actual), wide(row.expected), nproc)
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
        losses = [r for r in rows if r.step == row.step and is_loss(r.name) and r is not row]
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
    elif is_loss(row.name) and not out:
        earlier = [r for r in rows if r.name == row.name and r.step < row.step]
        if not earlier:
            out.append(f"the loss differs already at its first step ({row.step}), before any update: the forward "
                       f"pass differs between world sizes (the data each rank sees, dropout or other RNG seeded "
                       f"per rank or per world size, initialization)")
    return out


def describe_row(row: Row) -> str:
    """What a row holds and where, in the user's terms for automatic records."""
    at = f" at {row.site}" if row.site else ""
    if row.auto and row.name == AUTO_LOSS:
        return f"the loss passed to backward(){at} ({AUTO_TEXT} as '{AUTO_LOSS}')"
    if row.auto and row.name == AUTO_PARAMS:
        what = f"parameter '{row.part}'" if row.part else "the parameters"
        return f"{what} after optimizer.step(){at} ({AUTO_TEXT} as '{AUTO_PARAMS}')"
    if row.auto and row.name == AUTO_INIT:
        what = f"parameter '{row.part}'" if row.part else "the parameters"
        return f"{what} before the first optimizer.step(){at} ({AUTO_TEXT} as '{AUTO_INIT}')"
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
                AUTO_INIT: f"{AUTO_INIT} = every parameter before the first optimizer.step() (full tensors)",
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
