"""``exchange-<host>-<attempt>.json``: where node 0's exchange store listens. The one writer is the exchange host
(rank/exchange_host.py, forked from global rank 0), the one reader node 0's watcher (supervise/node_exchange.py).

    torchrun --nnodes 2 --nproc-per-node 8 ... -m distcheck run -- train.py

Written once, whole, when the store is up: ``{"port": P, "pid": PID}``.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from distcheck.contract import atomic_file, files

NAME = files.EXCHANGE


def path(report_dir: str | os.PathLike, attempt: int, host: str | None = None) -> Path:
    return Path(report_dir) / NAME.format(host=host or socket.gethostname(), attempt=attempt)


def write(report_dir: str | os.PathLike, attempt: int, port: int, pid: int) -> None:
    """Whole or not at all. Raises OSError."""
    atomic_file.write_text(path(report_dir, attempt), json.dumps({"port": port, "pid": pid}))


def read(report_dir: str | os.PathLike, attempt: int) -> tuple[int, int] | None:
    """(port, pid) of this host's exchange store of ``attempt``, or None (not up yet, or none)."""
    try:
        data = json.loads(path(report_dir, attempt).read_text())
        return int(data["port"]), int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove(report_dir: str | os.PathLike, attempt: int) -> None:
    path(report_dir, attempt).unlink(missing_ok=True)
