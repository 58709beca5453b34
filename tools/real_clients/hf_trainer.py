"""No bug: a transformers Trainer fine-tunes a tiny GPT-2 (built from a config, no download) on 2 CPU ranks.

    python -m distcheck run --nproc 2 --timeout 120 -- tools/real_clients/hf_trainer.py

The Trainer sees the torchrun environment distcheck sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
initializes gloo itself through Accelerate, wraps the model in DDP and shards the synthetic data set with a
DistributedSampler: the replicas must stay identical (expected: PASS, no finding).
"""
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, seq_len=16, vocab=128):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
            report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0,
            seed=0, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        result = trainer.train()
        print(f"rank {args.process_index}: world {args.world_size}, {result.global_step} steps, "
              f"loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
