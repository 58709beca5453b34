"""Per-tensor fingerprints: a few integers per tensor that change whenever any single element changes.

The tensor's bytes are read as 64-bit words (32/16/8-bit for odd sizes) and summed with wrap-around, in up to
CHUNKS contiguous element ranges, one [chunks, words] reduction per tensor. Integer addition modulo 2**64 is exact
and order-independent, so one changed element always changes its chunk's sum, on every device and thread count,
while the pass costs about one ``torch.sum`` (bench/bench_consistency.py; on CUDA tensors nothing but the sums
leaves the device). Chunks localize a difference: only differing chunks are ever sent.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch

from distcheck.analysis.replicas import Fingerprint  # the comparison side is torch-free
from distcheck.rank.checks import fingerprint_kernel

CHUNKS = 16
# Below this many elements a tensor is one chunk: per-call overhead would dominate the read.
MIN_CHUNK_NUMEL = 1 << 16
# Chunk bounds are multiples of 8 elements so every chunk but the last reads as whole 64-bit words.
ALIGN = 8


@functools.lru_cache(maxsize=4096)  # a model's tensors share a few sizes; the pass is at most microseconds a tensor
def chunk_bounds(numel: int) -> tuple[int, ...]:
    if numel < MIN_CHUNK_NUMEL:
        return (0, numel)
    step = -(-numel // CHUNKS)
    step = -(-step // ALIGN) * ALIGN
    bounds = list(range(0, numel, step)) + [numel]
    return tuple(bounds)


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    """The wrap-around sum of a 1-d contiguous tensor's bytes as the widest words that tile it: a 1-element int64."""
    nbytes = flat.numel() * flat.element_size()
    # Accumulate in the word type itself: wrap-around keeps the sum exact modulo 2**bits, and it is the fast path
    # (an int32 sum promoted to int64 runs ~10x slower on CPU).
    for word, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % width == 0:
            total = flat.view(word).sum(0, keepdim=True, dtype=word)
            return total if word is torch.int64 else total.to(torch.int64)
    return flat.view(torch.uint8).sum(0, keepdim=True, dtype=torch.int64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself; detached."""
    return _local(t).detach()


def _sums(flat: torch.Tensor, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    """1-d int64 tensors whose concatenation is the per-chunk sums of a 1-d contiguous tensor. The whole chunks are
    read as one [chunks, words] view summed along its rows: one reduction instead of one per chunk, which is what
    keeps the pass at memory speed (the per-call overhead of 16 small reductions per tensor was half the cost)."""
    if len(bounds) == 2:
        return [_word_sum(flat)]
    whole, step = len(bounds) - 2, bounds[1]  # every chunk but the last spans `step` elements, a multiple of ALIGN
    head = flat[:whole * step].view(torch.int64).view(whole, -1).sum(1)  # ALIGN elements make whole 64-bit words
    return [head, _word_sum(flat[whole * step:])]


def fingerprint(t: torch.Tensor) -> Fingerprint | None:
    """Fingerprint of a tensor (a DTensor's local shard); None for meta tensors, which hold no data."""
    return fingerprint_many([("t", t)]).get("t")


def fingerprint_many(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Fingerprint]:
    """Fingerprints of many tensors with a single device-to-host copy per device at the end (of the sums alone).
    With DISTCHECK_FINGERPRINT_KERNEL=triton, CUDA tensors' sums come from one Triton launch per device
    (rank/checks/fingerprint_kernel.py); the rest, and all by default, from torch's integer sums: the same integers."""
    pending: list[tuple[str, torch.Tensor, tuple[int, ...], int, int]] = []
    parts: dict[torch.device, list[tuple[int, int, list[torch.Tensor]]]] = {}  # device -> torch's (slot, n, sums)
    rows: dict[torch.device, list[tuple[int, int, int, int]]] = {}  # device -> the kernel's rows, one a tensor
    held: list[torch.Tensor] = []  # the kernel reads by address: the tensors it reads live until it is queued
    count = 0  # sums so far: where each tensor's sums start in the concatenation
    with torch.no_grad():  # plain views of parameters, no autograd bookkeeping (and no detach() per tensor)
        for name, t in named:
            t = _local(t)
            if t.is_meta:
                continue
            numel = t.numel()
            bounds = chunk_bounds(numel)
            n = len(bounds) - 1 if numel else 0
            if n:
                src = t if t.is_contiguous() else t.contiguous()
                if src.data_ptr() % 8:  # a view at an odd offset (FSDP1's flat parameters): words need a copy
                    src = src.clone()
                row = fingerprint_kernel.rows_for(src, bounds, count)
                if row is not None:
                    rows.setdefault(src.device, []).append(row)
                    held.append(src)
                else:
                    parts.setdefault(src.device, []).append((count, n, _sums(src.view(-1), bounds)))
            pending.append((name, t, bounds, count, n))
            count += n
        values = [0] * count
        for device in {*rows, *parts}:
            from_kernel = [fingerprint_kernel.launch(rows[device], count, device)] if device in rows else []
            theirs = parts.get(device, [])
            got = torch.cat(from_kernel + [s for _, _, sums in theirs for s in sums]).tolist()  # its one copy
            for _, words, per_chunk, first in rows.get(device, ()):  # the row's chunks: its slots from first
                n = -(-words // per_chunk)
                values[first:first + n] = got[first:first + n]
            at = count if from_kernel else 0
            for first, n, _ in theirs:
                values[first:first + n] = got[at:at + n]
                at += n
        del held
    return {name: Fingerprint(_dtype_name(t.dtype), tuple(t.shape), bounds, tuple(values[start:start + n]))
            for name, t, bounds, start, n in pending}


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
