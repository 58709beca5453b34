"""A loop of all_reduce(1024 float32) on torch's fake process group (no communication at all), timed inside the
process: what the tracer adds per collective, with nothing to hide it. Run by bench_trace.py, plain and under
``distcheck run --nproc 1``; writes each round's seconds per op to $DISTCHECK_BENCH_OUT.

    DISTCHECK_BENCH_OUT=/tmp/t.json python bench/_fake_pg_loop.py

Under distcheck, ``dist.all_reduce`` is the tracer's wrapper; the loop then also times the original function it
wraps, round by round in turn with the traced one: the same process measured both ways, so process-to-process
differences (memory layout, a noisy neighbour) do not count. It also times both called from DEPTH frames of
torch's own code, as FSDP2's and DTensor's hooks call collectives: there the tracer walks out to the user's line.
"""
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# Many short rounds: this VM has slow spells of a second or more, and short rounds taken in turn let every mode
# catch quiet moments (and put each traced round next to its untraced twin).
ITERS, ROUNDS = 2000, 60
DEPTH = 12

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
x = torch.ones(1024)


def per_op(all_reduce) -> float:
    t0 = time.perf_counter()
    for _ in range(ITERS):
        all_reduce(x)
    return (time.perf_counter() - t0) / ITERS


# DEPTH functions compiled as if they were a file of torch's: each calls the next, the last one the collective.
_chain = "def f0(op, x):\n    return op(x)\n" + "".join(
    f"def f{i}(op, x):\n    return f{i - 1}(op, x)\n" for i in range(1, DEPTH))
_torch_code: dict = {}
exec(compile(_chain, str(Path(torch.__file__).parent / "distributed" / "_bench_chain.py"), "exec"), _torch_code)
inside_torch = _torch_code[f"f{DEPTH - 1}"]


def per_op_inside_torch(all_reduce) -> float:
    t0 = time.perf_counter()
    for _ in range(ITERS):
        inside_torch(all_reduce, x)
    return (time.perf_counter() - t0) / ITERS


traced = dist.all_reduce
original = getattr(traced, "__distcheck_original__", None)
per_op(traced)  # warm up
out = {"rounds": [], "original_rounds": [], "deep_rounds": [], "deep_original_rounds": []}
for _ in range(ROUNDS):
    out["rounds"].append(per_op(traced))
    if original is not None:
        out["original_rounds"].append(per_op(original))
        out["deep_rounds"].append(per_op_inside_torch(traced))
        out["deep_original_rounds"].append(per_op_inside_torch(original))
with open(os.environ["DISTCHECK_BENCH_OUT"], "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
