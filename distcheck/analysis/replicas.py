"""Pure comparison of per-rank fingerprints: which tensors differ across replicas, and how (no process group).

torch is imported only by :func:`diff_chunk` (it compares tensors): the supervisor compares fingerprints from the
ranks' files (analysis/replica_drift.py) without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from distcheck.contract.findings import Finding, format_names, format_ranks

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Fingerprint:
    dtype: str
    shape: tuple[int, ...]
    bounds: tuple[int, ...]  # element offsets: chunk i covers [bounds[i], bounds[i+1])
    sums: tuple[int, ...]

    def differing_chunks(self, other: Fingerprint) -> list[int]:
        if (self.dtype, self.shape, self.bounds) != (other.dtype, other.shape, other.bounds):
            return list(range(len(self.sums)))
        return [i for i, (a, b) in enumerate(zip(self.sums, other.sums)) if a != b]


@dataclass(frozen=True)
class Entry:
    """One rank's view of one tensor: what it is, which replicas it must match, and its fingerprint."""

    name: str
    role: str  # "parameter", "buffer", "tensor", "gradient", "rng state", ...
    replica_key: Hashable  # ranks with equal keys must hold equal values (None: the whole group)
    fp: Fingerprint


@dataclass
class Divergence:
    name: str
    role: str
    ranks: list[int]  # the ranks that must agree
    reference: int  # a rank of the majority group, whose values the others are compared with
    blamed: list[int]  # ranks outside a strict majority, or all ranks when there is none
    odd: dict[int, list[int]] = field(default_factory=dict)  # rank -> chunks differing from the reference
    groups: list[list[int]] = field(default_factory=list)  # ranks grouped by identical fingerprints
    structural: str = ""  # dtype/shape differences or a missing tensor: no element diff possible


@dataclass
class DiffSummary:
    rank: int
    first_index: list[int]
    ref_value: float
    value: float
    max_abs_diff: float
    num_different: int


def _majority(groups: list[list[int]]) -> tuple[list[int], bool]:
    groups = sorted(groups, key=lambda g: (-len(g), g[0]))
    total = sum(len(g) for g in groups)
    return groups[0], len(groups[0]) * 2 > total


def find_divergences(per_rank: dict[int, list[Entry]]) -> list[Divergence]:
    """Tensors whose fingerprints differ between ranks that should hold replicas, in first-seen order."""
    by_name: dict[str, dict[int, Entry]] = {}
    for rank in sorted(per_rank):
        for entry in per_rank[rank]:
            by_name.setdefault(entry.name, {})[rank] = entry
    all_ranks = sorted(per_rank)
    out: list[Divergence] = []
    for name, entries in by_name.items():
        role = next(iter(entries.values())).role
        missing = [r for r in all_ranks if r not in entries]
        if missing:
            present = sorted(entries)
            out.append(Divergence(name, role, all_ranks, present[0], missing, groups=[present, missing],
                                  structural=f"missing on {format_ranks(missing)}, present on {format_ranks(present)}"))
            continue
        partitions: dict[Hashable, list[int]] = {}
        for rank, entry in entries.items():
            partitions.setdefault(entry.replica_key, []).append(rank)
        for ranks in partitions.values():
            if len(ranks) > 1:
                div = _compare_partition(name, role, {r: entries[r] for r in ranks})
                if div is not None:
                    out.append(div)
    return out


def _compare_partition(name: str, role: str, entries: dict[int, Entry]) -> Divergence | None:
    by_fp: dict[tuple, list[int]] = {}
    for rank, entry in sorted(entries.items()):
        fp = entry.fp
        by_fp.setdefault((fp.dtype, fp.shape, fp.sums), []).append(rank)
    if len(by_fp) == 1:
        return None
    groups = list(by_fp.values())
    majority, strict = _majority(groups)
    ranks = sorted(entries)
    reference = majority[0]
    blamed = [r for r in ranks if r not in majority] if strict else ranks
    ref_fp = entries[reference].fp
    odd = {r: ref_fp.differing_chunks(entries[r].fp) for r in ranks if r not in majority}
    structural = ""
    for r in odd:
        fp = entries[r].fp
        if (fp.dtype, fp.shape) != (ref_fp.dtype, ref_fp.shape):
            structural = (f"{ref_fp.dtype}{list(ref_fp.shape)} on rank {reference} but "
                          f"{fp.dtype}{list(fp.shape)} on rank {r}")
            break
    return Divergence(name, role, ranks, reference, blamed, odd, sorted(groups), structural)


