"""The first module whose output, or whose input's gradient, differs from the 1-rank reference (pure, no torch).

    python -m distcheck compare --nproc 2 -- train.py      # rank/autocheck/module_summaries.py writes the rows

Each run's ``autocheck-rank<R>.json`` holds, under ``modules``, one row per module of the first step: its name,
class and ``forward`` line, a per-sample summary of its output (``out``: for each sample along dim 0, the sum and
the sum of squares of its values) and of the gradient that reached its input (``grad_in``), and the rank's
data-parallel coordinate (``dp``: index and size, where its fully_shard/DDP wrapper says). The N-rank summaries
are mapped onto the reference's batch, per module:

* with every rank's coordinate known (any mesh): the batch is sliced along the data-parallel ranks only, in index
  order, and each slice is put together from the ranks that share its index (tensor/sequence-parallel peers) by
  their DTensor placements, or by their shapes against the reference's: ``cat/sum``, ``cat/partial``,
  ``cat/same`` (``cat`` when each slice is one rank; the inner mapping alone when there is one slice);
* without it, from shapes alone: ``cat``: the ranks' samples add up to the reference's (data parallelism, rank
  order); ``sum``: every rank has all the samples but a slice of the other dims (a tensor-parallel shard), or a
  DTensor says it is sharded off dim 0: the per-sample sums (and sums of squares) add up; ``partial``: a Partial
  DTensor (a row-wise layer's output before its all-reduce): only the sums add up; ``same``: every rank has the
  whole output (replicated): each rank's values must be the reference's.

Any other shape is ambiguous and said so (a note), never guessed, and never counted as a match: "every module
matches" is said only when every module of the reference was mapped and compared. Forward: the first module, in
the order modules finish, whose mapped output differs beyond tolerance. Backward: the first module, in backward
order, whose input gradient (taken on the tensor the caller passed) differs, after one scale factor taken at the
module nearest the loss (each data-parallel rank averages its loss over its own, smaller batch, so every gradient
is N times the reference's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distcheck.contract.site import file_line

RTOL = 1e-3  # of each sample's own scale, sqrt(k * sum of squares): float32 sums reassociated across shards
ATOL = 1e-6


@dataclass
class ModuleDiff:
    name: str
    cls: str
    file: str | None
    line: int | None
    side: str  # "forward" (its output) or "backward" (the gradient w.r.t. its input)
    how: str  # how the N-rank values were mapped: cat, sum, partial, same, or cat/<inner> on a mesh of several dims
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
        return file_line(self.file, self.line) or "?"

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


def dp_groups(ranks: list[int], dps: dict[int, Any]) -> list[list[int]] | None:
    """The ranks grouped by data-parallel index, in index order (each group: tensor-parallel peers that saw one
    batch slice), when every rank knew its (index, size), the sizes agree, every index is there and each holds as
    many ranks; None otherwise."""
    if not ranks or any(not dps.get(r) for r in ranks):
        return None
    sizes = {int(dps[r][1]) for r in ranks}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    groups: list[list[int]] = [[] for _ in range(size)]
    for r in sorted(ranks):
        index = int(dps[r][0])
        if not 0 <= index < size:
            return None
        groups[index].append(r)
    if not groups[0] or any(len(g) != len(groups[0]) for g in groups):
        return None
    return groups


@dataclass
class Piece:
    """Some ranks' summaries put together, standing for the reference's samples [offset, offset + len(s1))."""

    ranks: list[int]  # blamed together when the piece differs
    s1: list[float]
    s2: list[float] | None  # None: a Partial DTensor's pending sum, whose squares say nothing
    offset: int


def _summed(parts: dict[int, dict[str, Any]], ranks: list[int], n: int, partial: bool) -> tuple[list, list | None]:
    return ([sum(parts[r]["s1"][i] for r in ranks) for i in range(n)],
            None if partial else [sum(parts[r]["s2"][i] for r in ranks) for i in range(n)])


def _one_slice(parts: dict[int, dict[str, Any]], ref: dict[str, Any], offset: int
               ) -> tuple[str, list[Piece], int] | tuple[None, str, int]:
    """One batch slice held by ``parts`` (tensor-parallel peers, or the whole world without data parallelism): how
    they combine, their pieces, and the slice's number of samples (the reference's rest of the shape is the
    target: a peer holding it all is a replica, one holding a part of it a shard)."""
    ranks = sorted(parts)
    hows = {parts[r].get("how") for r in ranks} - {None}
    ns = [parts[r]["n"] for r in ranks]
    rest = [(parts[r].get("shape") or [])[1:] for r in ranks]
    ref_rest = (ref.get("shape") or [])[1:]
    if hows:
        how = hows.pop() if len(hows) == 1 else "mixed"
    elif len(set(ns)) != 1:
        return None, f"tensor-parallel peers {format_list(ranks)} hold {ns} samples of one batch slice", 0
    elif len(ranks) == 1 or all(r == ref_rest for r in rest):
        how = "same"
    else:
        how = "sum"
    if how == "cat":  # sharded on dim 0 among the peers themselves
        pieces, at = [], offset
        for r in ranks:
            pieces.append(Piece([r], parts[r]["s1"], parts[r]["s2"], at))
            at += parts[r]["n"]
        return how, pieces, at - offset
    if how in ("same", "sum", "partial") and len(set(ns)) != 1:
        return None, f"shards of {ns} samples on ranks {format_list(ranks)}", 0
    n = ns[0]
    if how == "same":
        return how, [Piece([r], parts[r]["s1"], parts[r]["s2"], offset) for r in ranks], n
    if how in ("sum", "partial"):
        s1, s2 = _summed(parts, ranks, n, how == "partial")
        return how, [Piece(ranks, s1, s2, offset)], n
    return None, f"a DTensor sharded both on dim 0 and on other dims ({how})", 0


def format_list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _combine(parts: dict[int, dict[str, Any]], ref: dict[str, Any]) -> tuple[str, list[Piece]] | tuple[None, str]:
    """The N-rank summaries as pieces of the reference's batch, and the mapping's name; or (None, why not).

    With every rank's data-parallel coordinate known, the batch is sliced along the data-parallel ranks only
    (index order) and each slice is put together from its tensor-parallel peers; without it, from shapes alone:
    the ranks' samples concatenate (dim-0 shards), add up (shards of other dims), or are each the whole."""
    ranks = sorted(parts)
    groups = dp_groups(ranks, {r: parts[r].get("dp") for r in ranks})
    if groups is not None:
        pieces: list[Piece] = []
        hows, sizes, offset = set(), [], 0
        for group in groups:
            how, got, n = _one_slice({r: parts[r] for r in group}, ref, offset)
            if how is None:
                return None, got
            hows.add(how)
            pieces += got
            sizes.append(n)
            offset += n
        if offset != ref["n"]:
            return None, (f"the {len(groups)} data-parallel ranks' batch slices of {sizes} samples (shapes "
                          f"{[parts[g[0]].get('shape') for g in groups]}) do not make the reference's {ref['n']} "
                          f"(shape {ref.get('shape')})")
        inner = hows.pop() if len(hows) == 1 else "mixed"
        if inner == "mixed":
            return None, f"tensor-parallel shards combine differently in different batch slices ({sorted(hows)})"
        if len(groups) == 1:
            return inner, pieces
        return ("cat" if len(groups[0]) == 1 else f"cat/{inner}"), pieces
    return _combine_by_shape(parts, ref)


