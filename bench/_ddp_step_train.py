"""The training script bench_ddp_step.py runs (not a fixture): DDP steps of a 2-block MLP (4.2 MB of gradients
in float32), each timed on rank 0.

    torchrun --standalone --nproc-per-node 2 bench/_ddp_step_train.py --steps 60 --out times.json
    python -m distcheck run --nproc 2 -- bench/_ddp_step_train.py --steps 60 --out times.json

Rank 0 writes {"steps": [seconds of each step: forward, backward (DDP's bucket all-reduces), optimizer step],
"cpu": [CPU seconds of the training thread in each step: what distcheck's hooks add, without the waits that another
process's slow spell adds]}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dim = args.dim
    model = DDP(nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
                                for _ in range(2)]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(32, dim, generator=gen) for _ in range(4)]
    times, cpu = [], []  # each step's wall time, and the CPU time of this (the training) thread in it
    for i in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = model(batches[i % len(batches)]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": times, "cpu": cpu}, f)
    dist.destroy_process_group()
    if "distcheck.rank" not in sys.modules:
        # torch's own interpreter teardown aborts now and then after a gloo DDP script (docs/hangs-and-faults.md, "Crashes and
        # teardown"); under plain torchrun that would fail the bench's baseline run, so end as distcheck's ranks
        # do. Under distcheck the script returns: an os._exit there is a rank ending without its exit record.
        os._exit(0)


if __name__ == "__main__":
    main()
