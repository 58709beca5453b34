"""Cost of the read-before-wait watch (rank/autocheck/async_reads.py): torch ops while the user's async Work is
pending (the TorchFunctionMode on) vs none pending (no mode), in one process, rounds alternated.

    .venv/bin/python bench/bench_async_reads.py [--rounds 5] [--calls 20000]

Two workloads: a tiny op (``x.add(1)`` on 16 floats: the mode's fixed cost per call) and the forward of a 4-layer
MLP on a 64x256 batch (ops of realistic size). Reports the fastest round of each (on a shared machine the slower
rounds measure the scheduler) as µs per call and the ratio. The watch is on only while a Work from the user's line
is pending, in the first 3 optimizer steps.
"""
from __future__ import annotations

import argparse
import time

import torch

from distcheck.rank.autocheck.async_work import AsyncWatch
from distcheck.rank.usersite import Site


class StandInWork:
    """Only its identity matters to the watch."""


def timed(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, in_flight = torch.ones(16), torch.ones(4)
    mlp = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    batch = torch.randn(64, 256)
    workloads = {"x.add(1)": (lambda: x.add(1), args.calls),
                 "MLP forward (64x256, 4 layers)": (lambda: mlp(batch), max(1, args.calls // 20))}
    watch = AsyncWatch(0, lambda findings: None)
    best: dict[tuple[str, bool], float] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for pending in (False, True):
                if pending:
                    watch.issued([StandInWork()], "all_reduce", [in_flight], Site("/bench/train.py", 1), [in_flight])
                for name, (fn, calls) in workloads.items():
                    us = timed(fn, calls)
                    best[name, pending] = min(best.get((name, pending), us), us)
                watch.pending.clear()
                watch.reads.want(False)
    for name in workloads:
        off, on = best[name, False], best[name, True]
        print(f"{name:32s} no Work pending {off:8.2f} µs   Work pending {on:8.2f} µs   ratio {on / off:5.2f}x")


if __name__ == "__main__":
    main()