def _combine_by_shape(parts: dict[int, dict[str, Any]], ref: dict[str, Any]
                      ) -> tuple[str, list[Piece]] | tuple[None, str]:
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
        return how, [Piece([r], parts[r]["s1"], parts[r]["s2"], 0) for r in ranks]
    if how == "cat":
        if sum(ns) != ref["n"]:
            return None, f"dim-0 shards of {ns} samples do not add up to the reference's {ref['n']}"
        pieces, at = [], 0
        for r in ranks:
            pieces.append(Piece([r], parts[r]["s1"], parts[r]["s2"], at))
            at += parts[r]["n"]
        return how, pieces
    if how in ("sum", "partial"):
        if any(n != ref["n"] for n in ns):
            return None, f"shards of {ns} samples where the reference has {ref['n']}"
        # Disjoint shards' squares add up too; a pending (Partial) sum's do not: only its sums are compared.
        s1, s2 = _summed(parts, ranks, ref["n"], how == "partial")
        return how, [Piece(ranks, s1, s2, 0)]
    return None, f"a DTensor sharded both on dim 0 and on other dims ({how})"


def _slice(ref: dict[str, Any], offset: int, n: int) -> dict[str, Any]:
    return {**ref, "n": n, "s1": ref["s1"][offset:offset + n], "s2": ref["s2"][offset:offset + n]}


