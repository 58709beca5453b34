"""The restart job of bench/bench_restarts.py: rank 1 raises OSError in torchrun's attempt 0 after
init_process_group and one DDP step (its gradient all-reduce); attempt 1 trains 3 steps and passes.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 bench/_restart_train.py
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if attempt == 0 and rank == 1 and step == 1:
            raise OSError("shard-1.bin: I/O error while reading")
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
