"""What torch's NCCL Flight Recorder ring itself costs per collective (bench_gpu.py's helper, run twice: with
TORCH_FR_BUFFER_SIZE=0 and with distcheck's default 20000). Prints the host time of a 1024-float NCCL all_reduce.

    TORCH_FR_BUFFER_SIZE=0 python bench/_gpu_fr_cost.py; TORCH_FR_BUFFER_SIZE=20000 python bench/_gpu_fr_cost.py
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("nccl", store=store, rank=0, world_size=1)
torch.cuda.set_device(0)
x = torch.ones(1024, device="cuda")
for _ in range(500):
    dist.all_reduce(x)
rounds = []
for _ in range(15):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        dist.all_reduce(x)
    rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
    torch.cuda.synchronize()
print(f"TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE')}: all_reduce fastest {min(rounds):.2f} us, "
      f"median {statistics.median(rounds):.2f} us")
dist.destroy_process_group()
