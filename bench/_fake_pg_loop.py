"""A loop of all_reduce(1024 float32) on torch's fake process group (no communication at all), timed inside the
process: what the tracer adds per collective, with nothing to hide it. Run by bench_trace.py, plain and under
``distcheck run --nproc 1``; writes the fastest round's seconds per op to $DISTCHECK_BENCH_OUT.

    DISTCHECK_BENCH_OUT=/tmp/t.json python bench/_fake_pg_loop.py
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


def per_op() -> float:
    t0 = time.perf_counter()
    for _ in range(ITERS):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / ITERS


per_op()  # warm up
rounds = [per_op() for _ in range(ROUNDS)]
with open(os.environ["DISTCHECK_BENCH_OUT"], "w") as fh:
    json.dump(rounds, fh)
dist.destroy_process_group()
