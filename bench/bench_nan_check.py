"""Cost of the zero-code NaN/Inf watch per training step, in-process, one thread: no ranks launched.

    .venv/bin/python bench/bench_nan_check.py

Times ``NanWatch.check_step`` (the fused gradient norm pass and its one host read, what every step of the first 50
and every 10th step after pays) over bench/_ddp_step_train.py's sizes of model (two Linear(256, 1024) /
Linear(1024, 256) pairs, 4.2 MB of float32 gradients), and a forward with and without the pre-hook that holds its
inputs for the NaN origin (rank/autocheck/nan_origin.py). Prints microseconds per call, the mean of 300 calls.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.nn as nn

from distcheck.rank.autocheck.nan_origin import HeldInputs
from distcheck.rank.autocheck.nan_watch import NanWatch


def per_call_us(fn, n: int = 300) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256),
                          nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    x = torch.randn(32, 256)
    model(x).sum().backward()
    watch = NanWatch(SimpleNamespace(models=SimpleNamespace(alive=lambda: [model]), write_state=lambda: None))
    params = list(model.parameters())
    print(f"nan_check check_step_us={per_call_us(lambda: watch.check_step(1, 'optimizer.step', params)):.0f}")
    plain = per_call_us(lambda: model(x))
    held = HeldInputs()
    held.watch(model)

    def forward_held() -> None:
        model(x)
        held.clear()

    print(f"nan_check forward_us={plain:.0f} forward_held_us={per_call_us(forward_held):.0f}")


if __name__ == "__main__":
    main()
