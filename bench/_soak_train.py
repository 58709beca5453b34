"""A correct training script for the soak run (bench/soak.py): 4 AdamW steps, destroy_process_group().

    python -m distcheck run --nproc 2 -- bench/_soak_train.py fsdp2     # or: ddp
"""
import sys

import torch
import torch.distributed as dist
from torch import nn


def build(mode: str) -> nn.Module:
    torch.manual_seed(0)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    model = build(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(4):
        x = torch.randn(8, 32, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fsdp2")
