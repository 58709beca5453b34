"""Typed options: what each command hands to the core once its argv is parsed and checked.

    python -m distcheck run --nproc 2 --timeout 60 -- train.py   # -> RunOptions(nproc=2, timeout=60.0, ...)

argparse stays in commands/; every module behind them takes one of these frozen dataclasses, so a caller that
builds options itself (compare building the options of its runs) cannot forget a field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from distcheck.contract import env
from distcheck.errors import UsageError

LAUNCHER_COMMANDS = ("run", "compare")


def is_launcher(argv: "list[str] | tuple[str, ...]", environ: "dict[str, str] | os._Environ" = os.environ) -> bool:
    """Whether ``python -m distcheck ARGV`` launches ranks itself (run, compare), rather than being a rank (under
    torchrun, or started by a launcher) or a command that runs no ranks. Here, not in supervise/, so that a rank
    decides it without importing supervisor code."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in LAUNCHER_COMMANDS and not ("RANK" in environ and "WORLD_SIZE" in environ)

# Set by the launcher for the ranks it starts: a rank under it leaves watching and reporting to the launcher.
ENV_SUPERVISED = env.SUPERVISED


def in_torchrun() -> bool:
    """Whether this process is a rank (torchrun's, or the launcher's: both set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Choices the CLI validates before importing torch (rank/checks/models.py and rank/checks/parallelize.py use the
# same names).
BUILTIN_MODEL = "builtin"
PARALLEL_MODES = ("fsdp", "ddp", "tp")


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
    drift_steps: int = 3  # optimizer steps after which replicas are compared (rank/autocheck/replica_drift.py)

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


# -- numeric options: every value finite and in range, or one line naming the flag and an example ---------------

def seconds(flag: str, value: object) -> float:
    """A positive, finite number of seconds (``--timeout``): nan, inf, 0 and negatives are bad input."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not (math.isfinite(number) and number > 0):
        raise UsageError(f"{flag} {value}: expected a finite number of seconds > 0, e.g. {flag} 300")
    return number


def tolerance(flag: str, value: object) -> float | None:
    """A finite tolerance >= 0 (``--rtol``/``--atol``), or None when not given."""
    if value is None:
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not (math.isfinite(number) and number >= 0):
        raise UsageError(f"{flag} {value!r}: expected a finite number >= 0, e.g. {flag} 1e-4")
    return number


def count(flag: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number in [minimum, maximum] (``--steps``, ``--nproc``)."""
    text = str(value).strip()
    if not text.isdigit() or int(text) < minimum or (maximum is not None and int(text) > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise UsageError(f"{flag} {value!r}: expected a whole number >= {minimum}{upper}")
    return int(text)


def capacity() -> tuple[int, str]:
    """How many ranks this machine can run: one per GPU where there are GPUs, else 4 per CPU core.

    Read from the driver's /proc entries and CUDA_VISIBLE_DEVICES rather than by importing torch: the launcher
    imports torch only once the ranks are started, so that the two imports overlap.
    """
    import os

    gpus = 0
    try:
        gpus = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus and visible is not None:
        gpus = min(gpus, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    if gpus:
        return gpus, f"this machine has {gpus} GPU{'s' if gpus != 1 else ''}"
    cores = os.cpu_count() or 1
    return 4 * cores, f"this machine has no GPU and {cores} CPU core{'s' if cores != 1 else ''} (4 ranks a core)"


def check_capacity(nprocs: list[int] | tuple[int, ...], oversubscribe: bool) -> None:
    """More ranks than the machine can run would start interpreters until the machine stops: exit 2 instead."""
    if oversubscribe or not nprocs:
        return
    limit, why = capacity()
    if max(nprocs) > limit:
        raise UsageError(f"--nproc {max(nprocs)}: {why}, so it runs at most {limit} ranks: use --nproc {limit} or "
                         "less, or pass --oversubscribe to start them anyway")


def backstop(timeout: float) -> float:
    """How long distcheck's own bounded waits last when the watchdog's no-progress limit is ``timeout``.

    Longer than the watchdog's limit, so a stuck rank is diagnosed by the watchdog (stacks, last collectives)
    rather than by a bare timeout error; still finite, so nothing hangs when no watchdog can run.
    """
    return 2 * timeout + 30
