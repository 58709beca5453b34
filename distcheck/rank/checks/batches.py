"""Deterministic inputs and losses for any model the ``consistency`` command trains.

A model may define ``distcheck_batch(batch_size, generator) -> Tensor`` and ``distcheck_loss(output, batch)``;
otherwise the input is inferred from the first layer: token ids for an nn.Embedding, features for an nn.Linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distcheck.errors import UsageError

DEFAULT_SEQ = 16


@dataclass(frozen=True)
class BatchMaker:
    make: Callable[[int, torch.Generator], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def _first_layer(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Linear)):
            return module
    return None


def mean_square(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    # A scalar that depends on every output element; a mean, so per-rank means average to the global mean.
    return output.float().pow(2).mean()


def next_token_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]).float(), batch[:, 1:].reshape(-1))


def batch_maker(model: nn.Module, spec: str) -> BatchMaker:
    custom_loss = getattr(model, "distcheck_loss", None)
    if hasattr(model, "distcheck_batch"):
        return BatchMaker(model.distcheck_batch, custom_loss or mean_square, "model.distcheck_batch")
    first = _first_layer(model)
    if isinstance(first, nn.Embedding):
        vocab = first.num_embeddings
        seq = getattr(getattr(model, "cfg", None), "seq", DEFAULT_SEQ)

        def tokens(n: int, gen: torch.Generator) -> torch.Tensor:
            return torch.randint(0, vocab, (n, seq), generator=gen)

        return BatchMaker(tokens, custom_loss or next_token_loss, f"token ids [batch, {seq}] < {vocab}")
    if isinstance(first, nn.Linear):
        width = first.in_features

        def features(n: int, gen: torch.Generator) -> torch.Tensor:
            return torch.randn(n, width, generator=gen)

        return BatchMaker(features, custom_loss or mean_square, f"features [batch, {width}]")
    raise UsageError(f"--model {spec}: cannot infer the input (no nn.Embedding or nn.Linear found): give the model "
                     f"a distcheck_batch(batch_size, generator) method")


def global_batch(maker: BatchMaker, size: int, seed: int, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + step)  # independent of the global RNG the model may use
    return maker.make(size, gen).to(device)
