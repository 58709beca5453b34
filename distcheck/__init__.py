"""distcheck: a correctness harness for distributed PyTorch training.

    torchrun --nproc-per-node 2 -m distcheck consistency

The Python API below is importable in any training script. Imports are lazy, so ``import distcheck`` costs
nothing and pulls in no torch.distributed machinery until a function is called.
"""
from __future__ import annotations

from typing import Any

from distcheck.contract.version import __version__

__all__ = ["record", "check_model", "check_consistent", "__version__"]


_record_impl = None


def record(name: str, value: Any, step: int | None = None, *, rtol: float | None = None,
           atol: float | None = None, replicated: bool | None = None) -> None:
    """Record a value for ``distcheck compare``: a tensor, DTensor (as its full tensor), number or nn.Module.

        distcheck.record("loss", loss, step)                  # compared at the precision's default tolerance
        distcheck.record("logits", logits, step, rtol=1e-2)   # this record's own tolerance (wins over --rtol)
        distcheck.record("lr", lr, step, replicated=True)     # a plain value every rank must hold alike

    ``rtol``/``atol``: this record's element-wise tolerances, which win over ``--rtol/--atol`` and the
    precision-aware defaults. ``replicated``: a plain value (a number, a plain tensor) that every rank holds alike
    is compared as is, and ranks that disagree are a tensor_divergence; by default a per-rank value (a local loss)
    is compared as the mean over the ranks. Outside ``distcheck run``/``compare`` this returns at once and costs
    nothing measurable.
    """
    global _record_impl
    if _record_impl is None:  # resolved once: an import statement per call would cost microseconds
        from distcheck.rank.records import record as _record_impl
    if rtol is None and atol is None and replicated is None:
        _record_impl(name, value, step)
    else:
        _record_impl(name, value, step, rtol=rtol, atol=atol, replicated=replicated)


def check_model(model: Any) -> list:
    """Placements, FSDP2/TP coverage and cross-rank consistency of ``model``; returns Findings."""
    from distcheck.rank.checks.placement import check_model as impl

    return impl(model)


def check_consistent(name: str, tensor_or_module: Any, group: Any = None) -> list:
    """Check that every rank of ``group`` (default: the world) holds the same values; returns Findings.

    A tensor, a DTensor (compared only across the ranks that hold replicas of the same shard) or an nn.Module
    (every parameter and buffer). Only small per-tensor fingerprints cross ranks; full values are exchanged just
    for the chunks that differ, to name the first differing index. A no-op returning [] when not distributed.
    """
    from distcheck.rank.checks.replicas import check_consistent as impl

    return impl(name, tensor_or_module, group=group)
