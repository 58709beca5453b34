"""What each rank holds of FSDP1's flat parameters (pure: numbers in, numbers out).

    model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    python -m distcheck run --nproc 2 -- train.py      # the placement table shows these numbers per parameter

FSDP1 concatenates a unit's parameters (with alignment padding between them when ``use_orig_params=True``) into
one flat tensor and gives rank ``r`` of its shard group chunk ``r`` of ``flat.chunk(world)``: ``ceil(n / world)``
elements each, the last chunks shorter or empty, every chunk padded to the first one's size
(``FlatParamHandle._get_unpadded_shard`` in torch/distributed/fsdp/_flat_param.py, torch 2.13). A parameter that
straddles a chunk boundary is split between ranks; one that lies inside another rank's chunk has 0 elements here.
"""
from __future__ import annotations


def chunk_bounds(total: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk of a flat tensor of ``total`` elements, as ``tensor.chunk(world)`` cuts it
    (ranks past the last chunk get an empty one)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, not {world}")
    size = -(-total // world) if total else 0
    return [(min(r * size, total), min((r + 1) * size, total)) for r in range(world)]


def held_numels(numels_with_padding: list[int], is_padding: list[bool], world: int) -> list[list[int]]:
    """For each real (non-padding) parameter of a flat parameter, the number of its elements each of the ``world``
    ranks of the shard group holds; the rows sum to the parameters' numels."""
    if len(numels_with_padding) != len(is_padding):
        raise ValueError("numels_with_padding and is_padding must have one entry per flat segment")
    bounds = chunk_bounds(sum(numels_with_padding), world)
    out: list[list[int]] = []
    start = 0
    for numel, padding in zip(numels_with_padding, is_padding):
        end = start + numel
        if not padding:
            out.append([max(0, min(end, hi) - max(start, lo)) for lo, hi in bounds])
        start = end
    return out


def holdings_text(numels: list[int]) -> str:
    """``[161, 95]`` -> ``161|95``: what ranks 0, 1, ... of the shard group hold, for the placement table."""
    return "|".join(str(n) for n in numels)
