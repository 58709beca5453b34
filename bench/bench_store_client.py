"""What a node watcher's link to torchrun's store costs on several nodes: StoreChannel.connect and a first call in a
fresh interpreter, with distcheck's client (supervise/store_client.py) and with torch's TCPStore client, in turn, in
one run. Every node's watcher makes one at every attempt.

    .venv/bin/python bench/bench_store_client.py            # A B A B, 10 fresh interpreters of each per turn

The store is torch's own TCPStore server, hosted by this process as torchrun's agent hosts it. The figures are the
user + system time of the interpreters (RUSAGE_CHILDREN) and their peak RSS, per connection.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONNECT = """
import sys
sys.path.insert(0, {root!r})
from distcheck.supervise.node_exchange import NodeEnv, StoreChannel
{force_torch}
channel = StoreChannel.connect(NodeEnv(1, 2, 1, 1, 2, "node-b", "127.0.0.1", {port}, "distcheck/bench/0/"))
assert channel is not None and channel.bump_progress() > 0
print(type(channel.store).__name__)
"""

FORCE_TORCH = """
from distcheck.supervise import store_client
def refuse(*_):
    raise store_client.ProtocolError("bench: torch's client")
store_client.StoreClient.__init__ = refuse
"""


def _children() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def per_connect(port: int, torch_client: bool, runs: int) -> tuple[float, str]:
    """CPU-ms per fresh interpreter that connects and makes one call, and the client it used."""
    code = CONNECT.format(root=str(ROOT), port=port, force_torch=FORCE_TORCH if torch_client else "")
    before, _ = _children()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return (_children()[0] - before) / runs * 1000, out.stdout.strip()


def peak_rss_mb(port: int, torch_client: bool) -> float:
    """The peak RSS of one such interpreter (a child of its own, so RUSAGE_CHILDREN's maximum is its)."""
    code = CONNECT.format(root=str(ROOT), port=port, force_torch=FORCE_TORCH if torch_client else "")
    probe = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], check=True, "
             "capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, code], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    kinds = {"distcheck's client": False, "torch's TCPStore client": True}
    for torch_client in kinds.values():  # warm-up: .pyc files written, caches filled
        per_connect(server.port, torch_client, 1)
    results: dict[str, list[float]] = {name: [] for name in kinds}
    used: dict[str, str] = {}
    for _ in range(args.rounds):
        for name, torch_client in kinds.items():
            ms, used[name] = per_connect(server.port, torch_client, args.runs)
            results[name].append(ms)
    for name, torch_client in kinds.items():
        print(f"{name} ({used[name]}): {', '.join(f'{v:.0f}' for v in results[name])} CPU-ms per watcher's "
              f"connection; peak RSS {peak_rss_mb(server.port, torch_client):.0f} MB")
    mine, theirs = (min(v) for v in results.values())
    print(f"ratio (torch's / distcheck's, best turn of each): {theirs / mine:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
