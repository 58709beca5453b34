"""``stackhook-pid<PID>.json``: "this process is a rank and dumps its stacks on this signal". The one writer (each
rank, rank/stack_hooks.py) and the one reader (the dumpers: supervise/stacks.py, the node watcher).

    python -m distcheck run --nproc 2 --report-dir out -- train.py   # each rank writes out/stackhook-pid<PID>.json

The file is per process, not per rank: the dumper starts from pids (py-spy's targets), and a signal sent to a
process without the handler would kill it. A stale file from an earlier job in the same directory names a pid that
is dead or reused; the readers check the pid and the host.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable

from distcheck.contract import atomic_file, files


@dataclass
class HookInfo:
    pid: int
    rank: int
    signal: int  # the faulthandler fallback's signal number
    file: str  # where the rank's faulthandler writes the dump
    ptracer: str  # what the rank allowed to ptrace it, for messages
    host: str = ""
    # Under torchrun: the agent that started the rank, and the variables it set (contract/env.TORCHRUN_VARS), so
    # that the node watcher knows which attempt (--max-restarts) the rank belongs to and that attempt's world.
    agent: int = 0
    launch: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HookInfo:
        launch = data.get("launch") or {}
        return cls(int(data["pid"]), int(data["rank"]), int(data["signal"]), str(data["file"]),
                   str(data.get("ptracer", "")), str(data.get("host", "")), int(data.get("agent") or 0),
                   {str(k): str(v) for k, v in launch.items()} if isinstance(launch, dict) else {})


def write(report_dir: str | os.PathLike, info: HookInfo) -> None:
    """Raises OSError (a full or failing report disk): the caller decides what the rank does without it."""
    atomic_file.write_text(files.hook_file(report_dir, info.pid), json.dumps(info.to_json()))


def remove(report_dir: str | os.PathLike, pid: int) -> None:
    files.hook_file(report_dir, pid).unlink(missing_ok=True)


def read(report_dirs: Iterable[str | os.PathLike | None], pid: int) -> HookInfo | None:
    """The hook of ``pid`` from the first of ``report_dirs`` that has one for it."""
    for d in report_dirs:
        if not d:
            continue
        try:
            info = HookInfo.from_json(json.loads(files.hook_file(d, pid).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if info.pid == pid:
            return info
    return None


def read_all(report_dir: str | os.PathLike) -> list[HookInfo]:
    """Every readable hook file in ``report_dir`` (stale ones included: the caller checks pid and host)."""
    out = []
    for path in files.hook_files(report_dir):
        try:
            out.append(HookInfo.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
