"""The resharded DCP round trip (rank/autocheck/dcp_roundtrip.py): sums that compose across boxes, the pieces a
rank loaded of each saved chunk, and the verdict over every rank's notes. A real resharded load across ranks is
tests/integration/test_dcp_reshard.py's (and fixtures/ok/dcp_reshard_eval.py's in the correct corpus)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from distcheck.rank.checks.fingerprint import fingerprint
from distcheck.rank.autocheck.dcp_roundtrip import (MASK, SavedTensor, _loaded_pieces, additive_sum, box_of,
                                                    intersect, reshard_verdict, volume)

WHOLE = ((0, 0), (4, 3))
TOP, BOTTOM = ((0, 0), (2, 3)), ((2, 0), (2, 3))


def test_sums_over_boxes_that_tile_a_tensor_add_up_to_its_own_for_every_width():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.bool):
        t = (torch.randn(64, 33) * 1e6).to(dtype)
        rows = [t[0:10], t[10:40], t[40:64]]
        cols = [t[:, 0:5], t[:, 5:33]]  # column pieces are strided views: summed in place
        assert sum(map(additive_sum, rows)) & MASK == additive_sum(t) == sum(map(additive_sum, cols)) & MASK, dtype
    t = torch.randn(8, 8)
    changed = t.clone()
    changed[5, 3] = torch.nextafter(changed[5, 3], torch.tensor(1e9))  # the smallest change there is
    assert additive_sum(changed) != additive_sum(t) and additive_sum(torch.zeros(0, 3)) == 0


def test_boxes_intersect_and_a_plain_tensor_is_one_whole_box():
    assert box_of(torch.zeros(4, 3)) == WHOLE and box_of(torch.tensor(1.0)) == ((), ())
    assert intersect(WHOLE, BOTTOM) == BOTTOM and intersect(TOP, BOTTOM) is None
    assert intersect(((0, 1), (4, 2)), TOP) == ((0, 1), (2, 2)) and volume(WHOLE) == 12 and volume(((), ())) == 1


def test_a_rank_sums_its_loaded_values_over_each_saved_chunk_in_the_saved_dtype():
    t = torch.randn(4, 3)
    saved = SavedTensor(fingerprint(t), ("tensor", (4, 3)), False)
    chunks = [SimpleNamespace(offsets=torch.Size(b[0]), sizes=torch.Size(b[1])) for b in (TOP, BOTTOM)]
    assert _loaded_pieces(t, saved, chunks) == [(TOP, TOP, additive_sum(t[:2])), (BOTTOM, BOTTOM, additive_sum(t[2:]))]
    rounded = _loaded_pieces(t.to(torch.bfloat16), saved, chunks)  # cast back to float32 before the sum
    assert rounded[0][2] == additive_sum(t[:2].to(torch.bfloat16).float()) != additive_sum(t[:2])


def test_the_verdict_composes_the_pieces_of_each_saved_chunk_and_names_the_rank_that_loaded_wrong_values():
    t = torch.randn(4, 3)
    top, bottom, whole = additive_sum(t[:2]), additive_sum(t[2:]), additive_sum(t)
    # Saved as row shards (FSDP2 on ranks 0-1), loaded whole on both ranks: each rank's pieces of both chunks.
    saved = [{"w": (TOP, top)}, {"w": (BOTTOM, bottom)}]
    loaded = [{"w": [(TOP, TOP, top), (BOTTOM, BOTTOM, bottom)]}] * 2
    assert reshard_verdict(saved, loaded, [0, 1]) == {}
    wrong = {"w": [(TOP, TOP, top), (BOTTOM, BOTTOM, bottom + 1)]}
    assert reshard_verdict(saved, [loaded[0], wrong], [0, 1]) == {1: ["w"]}
    # Saved whole (a replicated tensor: every rank holds it), loaded as row shards: the pieces tile the chunk.
    saved = [{"w": (WHOLE, whole)}, {"w": (WHOLE, whole)}]
    assert reshard_verdict(saved, [{"w": [(WHOLE, TOP, top)]}, {"w": [(WHOLE, BOTTOM, bottom)]}], [0, 1]) == {}
    assert reshard_verdict(saved, [{"w": [(WHOLE, TOP, top)]}, {"w": [(WHOLE, BOTTOM, 7)]}], [0, 1]) == \
        {0: ["w"], 1: ["w"]}  # one box each: the sum is wrong, which piece is not known
    # Pieces that do not tile the chunk (a column split loaded from a row split) are not judged, never guessed.
    assert reshard_verdict(saved, [{"w": [(WHOLE, TOP, 1)]}, {}], [0, 1]) == {}
    # Replicas that saved the same chunk with other values: nothing to compare with.
    assert reshard_verdict([{"w": (WHOLE, whole)}, {"w": (WHOLE, whole + 1)}],
                           [{"w": [(WHOLE, WHOLE, 3)]}] * 2, [0, 1]) == {}
