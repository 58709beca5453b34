"""The first module whose output, or whose input's gradient, differs from the 1-rank reference (pure, no torch).

    python -m distcheck compare --nproc 2 -- train.py      # rank/autocheck/module_summaries.py writes the rows

Each run's ``autocheck-rank<R>.json`` holds, under ``modules``, one row per module of the first step: its name,
class and ``forward`` line, a per-sample summary of its output (``out``: for each sample along dim 0, the sum and
the sum of squares of its values) and of the gradient that reached its input (``grad_in``). The N-rank summaries
are mapped onto the reference's batch, per module:

* ``cat``: the ranks' samples add up to the reference's (data parallelism: each rank its slice, in rank order);
* ``sum``: every rank has all the samples but a slice of the other dims (a tensor-parallel shard), or a DTensor
  says it is sharded off dim 0: the per-sample sums (and sums of squares) add up; ``partial``: a Partial DTensor
  (a row-wise layer's output before its all-reduce): only the sums add up;
* ``same``: every rank has the whole output (replicated): each rank's values must be the reference's.

Any other shape is ambiguous and said so, never guessed. Forward: the first module, in the order modules finish,
whose mapped output differs beyond tolerance. Backward: the first module, in backward order, whose input gradient
differs, after one scale factor taken at the module nearest the loss (each data-parallel rank averages its loss
over its own, smaller batch, so every gradient is N times the reference's).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

RTOL = 1e-3  # of each sample's own scale, sqrt(k * sum of squares): float32 sums reassociated across shards
ATOL = 1e-6


@dataclass
class ModuleDiff:
    name: str
    cls: str
    file: str | None
    line: int | None
    side: str  # "forward" (its output) or "backward" (the gradient w.r.t. its input)
    how: str  # how the N-rank values were mapped: cat, sum, same
    max_abs: float
    max_rel: float
    ranks: list[int]  # the ranks whose values differ (all ranks for cat/sum)
    matched_before: int  # modules before it (in that side's order) that matched
    scale: float = 1.0  # backward: the factor the N-rank gradients were multiplied by
    site_kind: str = "forward"  # the line is its forward's, or ("created") where the user creates a torch layer
    input_matches: bool | None = None  # forward: whether its input matched (None: not known)

    @property
    def label(self) -> str:
        return self.name or "<model>"

    @property
    def site(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}" if self.file and self.line else "?"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.label, "class": self.cls, "file": self.file, "line": self.line, "side": self.side,
                "mapping": self.how, "max_abs": self.max_abs, "max_rel": self.max_rel, "ranks": self.ranks,
                "matched_before": self.matched_before, "scale": self.scale, "site_kind": self.site_kind,
                "input_matches": self.input_matches}


def _rows(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in state.get("modules") or []:
        out.setdefault(row["name"], row)  # a DDP wrapper and its module share a name: the inner one ran first
    return out


def _combine(parts: dict[int, dict[str, Any]], ref: dict[str, Any]) -> tuple[str, Any] | tuple[None, str]:
    """The N-rank summaries as ("cat"|"sum", (s1, s2)) or ("same", {rank: (s1, s2)}), or (None, why not)."""
    ranks = sorted(parts)
    hows = {parts[r].get("how") for r in ranks}
    ns = [parts[r]["n"] for r in ranks]
    shapes = [parts[r].get("shape") for r in ranks]
    if hows - {None}:
        how = hows.pop() if len(hows) == 1 else "mixed"
    elif all(s == ref.get("shape") for s in shapes):
        how = "same"
    elif all(n == ref["n"] for n in ns):
        how = "sum"
    elif sum(ns) == ref["n"]:
        how = "cat"
    else:
        return None, (f"the ranks' outputs have {ns} samples and shapes {shapes}, the reference "
                      f"{ref['n']} and {ref.get('shape')}: not a split of its batch or of its other dims")
    if how == "same":
        return how, {r: (parts[r]["s1"], parts[r]["s2"]) for r in ranks}
    if how == "cat":
        if sum(ns) != ref["n"]:
            return None, f"dim-0 shards of {ns} samples do not add up to the reference's {ref['n']}"
        return how, ([v for r in ranks for v in parts[r]["s1"]], [v for r in ranks for v in parts[r]["s2"]])
    if how in ("sum", "partial"):
        if any(n != ref["n"] for n in ns):
            return None, f"shards of {ns} samples where the reference has {ref['n']}"
        # Disjoint shards' squares add up too; a pending (Partial) sum's do not: only its sums are compared.
        return how, ([sum(parts[r]["s1"][i] for r in ranks) for i in range(ref["n"])],
                     None if how == "partial" else [sum(parts[r]["s2"][i] for r in ranks) for i in range(ref["n"])])
    return None, f"a DTensor sharded both on dim 0 and on other dims ({how})"


def _error(s1: list[float], s2: list[float], ref: dict[str, Any], scale: float) -> tuple[float, float, bool]:
    """(max abs diff, max rel diff, beyond tolerance?) over the per-sample sums and per-sample L2 norms, whichever
    differs more (a normalized output sums to about 0 per sample: its norms carry the difference)."""
    worst_abs = worst_rel = 0.0
    bad = False
    scale_ref = max((abs(b) for b in ref["s1"]), default=0.0) or 1.0
    known = s2 is not None  # None: a Partial DTensor's pending sum, whose squares say nothing
    for a, b, q, qb in zip(s1, ref["s1"], s2 if known else ref["s2"], ref["s2"]):
        a, q = a * scale, (q * scale * scale if known else qb)
        if not all(map(math.isfinite, (a, b, q, qb))):
            if (a, q) != (b, qb):
                return math.inf, math.inf, True
            continue
        bound = RTOL * math.sqrt(ref.get("k", 1) * max(qb, 0.0)) + ATOL
        d = abs(a - b)
        norm, norm_ref = math.sqrt(max(q, 0.0)), math.sqrt(max(qb, 0.0))
        dn = abs(norm - norm_ref)
        # A sum is judged against its sample's own scale (sqrt(k) times its norm): a normalized output sums to ~0.
        for diff, rel in ((d, d / (math.sqrt(ref.get("k", 1)) * norm_ref or scale_ref)), (dn, dn / (norm_ref or 1.0))):
            if rel > worst_rel:
                worst_abs, worst_rel = diff, rel
        if d > bound or abs(q - qb) > RTOL * qb + ATOL:
            bad = True
    return worst_abs, worst_rel, bad


def _compare(ref: dict[str, Any], parts: dict[int, dict[str, Any]], scale: float = 1.0
             ) -> tuple[str | None, float, float, list[int], str | None]:
    """(mapping, max abs, max rel, differing ranks, ambiguity); differing ranks empty: it matches."""
    how, combined = _combine(parts, ref)
    if how is None:
        return None, 0.0, 0.0, [], combined
    if how == "same":
        worst = (0.0, 0.0)
        odd = []
        for r, (s1, s2) in combined.items():
            if len(s1) != ref["n"]:
                return None, 0.0, 0.0, [], f"rank {r} has {len(s1)} samples, the reference {ref['n']}"
            a, rel, bad = _error(s1, s2, ref, scale)
            if bad:
                odd.append(r)
                worst = max(worst, (a, rel))
        return how, worst[0], worst[1], odd, None
    a, rel, bad = _error(combined[0], combined[1], ref, scale)
    return how, a, rel, (sorted(parts) if bad else []), None


def first_divergent_module(reference: dict[int, dict[str, Any]], nrank: dict[int, dict[str, Any]]
                           ) -> tuple[ModuleDiff | None, list[str]]:
    """The first module that differs, forward first, then backward; and notes (ambiguous mappings, no data)."""
    ref_rows = _rows(reference.get(0) or {})
    per_rank = {r: _rows(s) for r, s in nrank.items()}
    notes: list[str] = []
    if not ref_rows or not per_rank or not all(per_rank.values()):
        return None, ["no module outputs were captured in both runs (no forward before the first step)"]
    shared = [name for name in ref_rows if all(name in rows for rows in per_rank.values())]
    forward = sorted(shared, key=lambda n: ref_rows[n]["order"])
    matched = 0
    for name in forward:
        ref = ref_rows[name]
        if not ref.get("out") or not all(rows[name].get("out") for rows in per_rank.values()):
            continue
        how, a, rel, odd, why = _compare(ref["out"], {r: rows[name]["out"] for r, rows in per_rank.items()})
        if why:
            notes.append(f"'{name or '<model>'}': {why}")
            continue
        if odd:
            input_matches = None
            if ref.get("in") and all(rows[name].get("in") for rows in per_rank.values()):
                _, _, _, odd_in, why_in = _compare(ref["in"], {r: rows[name]["in"] for r, rows in per_rank.items()})
                input_matches = None if why_in else not odd_in
            return ModuleDiff(name, ref["cls"], ref.get("file"), ref.get("line"), "forward", how, a, rel, odd,
                              matched, site_kind=ref.get("site_kind", "forward"),
                              input_matches=input_matches), notes
        matched += 1
    backward = sorted((n for n in shared if ref_rows[n].get("grad_in")
                       and all(rows[n].get("grad_in") for rows in per_rank.values())),
                      key=lambda n: ref_rows[n].get("grad_order", 0))
    scale = None
    matched = 0
    for name in backward:
        ref = ref_rows[name]
        parts = {r: rows[name]["grad_in"] for r, rows in per_rank.items()}
        if scale is None:  # the module nearest the loss sets the loss's scale (1/N under per-rank mean losses)
            how, combined = _combine(parts, ref["grad_in"])
            if how is None:
                notes.append(f"'{name or '<model>'}' gradient: {combined}")
                continue
            squares = next(iter(combined.values()))[1] if how == "same" else combined[1]
            q = sum(squares) if squares is not None else 0.0  # a Partial gradient: no scale to read
            scale = math.sqrt(sum(ref["grad_in"]["s2"]) / q) if q > 0 else 1.0
            if abs(scale - 1.0) < 1e-3:
                scale = 1.0
        how, a, rel, odd, why = _compare(ref["grad_in"], parts, scale)
        if why:
            notes.append(f"'{name or '<model>'}' gradient: {why}")
            continue
        if odd:
            return ModuleDiff(name, ref["cls"], ref.get("file"), ref.get("line"), "backward", how, a, rel, odd,
                              matched, scale, site_kind=ref.get("site_kind", "forward")), notes
        matched += 1
    return None, notes


def describe(diff: ModuleDiff) -> str:
    """One or two sentences for the reference_mismatch finding."""
    what = "output" if diff.side == "forward" else "gradient w.r.t. its input"
    mapping = {"cat": "the ranks' batch slices in rank order", "sum": "the ranks' shards added up",
               "partial": "the ranks' pending (Partial) sums added up", "same": "each rank's whole value"}[diff.how]
    before = ("it is the first module" if not diff.matched_before else "the one module before it matches"
              if diff.matched_before == 1 else f"all {diff.matched_before} modules before it match")
    text = (f"First module whose {what} differs from the 1-rank reference in the first step: '{diff.label}' "
            f"({diff.cls}, {diff.site_kind} at {diff.site}): per-sample sums or norms differ by up to "
            f"{diff.max_abs:.3g} (relative {diff.max_rel:.2g}), compared as {mapping}; {before}")
    if diff.side == "backward":
        text += (" in backward order, and every module's output matched in forward: its backward computes a "
                 "different gradient (a reduction it skips, a custom autograd Function)")
        if diff.scale != 1.0:
            text += f"; gradients compared after scaling by {diff.scale:.3g}, the ratio at the loss"
    if diff.how == "same" and len(diff.ranks) == 1:
        text += f"; it differs on rank {diff.ranks[0]}"
    if diff.input_matches is True:
        text += "; its input matches the reference, so this module itself computes something else"
    elif diff.input_matches is False:
        text += ("; its input already differs: the difference arises before it, in the data each rank loads or in "
                 "code between modules")
    return text


def explain_mismatch(finding: Any, reference: dict[int, dict[str, Any]], nrank: dict[int, dict[str, Any]]) -> None:
    """Add the first divergent module to a ``reference_mismatch`` finding (message and ``detail.module``)."""
    diff, notes = first_divergent_module(reference, nrank)
    if notes:
        finding.detail["module_notes"] = notes
    if diff is not None:
        finding.message += "\n" + describe(diff)
        finding.detail["module"] = diff.to_json()
    elif (reference.get(0) or {}).get("modules"):
        finding.message += ("\nEvery module's output and input gradient in the first step match the 1-rank "
                            "reference: the difference arises outside the modules (how the loss is computed from "
                            "their output, the optimizer step, or the data of later steps)")


def element_error(reference: dict[str, Any], parts: dict[int, dict[str, Any]], how: str) -> dict[str, Any] | str:
    """The element-wise error of the N-rank tensors (``module-capture-rank<R>.pt`` contents) against the reference's,
    reassembled as ``how`` says; or why they cannot be reassembled. Only ever run on the one module named."""
    import torch

    ref = reference["tensor"].double()
    ranks = sorted(parts)
    local = [parts[r]["tensor"].double() for r in ranks]
    if how == "same":
        candidates = {r: t for r, t in zip(ranks, local)}
    elif how == "cat":
        candidates = {-1: torch.cat(local, 0)}
    elif how == "partial":
        candidates = {-1: torch.stack(local).sum(0)} if all(t.shape == ref.shape for t in local) else {}
    else:  # shards of another dim: the DTensor's Shard(d), or the one dim where the local shape differs
        import re

        placed = {int(m) for r in ranks for p in parts[r].get("placements") or ()
                  for m in re.findall(r"Shard\(dim=(-?\d+)", p)}
        dims = placed or {d for t in local for d in range(t.dim())
                          if t.dim() == ref.dim() and t.shape[d] != ref.shape[d]}
        candidates = {-1: torch.cat(local, dims.pop())} if len(dims) == 1 else {}
    out: dict[str, Any] = {}
    for r, t in candidates.items():
        if t.shape != ref.shape:
            return f"the reassembled {list(t.shape)} does not have the reference's shape {list(ref.shape)}"
        delta = (t - ref).abs().nan_to_num(nan=math.inf)
        worst = int(delta.reshape(-1).argmax())
        index = list(torch.unravel_index(torch.tensor(worst), ref.shape)) if ref.dim() else []
        max_abs = float(delta.reshape(-1)[worst]) if delta.numel() else 0.0
        if not out or max_abs > out["max_abs"]:
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            out = {"max_abs": max_abs, "max_rel": max_abs / scale if scale else math.inf,
                   "index": [int(i) for i in index], "value": float(t.reshape(-1)[worst]),
                   "reference": float(ref.reshape(-1)[worst]), "rank": None if r < 0 else r}
    return out or f"no way to put the ranks' shapes {[list(t.shape) for t in local]} together as {how}"