def diff_chunk(rank: int, ref: torch.Tensor, other: torch.Tensor, offset: int,
               shape: tuple[int, ...]) -> DiffSummary | None:
    """Compare one chunk (flat element range starting at ``offset``) bit for bit; None if identical."""
    import torch

    a = ref.reshape(-1)
    b = other.reshape(-1)
    differs = a.view(torch.uint8).reshape(a.numel(), -1).ne(b.view(torch.uint8).reshape(b.numel(), -1)).any(1)
    idx = differs.nonzero()
    if idx.numel() == 0:
        return None
    first = int(idx[0, 0])
    if a.is_complex():  # a RoPE buffer: the distance in the complex plane; values shown by their magnitude
        ac, bc = a.to(torch.complex128), b.to(torch.complex128)
        delta, af, bf = (ac - bc).abs(), ac.abs(), bc.abs()
    else:
        af, bf = a.double(), b.double()
        delta = (af - bf).abs()
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)[differs]
    flat_index = offset + first
    return DiffSummary(rank, unravel(flat_index, shape), float(af[first]), float(bf[first]),
                       float(delta.max()), int(differs.sum()))


def merge_summaries(parts: list[DiffSummary]) -> DiffSummary | None:
    """One summary per rank from its per-chunk summaries (chunks arrive in index order)."""
    if not parts:
        return None
    first = parts[0]
    return DiffSummary(first.rank, first.first_index, first.ref_value, first.value,
                       max(p.max_abs_diff for p in parts), sum(p.num_different for p in parts))


def unravel(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat_index % size if size else 0)
        flat_index //= size if size else 1
    return list(reversed(out))


def divergence_finding(div: Divergence, summaries: dict[int, DiffSummary], context: str = "") -> Finding:
    """A tensor_divergence finding whose message names the tensor, the ranks and the size of the difference."""
    where = f" {context}" if context else ""
    detail: dict = {"name": div.name, "role": div.role, "reference_rank": div.reference, "groups": div.groups}
    if div.structural:
        message = f"{div.role} '{div.name}'{where} differs across ranks: {div.structural}"
        detail["structural"] = div.structural
        return Finding("tensor_divergence", div.blamed, message, detail)
    odd = sorted(div.odd)
    worst = max(summaries.values(), key=lambda s: s.max_abs_diff, default=None)
    message = (f"{div.role} '{div.name}'{where} differs across ranks: {format_ranks(odd)} "
               f"{'differs' if len(odd) == 1 else 'differ'} from rank {div.reference}")
    if worst is not None:
        message += (f" (max abs diff {worst.max_abs_diff:.4g} on rank {worst.rank}; first differing element "
                    f"{worst.first_index}: {worst.ref_value:.6g} on rank {div.reference} vs {worst.value:.6g})")
        detail["max_abs_diff"] = worst.max_abs_diff
        detail["diffs"] = {str(r): vars(s) for r, s in sorted(summaries.items())}
    return Finding("tensor_divergence", div.blamed, message, detail)


SHOWN = 4  # tensor names a grouped message spells out; detail.params lists them all


def group_findings(findings: list[Finding], where: str, cause: str = "") -> list[Finding]:
    """Per-tensor ``tensor_divergence`` findings (divergence_finding) as one finding for their one cause; other
    findings and a lone divergence pass unchanged (the lone one gains ``detail.params``)."""
    divs = [f for f in findings if f.kind == "tensor_divergence" and "name" in f.detail]
    rest = [f for f in findings if f not in divs]
    if len(divs) <= 1:
        for f in divs:
            f.detail.setdefault("params", [f.detail["name"]])
            f.detail.setdefault("count", 1)
            if cause:
                f.message += f" {cause}"
        return rest + divs
    ranks = sorted({r for f in divs for r in f.ranks})
    names = [f.detail["name"] for f in divs]
    roles = sorted({f.detail.get("role", "tensor") for f in divs})
    noun = roles[0] if len(roles) == 1 else "tensor"
    worst = max(divs, key=lambda f: f.detail.get("max_abs_diff", -1.0))
    message = (f"{len(names)} {noun}s that must be identical across ranks differ {where}: "
               f"{format_names(names, SHOWN)}")
    detail: dict = {"params": names, "count": len(names), "groups": {f.detail["name"]: f.detail.get("groups")
                                                                     for f in divs}}
    if "max_abs_diff" in worst.detail:
        message += f"; max abs diff {worst.detail['max_abs_diff']:.4g} ('{worst.detail['name']}')"
        detail.update(max_abs_diff=worst.detail["max_abs_diff"], max_abs_diff_param=worst.detail["name"])
    detail["diffs"] = {f.detail["name"]: f.detail["diffs"] for f in divs if "diffs" in f.detail}
    structural = {f.detail["name"]: f.detail["structural"] for f in divs if "structural" in f.detail}
    if structural:
        detail["structural"] = structural
    message += "." + (f" {cause}" if cause else "")
    return rest + [Finding("tensor_divergence", ranks, message, detail)]
