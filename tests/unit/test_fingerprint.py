"""Fingerprints: any single changed element is detected, in any dtype and position; chunks localize it."""
import pytest
import torch

from distcheck.rank.checks.fingerprint import CHUNKS, MIN_CHUNK_NUMEL, chunk_bounds, fingerprint, fingerprint_many


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("numel", [1, 7, 1000, MIN_CHUNK_NUMEL * 3 + 5])
def test_single_element_change_is_detected(dtype, numel):
    gen = torch.Generator().manual_seed(0)
    t = (torch.rand(numel, generator=gen) * 100).to(dtype)
    base = fingerprint(t)
    for index in {0, numel // 2, numel - 1}:
        changed = t.clone()
        if dtype == torch.bool:
            changed[index] = ~changed[index]
        elif dtype.is_floating_point:
            # The smallest possible change: the next representable value.
            changed[index] = torch.nextafter(changed[index].float(), torch.tensor(1e9)).to(dtype) \
                if dtype in (torch.bfloat16, torch.float16) else torch.nextafter(changed[index], torch.tensor(1e9, dtype=dtype))
            if torch.equal(changed, t):
                changed[index] = changed[index] + 1
        else:
            changed[index] = changed[index] + 1
        other = fingerprint(changed)
        assert base != other
        diff = base.differing_chunks(other)
        assert len(diff) == 1
        a, b = base.bounds[diff[0]], base.bounds[diff[0] + 1]
        assert a <= index < b


def test_equal_tensors_equal_fingerprints_and_shape_matters():
    t = torch.randn(64, 64)
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t) != fingerprint(t.reshape(32, 128))


def test_chunks_cover_the_tensor_aligned():
    n = MIN_CHUNK_NUMEL * 5 + 3
    bounds = chunk_bounds(n)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) - 1 <= CHUNKS
    assert all(b % 8 == 0 for b in bounds[:-1])
    assert chunk_bounds(10) == (0, 10)


def test_noncontiguous_and_meta_and_empty():
    t = torch.randn(300, 300)
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())
    assert fingerprint(torch.empty(3, device="meta")) is None
    assert fingerprint(torch.empty(0)).sums == ()
    fps = fingerprint_many([("a", t), ("m", torch.empty(2, device="meta"))])
    assert set(fps) == {"a"}


def test_many_tensors_each_get_their_own_sums():
    """Each tensor's sums, from one batched pass, equal its fingerprint alone (multi-chunk ones in between)."""
    gen = torch.Generator().manual_seed(1)
    tensors = {"small": torch.randn(5, generator=gen), "big": torch.randn(MIN_CHUNK_NUMEL * 2 + 3, generator=gen),
               "empty": torch.empty(0), "odd": torch.randint(0, 9, (MIN_CHUNK_NUMEL + 1,), dtype=torch.uint8),
               "last": torch.randn(3, 3, generator=gen).t()}
    many = fingerprint_many(tensors.items())
    assert many == {name: fingerprint(t) for name, t in tensors.items()}
    assert len(many["big"].sums) == CHUNKS and many["empty"].sums == ()