def _error(s1: list[float], s2: list[float] | None, ref: dict[str, Any], scale: float) -> tuple[float, float, bool]:
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
    how, pieces = _combine(parts, ref)
    if how is None:
        return None, 0.0, 0.0, [], pieces
    worst, worst_bad = (0.0, 0.0), None
    odd: set[int] = set()
    for piece in pieces:
        if piece.offset + len(piece.s1) > ref["n"]:
            return None, 0.0, 0.0, [], f"ranks {format_list(piece.ranks)} hold more samples than the reference"
        a, rel, bad = _error(piece.s1, piece.s2, _slice(ref, piece.offset, len(piece.s1)), scale)
        worst = max(worst, (a, rel), key=lambda w: w[1])
        if bad:
            odd.update(piece.ranks)
            worst_bad = max(worst_bad or (0.0, 0.0), (a, rel), key=lambda w: w[1])
    a, rel = worst_bad or worst
    return how, a, rel, sorted(odd), None


def _loss_scale(pieces: list[Piece], ref: dict[str, Any]) -> float:
    """The ratio of the reference's input-gradient norm to the N-rank one (each batch slice counted once)."""
    seen: set[int] = set()
    q = 0.0
    for piece in pieces:
        if piece.offset in seen:  # a replica of a slice already counted
            continue
        seen.add(piece.offset)
        if piece.s2 is None:  # a Partial gradient: no scale to read
            return 1.0
        q += sum(piece.s2)
    scale = math.sqrt(sum(ref["s2"]) / q) if q > 0 else 1.0
    return 1.0 if abs(scale - 1.0) < 1e-3 else scale


def _parts(per_rank: dict[int, dict[str, dict[str, Any]]], name: str, side: str) -> dict[int, dict[str, Any]]:
    """Each rank's summary of one side of a module, with the rank's data-parallel coordinate from its row."""
    return {r: {**rows[name][side], "dp": rows[name].get("dp")} for r, rows in per_rank.items()}


@dataclass
class ModuleSearch:
    """What the search over the first step's modules did: the module it names, and what it could not map."""

    diff: ModuleDiff | None
    notes: list[str]  # modules (or their gradients) that could not be mapped onto the reference, and why
    compared: int  # module outputs and input gradients compared (matched or not)
    modules: int  # modules summarized in the reference


