"""A loop of all_reduce(1024 float32) on torch's fake process group (no communication at all), timed inside the
process: what the tracer adds per collective, with nothing to hide it. Run by bench_trace.py, plain and under
``distcheck run --nproc 1``; writes each round's seconds per op to $DISTCHECK_BENCH_OUT.

    DISTCHECK_BENCH_OUT=/tmp/t.json python bench/_fake_pg_loop.py

Under distcheck, ``dist.all_reduce`` is the tracer's wrapper; the loop then also times the original function it
wraps, round by round in turn with the traced one: the same process measured both ways, so process-to-process
differences (memory layout, a noisy neighbour) do not count.
"""
import json
import os
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

ITERS, ROUNDS = 20000, 7

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
x = torch.ones(1024)


def per_op(all_reduce) -> float:
    t0 = time.perf_counter()
    for _ in range(ITERS):
        all_reduce(x)
    return (time.perf_counter() - t0) / ITERS


traced = dist.all_reduce
original = getattr(traced, "__distcheck_original__", None)
per_op(traced)  # warm up
out = {"rounds": [], "original_rounds": []}
for _ in range(ROUNDS):
    out["rounds"].append(per_op(traced))
    if original is not None:
        out["original_rounds"].append(per_op(original))
with open(os.environ["DISTCHECK_BENCH_OUT"], "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
