"""The fingerprint pass on GPUs: every tensor's chunk sums in one Triton launch, at the speed of one HBM read.

    python bench/bench_gpu.py      # on a GPU: the pass against one torch.sum per tensor, and this kernel's sums
                                   # checked against torch's on random tensors of every dtype and odd size

The sums are the same integers as rank/checks/fingerprint.py's torch path: each chunk's bytes read as int64 words and
added with wrap-around (two's complement addition is the same modulo 2**64 in any order, so the kernel's block
order and its atomic adds cannot change a bit of it). torch's int64 sum runs at a third to a half of the card's
read bandwidth on an H100 and launches once per tensor; this kernel reads every tensor of a device in one launch
from a table of (address, words, output slot) rows, one row per chunk, so a model of 300 small tensors costs one
launch too. What it does not take (chunks whose bytes are not whole 64-bit words, addresses not 8-byte aligned)
keeps the torch path, with the same result.

Opt-in: DISTCHECK_FINGERPRINT_KERNEL=triton. Its first use in a process costs Triton's import and a compile (1.8 to
2.3 s on an H200 with Triton's cache empty, 0.6 to 0.9 s with it filled), while it saves about 0.7 ms per GB read
over torch's sums: a job that fingerprints a few times (consistency, the drift check after its first steps) is
faster without it; one that calls ``check_consistent`` on many GB every few steps is faster with it.
"""
from __future__ import annotations

import array
import functools
import os
from typing import Any

import torch

from distcheck.contract.env import FINGERPRINT_KERNEL

# One program sums SPAN words (512 KiB) of one chunk, BLOCK words (32 KiB) at a time with 16 warps: the fastest
# of the settings bench/bench_gpu.py's fingerprint_configs tried on an H200 (docs/performance.md, GPU), with
# (1 << 15 to 1 << 17, 2048 to 4096, 8 to 16) within a few percent of it. One launch for all the device's
# tensors, after the host described the last: launching every 256 MiB on the way measured the same.
SPAN = 1 << 16
BLOCK = 4096
WARPS = 16
# The grid's third dimension (programs per chunk) stops at 65535: chunks beyond 34 GB keep the torch path.
MAX_CHUNK_BYTES = 65535 * SPAN * 8


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on its first launch (cached on disk by Triton); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a Triton that does not match this torch: the torch path stays
        return None

    @triton.jit
    def chunk_sums(table, out, SPAN: tl.constexpr, BLOCK: tl.constexpr):
        # Table row r, one per tensor: its address, its words, the words of each chunk but the last, its first
        # output slot. Program (r, c, p) adds up words [p * SPAN, (p + 1) * SPAN) of chunk c of tensor r.
        row = tl.program_id(0) * 4
        chunk = tl.program_id(1).to(tl.int64)
        words = tl.load(table + row + 1)
        per_chunk = tl.load(table + row + 2)
        lo = chunk * per_chunk + tl.program_id(2).to(tl.int64) * SPAN
        hi = tl.minimum(tl.minimum((chunk + 1) * per_chunk, words), lo + SPAN)
        if lo < hi:  # the grid fits the largest tensor: the others leave their last programs idle
            src = tl.load(table + row).to(tl.pointer_type(tl.int64))
            acc = tl.zeros([BLOCK], dtype=tl.int64)
            start = lo
            while start < hi:  # runtime bounds: a chunk shorter than SPAN runs only the blocks it holds
                offs = start + tl.arange(0, BLOCK)
                acc += tl.load(src + offs, mask=offs < hi, other=0)
                start += BLOCK
            tl.atomic_add(out + tl.load(table + row + 3) + chunk, tl.sum(acc, axis=0))

    return chunk_sums


@functools.cache
def available() -> bool:
    return os.environ.get(FINGERPRINT_KERNEL, "") == "triton" and _kernel() is not None


def rows_for(t: torch.Tensor, bounds: tuple[int, ...], first: int) -> tuple[int, int, int, int] | None:
    """The kernel's row for a contiguous tensor, or None where the torch path takes it (not on a CUDA device,
    no Triton, an odd size or address)."""
    return word_row(t, bounds, first) if t.is_cuda and available() else None


def word_row(t: torch.Tensor, bounds: tuple[int, ...], first: int) -> tuple[int, int, int, int] | None:
    """The kernel's row for a contiguous tensor: (address, 64-bit words, words of each chunk but the last, first
    output slot). None when a chunk is not whole words, the address is not 8-byte aligned or a chunk is too large
    for the grid: the caller takes the torch path for that tensor. Pure arithmetic, checked on CPU tensors."""
    size, base = t.element_size(), t.data_ptr()
    nbytes = (bounds[-1] - bounds[0]) * size
    step = (bounds[1] - bounds[0]) * size  # chunk_bounds: every chunk but the last spans the same elements
    if base % 8 or nbytes % 8 or step % 8 or step > MAX_CHUNK_BYTES:
        return None
    return (base, nbytes // 8, step // 8, first)


def launch(rows: list[tuple[int, int, int, int]], count: int, device: torch.device) -> torch.Tensor:
    """The chunk sums of the rows' tensors, as an int64 tensor of ``count`` slots on ``device`` (slots no row
    names stay zero). One host-to-device copy of the table, one zero fill, one launch."""
    out = torch.zeros(count, dtype=torch.int64, device=device)
    if not rows:
        return out
    table = torch.frombuffer(array.array("q", [v for row in rows for v in row]), dtype=torch.int64).to(device)
    chunks = max(-(-words // per_chunk) for _, words, per_chunk, _ in rows)
    pieces = -(-max(per_chunk for _, _, per_chunk, _ in rows) // SPAN)
    grid = (len(rows), chunks, pieces)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _kernel()[grid](table, out, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    else:  # Triton's interpreter (TRITON_INTERPRET=1), which runs the kernel on CPU tensors: the tests' way in
        _kernel()[grid](table, out, SPAN=SPAN, BLOCK=BLOCK, num_warps=WARPS)
    return out
