"""The built-in model and ``--model MODULE_OR_FILE:FACTORY`` loading.

    torchrun --nproc-per-node 2 -m distcheck consistency --model my_pkg.model:build
    torchrun --nproc-per-node 2 -m distcheck consistency --model path/to/file.py:build

The built-in model is a small pre-norm transformer language model (embedding, attention, MLP, RMSNorm, head),
shaped so every parallelism the ``consistency`` command applies has something to shard: FSDP2 per block and root,
DDP, and tensor parallelism (colwise q/k/v/up, rowwise out/down).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distcheck.errors import UsageError
from distcheck.options import BUILTIN_MODEL

BUILTIN = BUILTIN_MODEL


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    seq: int = 16
    hidden: int = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: TinyConfig = TinyConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("pos", torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_builtin() -> nn.Module:
    return TinyTransformer()


def _load_module(target: str, spec: str):
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"--model {spec}: file {target} does not exist (pass path/to/file.py:FACTORY)")
        name = f"distcheck_user_model_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"--model {spec}: {target} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        # The user's directory goes on sys.path so the file's own sibling imports work.
        sys.path.insert(0, str(path.resolve().parent))
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise UsageError(f"--model {spec}: importing {target} failed: {type(exc).__name__}: {exc}") from None
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise UsageError(f"--model {spec}: no module named {exc.name!r} (check PYTHONPATH, or pass "
                         f"path/to/file.py:FACTORY)") from None
    except Exception as exc:
        raise UsageError(f"--model {spec}: importing {target} failed: {type(exc).__name__}: {exc}") from None


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """``pkg.module:fn`` or ``path/to/file.py:fn`` -> the factory; UsageError (exit 2) naming what is wrong."""
    if spec == BUILTIN:
        return build_builtin
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"--model {spec}: expected MODULE:FACTORY or path/to/file.py:FACTORY "
                         f"(e.g. my_pkg.model:build)")
    module = _load_module(target, spec)
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"--model {spec}: {target} has no attribute {attr!r}")
    if not callable(factory):
        raise UsageError(f"--model {spec}: {target}.{attr} is not callable")
    return factory


def build_model(spec: str, seed: int | None = None) -> nn.Module:
    """Call the factory (seeded, if given) and check it returned an nn.Module; UsageError otherwise."""
    factory = load_factory(spec)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = factory()
    except Exception as exc:
        raise UsageError(f"--model {spec}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module")
    return model