def search_modules(reference: dict[int, dict[str, Any]], nrank: dict[int, dict[str, Any]]) -> ModuleSearch:
    """The first module that differs, forward first, then backward; every mapping it could not make is a note."""
    ref_rows = _rows(reference.get(0) or {})
    per_rank = {r: _rows(s) for r, s in nrank.items()}
    notes: list[str] = []
    if not ref_rows or not per_rank or not all(per_rank.values()):
        return ModuleSearch(None, ["no module outputs were captured in both runs (no forward before the first "
                                   "step)"], 0, len(ref_rows))
    shared = [name for name in ref_rows if all(name in rows for rows in per_rank.values())]
    absent = [name for name in ref_rows if name not in shared]
    if absent:
        shown = ", ".join(f"'{n or '<model>'}'" for n in absent[:5]) + (", ..." if len(absent) > 5 else "")
        notes.append(f"{len(absent)} module(s) of the reference ran on no rank or not on every rank of the N-rank "
                     f"run: {shown}")
    forward = sorted(shared, key=lambda n: ref_rows[n]["order"])
    matched = compared = 0
    for name in forward:
        ref = ref_rows[name]
        if not ref.get("out"):  # no floating-point tensor out in the reference either: nothing to compare
            continue
        lacking = [r for r, rows in sorted(per_rank.items()) if not rows[name].get("out")]
        if lacking:
            notes.append(f"'{name or '<model>'}': ranks {format_list(lacking)} kept no summary of its output")
            continue
        how, a, rel, odd, why = _compare(ref["out"], _parts(per_rank, name, "out"))
        if why:
            notes.append(f"'{name or '<model>'}': {why}")
            continue
        compared += 1
        if odd:
            input_matches = None
            if ref.get("in") and all(rows[name].get("in") for rows in per_rank.values()):
                _, _, _, odd_in, why_in = _compare(ref["in"], _parts(per_rank, name, "in"))
                input_matches = None if why_in else not odd_in
            return ModuleSearch(ModuleDiff(name, ref["cls"], ref.get("file"), ref.get("line"), "forward", how, a,
                                           rel, odd, matched, site_kind=ref.get("site_kind", "forward"),
                                           input_matches=input_matches), notes, compared, len(ref_rows))
        matched += 1
    backward = sorted((n for n in shared if ref_rows[n].get("grad_in")
                       and all(rows[n].get("grad_in") for rows in per_rank.values())),
                      key=lambda n: ref_rows[n].get("grad_order", 0))
    scale = None
    matched = 0
    for name in backward:
        ref = ref_rows[name]
        parts = _parts(per_rank, name, "grad_in")
        if scale is None:  # the module nearest the loss sets the loss's scale (1/N under per-rank mean losses)
            how, pieces = _combine(parts, ref["grad_in"])
            if how is None:
                notes.append(f"'{name or '<model>'}' gradient: {pieces}")
                continue
            scale = _loss_scale(pieces, ref["grad_in"])
        how, a, rel, odd, why = _compare(ref["grad_in"], parts, scale)
        if why:
            notes.append(f"'{name or '<model>'}' gradient: {why}")
            continue
        compared += 1
        if odd:
            return ModuleSearch(ModuleDiff(name, ref["cls"], ref.get("file"), ref.get("line"), "backward", how, a,
                                           rel, odd, matched, scale, site_kind=ref.get("site_kind", "forward")),
                                notes, compared, len(ref_rows))
        matched += 1
    return ModuleSearch(None, notes, compared, len(ref_rows))


def first_divergent_module(reference: dict[int, dict[str, Any]], nrank: dict[int, dict[str, Any]]
                           ) -> tuple[ModuleDiff | None, list[str]]:
    """The first module that differs, forward first, then backward; and notes (ambiguous mappings, no data)."""
    found = search_modules(reference, nrank)
    return found.diff, found.notes


_INNER = {"sum": "its tensor-parallel shards added up",
          "partial": "its tensor-parallel pending (Partial) sums added up",
          "same": "each tensor-parallel rank's whole value", "cat": "its tensor-parallel ranks' samples in order"}
MAPPINGS = {"cat": "the ranks' batch slices in data-parallel order", "sum": "the ranks' shards added up",
            "partial": "the ranks' pending (Partial) sums added up", "same": "each rank's whole value",
            **{f"cat/{k}": f"the data-parallel ranks' batch slices in order, each slice {v}"
               for k, v in _INNER.items()}}


