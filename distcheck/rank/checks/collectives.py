"""Collective sanity: every collective returns its closed-form value, per dtype, on the world and on a subgroup.

Rank r (group rank g of n) contributes ``base * (g + 1)`` with ``base = 1..m``, so each op has an exact expected
result (small integers: exact in float32 and int64, within bfloat16's tolerance). Each rank checks its own result;
a wrong value names the op, dtype, group and rank.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from distcheck.analysis.tolerance import compare
from distcheck.contract.findings import Finding, format_ranks
from distcheck.rank.runtime import Session, bounded

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


@dataclass
class CaseResult:
    op: str
    dtype: str
    group: str
    rank: int
    error: str  # "" when the value was right


def _base(m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(1, m + 1, device=device).to(dtype)


def _cases(n: int, g: int, ranks: list[int], dtype: torch.dtype, device: torch.device, timeout: float,
           group) -> list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """(op name, run) pairs; run() performs the collective and returns (actual, expected)."""
    m = 2 * n
    base = _base(m, dtype, device)

    def mine() -> torch.Tensor:
        return base * (g + 1)

    def all_reduce(op, scale) -> Callable:
        def run():
            t = mine()
            bounded(dist.all_reduce, t, op=op, group=group, timeout=timeout)
            return t, base * scale
        return run

    def all_gather():
        out = [torch.empty_like(base) for _ in range(n)]
        bounded(dist.all_gather, out, mine(), group=group, timeout=timeout)
        return torch.cat(out), torch.cat([base * (i + 1) for i in range(n)])

    def all_gather_into_tensor():
        out = torch.empty(n * m, dtype=dtype, device=device)
        bounded(dist.all_gather_into_tensor, out, mine(), group=group, timeout=timeout)
        return out, torch.cat([base * (i + 1) for i in range(n)])

    def reduce_scatter_tensor():
        # Chunk j of every rank's input is base*(g+1) + j; group rank j receives sum_g(...) = base*n(n+1)/2 + n*j.
        inp = torch.cat([mine() + j for j in range(n)])
        out = torch.empty(m, dtype=dtype, device=device)
        bounded(dist.reduce_scatter_tensor, out, inp, group=group, timeout=timeout)
        return out, base * (n * (n + 1) // 2) + n * g

    def broadcast(src_index: int) -> Callable:
        def run():
            t = mine()
            bounded(dist.broadcast, t, src=ranks[src_index], group=group, timeout=timeout)
            return t, base * (src_index + 1)
        return run

    def all_to_all_single():
        # Rank g sends value g*n + j to rank j; it receives i*n + g from rank i.
        inp = torch.cat([torch.full((m,), g * n + j, device=device).to(dtype) for j in range(n)])
        out = torch.empty_like(inp)
        bounded(dist.all_to_all_single, out, inp, group=group, timeout=timeout)
        return out, torch.cat([torch.full((m,), i * n + g, device=device).to(dtype) for i in range(n)])

    def barrier():
        bounded(dist.barrier, group=group, timeout=timeout)
        return torch.zeros(1), torch.zeros(1)

    cases = [("all_reduce(sum)", all_reduce(dist.ReduceOp.SUM, n * (n + 1) // 2)),
             ("all_reduce(max)", all_reduce(dist.ReduceOp.MAX, n))]
    if dtype.is_floating_point:  # an average of integers is not an integer: torch rejects AVG for int64
        cases.append(("all_reduce(avg)", all_reduce(dist.ReduceOp.AVG, (n + 1) / 2)))
    cases += [("all_gather", all_gather), ("all_gather_into_tensor", all_gather_into_tensor),
              ("reduce_scatter_tensor", reduce_scatter_tensor), ("broadcast(first)", broadcast(0)),
              ("broadcast(last)", broadcast(n - 1)), ("all_to_all_single", all_to_all_single)]
    if dtype == DTYPES[0]:
        cases.append(("barrier", barrier))
    return cases


def subgroup_ranks(world_size: int) -> list[list[int]]:
    """Halves of the world when there are at least 4 ranks; otherwise one new group over all ranks, which still
    exercises a second communicator and group-rank translation."""
    ranks = list(range(world_size))
    if world_size >= 4:
        half = world_size // 2
        return [ranks[:half], ranks[half:]]
    return [ranks]


def run_local(session: Session, timeout: float) -> list[CaseResult]:
    """Run every case on this rank; collective calls, so every rank must call it."""
    results: list[CaseResult] = []
    world = list(range(session.world_size))
    groups: list[tuple[str, list[int], object]] = [("world", world, None)]
    for ranks in subgroup_ranks(session.world_size):
        pg = dist.new_group(ranks)  # every rank creates every subgroup, as torch requires
        if session.rank in ranks:
            groups.append((f"subgroup[{format_ranks(ranks).removeprefix('ranks ').removeprefix('rank ')}]",
                           ranks, pg))
    for label, ranks, pg in groups:
        n, g = len(ranks), ranks.index(session.rank)
        for dtype in DTYPES:
            dname = str(dtype).replace("torch.", "")
            for op, run in _cases(n, g, ranks, dtype, session.device, timeout, pg):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        actual, expected = run()
                    cmp = compare(actual.cpu(), expected.cpu())
                    error = "" if cmp.ok else cmp.describe()
                except Exception as exc:
                    error = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                results.append(CaseResult(op, dname, label, session.rank, error))
                if error.startswith("raised") and "imeout" in error:
                    return results  # a peer is gone: every further collective would time out too
    return results


def findings_from(results: list[CaseResult]) -> list[Finding]:
    """Group wrong results by (op, dtype, group): one finding each, naming the ranks that saw them."""
    bad: dict[tuple[str, str, str], list[CaseResult]] = {}
    for r in results:
        if r.error:
            bad.setdefault((r.op, r.dtype, r.group), []).append(r)
    findings = []
    for (op, dtype, group), rs in bad.items():
        ranks = sorted(r.rank for r in rs)
        first = min(rs, key=lambda r: r.rank)
        findings.append(Finding(
            "collective_mismatch", ranks,
            f"{op} on {dtype} over the {group} group "
            f"{'failed' if first.error.startswith('raised') else 'gave a wrong result'} on {format_ranks(ranks)}: "
            f"{first.error}",
            {"op": op, "dtype": dtype, "group": group, "errors": {str(r.rank): r.error for r in rs}}))
    return findings
