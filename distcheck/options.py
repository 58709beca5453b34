"""Typed options: what each command hands to the core once its argv is parsed and checked.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py   # -> RunOptions(nproc=2, timeout=60.0, ...)

argparse stays in commands/; every module behind them takes one of these frozen dataclasses, so a caller that
builds options itself (compare building the options of its runs) cannot forget a field.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

# Set by the launcher for the ranks it starts: a rank under it leaves watching and reporting to the launcher.
ENV_SUPERVISED = "DISTCHECK_SUPERVISED"


@dataclass(frozen=True)
class RunOptions:
    script: Path
    script_args: tuple[str, ...] = ()
    nproc: int | None = None  # None: 1 rank, or the ranks of the torchrun the command runs under
    timeout: float = 300.0  # the no-progress limit
    report_dir: str | None = None
    native: bool = False  # native frames in hang stack dumps
    command: str = ""  # the command line for report.json
    env: dict[str, str] = field(default_factory=dict, compare=False)  # extra environment for the ranks

    def with_(self, **changes) -> RunOptions:
        return replace(self, **changes)


@dataclass(frozen=True)
class CompareOptions:
    run: RunOptions  # script, timeout, report dir, native: shared by every run of the comparison
    nprocs: tuple[int, ...]
    rtol: float | None = None
    atol: float | None = None
    steps: int | None = None


@dataclass(frozen=True)
class ConsistencyOptions:
    model: str
    parallel: str
    steps: int
    timeout: float
    report_dir: str | None
    native: bool
    rtol: float | None
    atol: float | None
    command: str
