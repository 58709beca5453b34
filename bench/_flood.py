"""The flood of bench/bench_output.py: each rank writes N lines of 100 bytes to stderr, one write per line (as
logging does), between two barriers, and records how long its writes took.

    torchrun --nproc-per-node 2 bench/_flood.py --lines 200000 --out times.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    write = sys.stderr.write
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.lines):
        write(f"rank {rank} line {i:08d} " + "x" * 78 + "\n")  # 100 bytes; stderr is line-buffered: one write
    sys.stderr.flush()
    seconds = time.perf_counter() - t0
    dist.barrier()
    Path(f"{args.out}.rank{rank}").write_text(json.dumps({"seconds": seconds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
