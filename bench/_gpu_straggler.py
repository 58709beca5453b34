"""A correct DDP job on CUDA tensors with a slow rank, for bench_gpu.py --stragglers (falls back to CPU tensors).

    python -m distcheck run --nproc 2 -- bench/_gpu_straggler.py --mode data      # rank 1 loads data slowly
    python -m distcheck run --nproc 2 -- bench/_gpu_straggler.py --mode compute   # rank 1 does 4x the GPU work

Both ranks share one GPU (cuda:0), so the group is gloo's, which takes CUDA tensors: the tracer ends each of its
collectives with a CUDA event (what it does for every backend but NCCL with its ring kept), and the straggler
analysis reads those times. NCCL refuses two ranks on one GPU.
"""
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

MODE = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "data"
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def load_batch(rank: int, step: int) -> torch.Tensor:
    if MODE == "data" and rank == 1:
        time.sleep(0.1)  # a slow shard: this rank's data arrives late
    rows = 4096 if DEVICE.type == "cuda" else 64  # on a GPU, about 50 ms of float32 matmuls a step
    return torch.full((rows, 1024), 0.01 * (step % 4) + rank, device=DEVICE)


def forward_backward(model: torch.nn.Module, batch: torch.Tensor, repeats: int) -> None:
    out = batch
    for _ in range(repeats):  # the compute straggler's larger local batch, as more passes through the model
        out = model(out).tanh()
    out.square().mean().backward()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(8)]
    model = DDP(torch.nn.Sequential(*layers).to(DEVICE))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    repeats = 40 if DEVICE.type == "cuda" else 1
    repeats *= 4 if MODE == "compute" and rank == 1 else 1
    for step in range(16):
        batch = load_batch(rank, step)
        forward_backward(model, batch, repeats)
        opt.step()
        opt.zero_grad()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
