"""Cross-rank replica consistency (the machinery behind ``distcheck.check_consistent``).

Each rank fingerprints its tensors locally; one side-channel exchange carries the fingerprints, so the traffic
does not grow with model size. Only where fingerprints differ does the reference rank publish the differing
chunks, so the odd ranks can name the first differing index, both values and the max abs difference.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist

from distcheck.rank import sink
from distcheck.analysis.replicas import (DiffSummary, Divergence, Entry, diff_chunk, divergence_finding,
                                         find_divergences, merge_summaries)
from distcheck.contract.findings import Finding
from distcheck.rank.checks.fingerprint import fingerprint_many, local_tensor
from distcheck.rank.runtime import SideChannel, current_channel

_calls: dict[str, int] = {}


def replica_key(t: torch.Tensor) -> Any:
    """Ranks with equal keys must hold equal local values.

    Plain tensors: the whole group (None). DTensors: ranks on the same mesh with the same coordinate on every
    mesh dim that is not Replicate; Shard and Partial dims are meant to differ.
    """
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    coord = mesh.get_coordinate() or []
    fixed = tuple((d, coord[d]) for d, p in enumerate(placements) if not p.is_replicate())
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), fixed)


def named_tensors(name: str, obj: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(name, role, tensor) for a tensor or every parameter and buffer of a module."""
    if isinstance(obj, torch.nn.Module):
        out = [(n, "parameter", p) for n, p in obj.named_parameters()]
        out += [(n, "buffer", b) for n, b in obj.named_buffers() if b is not None]
        return out
    if isinstance(obj, torch.Tensor):
        return [(name, "tensor", obj)]
    raise TypeError(f"check_consistent({name!r}, ...) takes a tensor, DTensor or nn.Module, not {type(obj).__name__}")


def local_entries(items: Iterable[tuple[str, str, torch.Tensor]], key: Callable[[torch.Tensor], Any] = replica_key
                  ) -> list[Entry]:
    items = list(items)
    fps = fingerprint_many((n, t) for n, _, t in items)
    return [Entry(n, role, key(t), fps[n]) for n, role, t in items if n in fps]


class Compared(NamedTuple):
    """One cross-rank comparison: the tensors that differ, each odd rank's diff summary, and what every rank sent
    along (``extra``, in ``ranks`` order)."""

    divergences: list[Divergence]
    summaries: dict[str, dict[int, DiffSummary]]  # name -> rank -> summary
    extras: list[Any]
    entries: list[list[Entry]]  # every rank's fingerprints, in ``ranks`` order


def compare_entries(tag: str, items: list[tuple[str, str, torch.Tensor]], channel: SideChannel, ranks: list[int],
                    key: Callable[[torch.Tensor], Any] = replica_key, extra: Any = None) -> Compared:
    """Collective over ``ranks`` (through the side channel, never the user's process group): one exchange of
    fingerprints (and ``extra``); only where they differ, the differing chunks and one exchange of diff summaries.
    Every rank returns the same divergences."""
    entries = local_entries(items, key)
    n = _calls[tag] = _calls.get(tag, 0) + 1
    gathered = channel.exchange(f"fp/{tag}", (entries, extra), ranks)
    all_entries = [g[0] for g in gathered]
    extras = [g[1] for g in gathered]
    divergences = find_divergences(dict(zip(ranks, all_entries)))
    if not divergences:
        return Compared([], {}, extras, all_entries)
    me = channel.rank
    tensors = {name: local_tensor(t) for name, _, t in items}
    base = f"chunks/{tag}/{n}"
    for div in divergences:
        if div.reference == me and not div.structural:
            flat = tensors[div.name].reshape(-1)
            bounds = next(e.fp.bounds for e in entries if e.name == div.name)
            for chunk in sorted({c for chunks in div.odd.values() for c in chunks}):
                channel.put(f"{base}/{div.name}/{chunk}", flat[bounds[chunk]:bounds[chunk + 1]].cpu())
    mine: dict[str, DiffSummary] = {}
    for div in divergences:
        if me not in div.odd or div.structural:
            continue
        t = tensors[div.name]
        flat = t.reshape(-1)
        bounds = next(e.fp.bounds for e in entries if e.name == div.name)
        parts = []
        for chunk in div.odd[me]:
            ref = channel.get(f"{base}/{div.name}/{chunk}", div.reference)
            part = diff_chunk(me, ref, flat[bounds[chunk]:bounds[chunk + 1]].cpu(), bounds[chunk], tuple(t.shape))
            if part is not None:
                parts.append(part)
        merged = merge_summaries(parts)
        if merged is not None:
            mine[div.name] = merged
    all_summaries = channel.exchange(f"diff/{tag}", mine, ranks)
    summaries = {div.name: {r: s[div.name] for r, s in zip(ranks, all_summaries) if div.name in s}
                 for div in divergences}
    return Compared(divergences, summaries, extras, all_entries)


def compare_replicas(tag: str, items: list[tuple[str, str, torch.Tensor]], channel: SideChannel,
                     ranks: list[int], context: str = "", key: Callable[[torch.Tensor], Any] = replica_key
                     ) -> list[Finding]:
    """Collective over ``ranks`` (through the side channel): every rank returns the same findings, one per
    differing tensor (check_model groups them by cause); ``key``: which ranks must hold equal values."""
    compared = compare_entries(tag, items, channel, ranks, key=key)
    return [divergence_finding(div, compared.summaries[div.name], context) for div in compared.divergences]


def check_consistent(name: str, obj: Any, group: Any = None) -> list[Finding]:
    """Public API: see ``distcheck.check_consistent``. Findings also go to the surrounding run's report."""
    channel = current_channel()
    if channel is None:
        return []
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(channel.world_size))
    if channel.rank not in ranks:
        return []
    from distcheck.rank.checks.fsdp1 import replica_items

    items, key = named_tensors(name, obj), replica_key
    if isinstance(obj, torch.nn.Module):  # an FSDP1 module: its chunks compared only where ranks hold the same one
        items, key = replica_items(obj, items, replica_key)
    findings = compare_replicas(f"{name}@{','.join(map(str, ranks))}", items, channel, ranks, key=key,
                                context=f"(check_consistent '{name}')" if isinstance(obj, torch.nn.Module) else "")
    if channel.rank == ranks[0]:
        sink.emit(findings, channel.rank)
    return findings
