"""The training script bench_autocheck.py runs (not a fixture): 20 FSDP2 (or DDP) steps of a 4-block MLP, timed.

    python -m distcheck run --nproc 2 -- bench/_autocheck_train.py --steps 20 --out times.json
    python -m distcheck run --nproc 2 -- bench/_autocheck_train.py --wrap ddp --steps 20 --out times.json

Rank 0 writes {"loop": seconds from the first forward to after the last optimizer step, "first_step": ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--out", required=True)
    parser.add_argument("--wrap", choices=("fsdp2", "ddp"), default="fsdp2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, args.dim), *[Block(args.dim) for _ in range(4)],
                          nn.Linear(args.dim, 1000))
    if args.wrap == "ddp":  # replicated parameters: the replica-drift check fingerprints them after early steps
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for block in model[1:5]:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, 1000, (8, 64), generator=gen) for _ in range(args.steps)]
    dist.barrier()
    start = time.perf_counter()
    first = None
    for tokens in batches:
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if first is None:
            first = time.perf_counter() - start
    loop = time.perf_counter() - start
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump({"loop": loop, "first_step": first, "pid": os.getpid()}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
