"""No bug: a tiny LightningModule trained by Trainer(accelerator="cpu", devices=2, strategy="ddp") on 2 CPU ranks.

    python -m distcheck run --nproc 2 --timeout 120 -- tools/real_clients/lightning_ddp.py

Lightning detects the torchrun environment distcheck sets (TorchElasticEnvironment) and runs one DDP process per
rank instead of spawning its own; seed_everything gives every rank the same initial weights: the replicas must
stay identical (expected: PASS).
"""
import tempfile

import torch

try:
    import lightning as L
except ImportError:  # only the pytorch-lightning distribution installed
    import pytorch_lightning as L


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main():
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=root)
        trainer.fit(Tiny(), loader)
        print(f"rank {trainer.global_rank}: world {trainer.world_size}, {trainer.global_step} steps")


if __name__ == "__main__":
    main()
