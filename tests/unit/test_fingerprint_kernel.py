"""The GPU fingerprint kernel's table and the merge of its sums with torch's, on CPU tensors.

The kernel itself needs a GPU (bench/bench_gpu.py checks its sums against torch's there) or Triton's interpreter
(the last test, where Triton is installed). Here its rows are summed by reading memory at their addresses, which
checks everything the kernel is handed: addresses, word counts and output slots.
"""
import ctypes
import os
import sys

import numpy as np
import pytest
import torch

from distcheck.rank.checks import fingerprint_kernel
from distcheck.rank.checks.fingerprint import MIN_CHUNK_NUMEL, _sums, chunk_bounds, fingerprint_many


def _read_rows(rows, count, device):
    """What the kernel computes, from the same table: each tensor's words read at its address, chunk by chunk of
    ``per_chunk`` words, each chunk summed mod 2**64 into the next slot from ``first``."""
    out = np.zeros(count, dtype=np.uint64)
    for address, words, per_chunk, first in rows:
        data = np.frombuffer((ctypes.c_uint64 * words).from_address(address), dtype=np.uint64)
        for c, lo in enumerate(range(0, words, per_chunk)):
            out[first + c] += data[lo:lo + per_chunk].sum(dtype=np.uint64)
    return torch.from_numpy(out.view(np.int64).copy()).to(device)


def _mixed():
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(MIN_CHUNK_NUMEL * 5 + 8, generator=gen)
    return [
        ("big", big),  # 16 chunks, every one whole words
        ("small", torch.randn(4096, generator=gen)),  # one chunk
        ("ints", torch.randint(-2 ** 62, 2 ** 62, (MIN_CHUNK_NUMEL * 2,), dtype=torch.int64, generator=gen)),
        ("odd_bf16", torch.randn(MIN_CHUNK_NUMEL * 3 + 3, generator=gen).bfloat16()),  # last chunk: not whole words
        ("misaligned", big[1:1001]),  # a view 4 bytes into its storage: read from an aligned copy
        ("strided", torch.randn(300, 400, generator=gen).t()),  # made contiguous first
        ("empty", torch.zeros(0)),
        ("meta", torch.empty(10, device="meta")),
        ("bools", torch.rand(1000, generator=gen) > 0.5),
    ]


def test_a_row_covers_each_chunk_as_whole_words():
    t = torch.randn(MIN_CHUNK_NUMEL * 3 + 40)
    bounds = chunk_bounds(t.numel())
    row = fingerprint_kernel.word_row(t, bounds, first=7)
    assert row == (t.data_ptr(), t.numel() // 2, bounds[1] // 2, 7)
    chunks = len(bounds) - 1
    assert -(-row[1] // row[2]) == chunks  # the launch's grid: as many chunks as chunk_bounds gives
    assert _read_rows([row], 7 + chunks, "cpu")[7:].tolist() == torch.cat(_sums(t, bounds)).tolist()


def test_rows_refuse_what_the_kernel_cannot_read():
    odd = torch.zeros(MIN_CHUNK_NUMEL + 3, dtype=torch.bfloat16)  # last chunk 2-byte words
    assert fingerprint_kernel.word_row(odd, chunk_bounds(odd.numel()), 0) is None
    assert fingerprint_kernel.word_row(odd[:7], chunk_bounds(7), 0) is None  # one chunk, 14 bytes
    base = torch.zeros(64)
    assert fingerprint_kernel.word_row(base[1:33], chunk_bounds(32), 0) is None  # address 4 bytes off
    assert fingerprint_kernel.word_row(base[2:34], chunk_bounds(32), 0) is not None
    assert fingerprint_kernel.rows_for(base, chunk_bounds(64), 0) is None  # a CPU tensor: torch's path


def test_kernel_sums_merge_with_torch_sums(monkeypatch):
    expected = fingerprint_many(_mixed())  # the torch path throughout
    taken = []

    def rows_for(flat, bounds, first):
        row = fingerprint_kernel.word_row(flat, bounds, first)
        taken.append(row is not None)
        return row

    monkeypatch.setattr(fingerprint_kernel, "rows_for", rows_for)
    monkeypatch.setattr(fingerprint_kernel, "launch", _read_rows)
    got = fingerprint_many(_mixed())
    assert got == expected
    assert taken == [True, True, True, False, True, True, True]  # empty and meta: no sums; bools: one chunk


def test_a_view_at_an_odd_offset_has_the_fingerprint_of_its_values():
    storage = torch.randn(MIN_CHUNK_NUMEL * 2 + 1)
    view = storage[1:]  # 4 bytes into the storage: no 64-bit words there
    assert fingerprint_many([("v", view)]) == fingerprint_many([("v", view.clone())])


def test_a_changed_word_changes_the_kernel_sum(monkeypatch):
    monkeypatch.setattr(fingerprint_kernel, "rows_for", fingerprint_kernel.word_row)
    monkeypatch.setattr(fingerprint_kernel, "launch", _read_rows)
    t = torch.randn(MIN_CHUNK_NUMEL * 4)
    before = fingerprint_many([("t", t)])["t"]
    t[MIN_CHUNK_NUMEL * 2 + 5] = torch.nextafter(t[MIN_CHUNK_NUMEL * 2 + 5], torch.tensor(1e9))
    after = fingerprint_many([("t", t)])["t"]
    assert before.differing_chunks(after) == [8]


def test_triton_interpreter_gives_torch_sums(monkeypatch):
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported without its interpreter, which it reads at import")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    expected = fingerprint_many(_mixed())
    kernel = fingerprint_kernel._kernel.__wrapped__()
    monkeypatch.setattr(fingerprint_kernel, "_kernel", lambda: kernel)
    monkeypatch.setattr(fingerprint_kernel, "rows_for", fingerprint_kernel.word_row)
    assert fingerprint_many(_mixed()) == expected
