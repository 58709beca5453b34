"""A DDP job whose rank 1 raises an OSError at step 2 (a lost data file): what bench_fail_fast.py times.

    torchrun --standalone --nproc-per-node 2 bench/_ddp_fail_train.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(20):
        if rank == 1 and step == 2:
            raise OSError(2, "No such file or directory", f"/data/shard-{step}.bin")
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
