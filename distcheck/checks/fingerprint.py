"""Per-tensor fingerprints: a few integers per tensor that change whenever any single element changes.

The tensor's bytes are read as 64-bit words (32/16/8-bit for odd sizes) and summed with wrap-around, in up to
CHUNKS contiguous element ranges. Integer addition modulo 2**64 is exact and order-independent, so one changed
element always changes its chunk's sum, on every device and thread count, while the pass costs about one
``torch.sum`` (bench/bench_fingerprint.py). Chunks localize a difference: only differing chunks are ever sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

CHUNKS = 16
# Below this many elements a tensor is one chunk: per-call overhead would dominate the read.
MIN_CHUNK_NUMEL = 1 << 16
# Chunk bounds are multiples of 8 elements so every chunk but the last reads as whole 64-bit words.
ALIGN = 8


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


def chunk_bounds(numel: int) -> tuple[int, ...]:
    if numel < MIN_CHUNK_NUMEL:
        return (0, numel)
    step = -(-numel // CHUNKS)
    step = -(-step // ALIGN) * ALIGN
    bounds = list(range(0, numel, step)) + [numel]
    return tuple(bounds)


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    raw = flat.view(torch.uint8)
    n = raw.numel()
    # Accumulate in the word type itself: wrap-around keeps the sum exact modulo 2**bits, and it is the fast path
    # (an int32 sum promoted to int64 runs ~10x slower on CPU).
    for word, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % width == 0 and n:
            return raw.view(word).sum(dtype=word).to(torch.int64)
    return raw.sum(dtype=torch.int64)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself; detached."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach()


def _sums(t: torch.Tensor, bounds: tuple[int, ...]) -> list[torch.Tensor]:
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return [_word_sum(flat[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def fingerprint(t: torch.Tensor) -> Fingerprint | None:
    """Fingerprint of a tensor (a DTensor's local shard); None for meta tensors, which hold no data."""
    return fingerprint_many([("t", t)]).get("t")


def fingerprint_many(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Fingerprint]:
    """Fingerprints of many tensors with a single device-to-host copy at the end."""
    pending: list[tuple[str, torch.Tensor, tuple[int, ...], int]] = []
    parts: list[torch.Tensor] = []
    for name, t in named:
        t = local_tensor(t)
        if t.device.type == "meta":
            continue
        bounds = chunk_bounds(t.numel())
        sums = _sums(t, bounds) if t.numel() else []
        pending.append((name, t, bounds, len(parts)))
        parts.extend(sums)
    values = torch.stack(parts).cpu().tolist() if parts else []
    out: dict[str, Fingerprint] = {}
    for name, t, bounds, start in pending:
        n = len(bounds) - 1 if t.numel() else 0
        out[name] = Fingerprint(str(t.dtype).replace("torch.", ""), tuple(t.shape), bounds,
                                tuple(values[start:start + n]))
    return out