def describe(diff: ModuleDiff) -> str:
    """One or two sentences for the reference_mismatch finding."""
    what = "output" if diff.side == "forward" else "gradient w.r.t. its input"
    mapping = MAPPINGS.get(diff.how, diff.how)
    before = ("it is the first module" if not diff.matched_before else "the one module before it matches"
              if diff.matched_before == 1 else f"all {diff.matched_before} modules before it match")
    text = (f"First module whose {what} differs from the 1-rank reference in the first step: '{diff.label}' "
            f"({diff.cls}{f', {diff.site_kind} at {diff.site}' if diff.file and diff.line else ''}): per-sample sums or norms differ by up to "
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
    """Add the first divergent module to a ``reference_mismatch`` finding (message and ``detail.module``).

    "Every module matches" is said only when every module of the reference was mapped and compared; otherwise the
    message says how many could not be mapped (``detail.module_notes`` says why), never that all matched."""
    found = search_modules(reference, nrank)
    if found.notes:
        finding.detail["module_notes"] = found.notes
    finding.detail["modules_compared"] = found.compared
    if found.diff is not None:
        finding.message += "\n" + describe(found.diff)
        finding.detail["module"] = found.diff.to_json()
        if found.notes:
            finding.message += (f" (among the modules that could be mapped; {len(found.notes)} could not be: "
                                f"detail.module_notes)")
    elif not (reference.get(0) or {}).get("modules"):
        return
    elif not found.notes:
        finding.message += ("\nEvery module's output and input gradient in the first step match the 1-rank "
                            "reference: the difference arises outside the modules (how the loss is computed from "
                            "their output, the optimizer step, or the data of later steps)")
    elif not found.compared:
        finding.message += (f"\nNo module's output or input gradient could be mapped onto the 1-rank reference, so "
                            f"no module is named: {found.notes[0]}"
                            + (f" (and {len(found.notes) - 1} more: detail.module_notes)" if len(found.notes) > 1
                               else ""))
    else:
        finding.message += (f"\nNo module differs among the {found.compared} module outputs and input gradients "
                            f"that could be mapped onto the 1-rank reference, but {len(found.notes)} could not be "
                            f"mapped, so the difference may be inside one of them: {found.notes[0]}"
                            + (" (the rest: detail.module_notes)" if len(found.notes) > 1 else ""))


def _shard_dims(pieces: list[Any], placements: list[str], ref_shape: tuple[int, ...]) -> set[int]:
    """The dim the tensor-parallel shards split: a DTensor's Shard(d) off dim 0, or where the local shape differs."""
    import re

    placed = {int(m) for p in placements for m in re.findall(r"Shard\(dim=(-?\d+)", p)} - {0}
    return placed or {d for t in pieces for d in range(1, t.dim())
                      if t.dim() == len(ref_shape) and t.shape[d] != ref_shape[d]}


def element_error(reference: dict[str, Any], parts: dict[int, dict[str, Any]], how: str) -> dict[str, Any] | str:
    """The element-wise error of the N-rank tensors (``module-capture-rank<R>.pt`` contents) against the reference's,
    reassembled as ``how`` says; or why they cannot be reassembled. Only ever run on the one module named.

    ``cat/<inner>`` (a mesh of several dims): each data-parallel batch slice is first put together from its
    tensor-parallel peers as ``inner`` says (a replica: the slice's first rank), then the slices concatenate."""
    import torch

    ref = reference["tensor"].double()
    ranks = sorted(parts)
    local = [parts[r]["tensor"].double() for r in ranks]
    groups = dp_groups(ranks, {r: parts[r].get("dp") for r in ranks}) if how.startswith("cat/") else None
    if groups is not None:
        inner = how.split("/", 1)[1]
        slices = []
        for group in groups:
            peers = [parts[r]["tensor"].double() for r in group]
            if inner == "same":
                slices.append(peers[0])
            elif inner == "cat":
                slices.append(torch.cat(peers, 0))
            elif inner == "partial":
                slices.append(torch.stack(peers).sum(0) if len({t.shape for t in peers}) == 1 else None)
            else:
                dims = _shard_dims(peers, [p for r in group for p in parts[r].get("placements") or ()],
                                   tuple(ref.shape))
                slices.append(torch.cat(peers, dims.pop()) if len(dims) == 1 else None)
        if any(t is None for t in slices):
            return f"no way to put the ranks' shapes {[list(t.shape) for t in local]} together as {how}"
        candidates = {-1: torch.cat(slices, 0)}
    elif how == "same":
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
