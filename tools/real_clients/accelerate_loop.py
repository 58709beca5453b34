"""No bug: a plain Accelerate training loop (Accelerator, prepare, accelerator.backward) on 2 CPU ranks.

    python -m distcheck run --nproc 2 --timeout 120 -- tools/real_clients/accelerate_loop.py

Accelerator() reads the torchrun environment distcheck sets, initializes gloo, wraps the model in DDP and shards
the DataLoader; every rank starts from the same seed: the replicas must stay identical (expected: PASS).
"""
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main():
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, (xb, yb) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:
            break
    accelerator.print(f"world {accelerator.num_processes}, {step + 1} steps, loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
