"""Helpers for integration tests: launch distcheck or scripts on real gloo ranks, always with a timeout.

Every launch runs in its own session (process group) so a timeout kills torchrun *and* its ranks, by pid,
and parallel tests never collide: torchrun uses --standalone (a free port each time).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
BIN = Path(sys.executable).parent
# env for a launch whose ranks must be fresh interpreters (the default for users) rather than forked from the
# test session's zygote (tests/integration/conftest.py)
FRESH = {"DISTCHECK_ZYGOTE": "0"}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for_ranks(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # 2 cores shared by xdist workers and ranks
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(FIXTURES), env.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.pop("DISTCHECK_REPORT_DIR", None)
    if extra:
        env.update(extra)
    return env


def run_cmd(cmd: list[str], timeout: float = 120, cwd: str | os.PathLike | None = None,
            env: dict[str, str] | None = None) -> Result:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=env_for_ranks(env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"command timed out after {timeout}s: {' '.join(cmd)}\n{out}\n{err}") from None
    finally:
        # Ranks may outlive a crashed torchrun: end everything this launch started, by its process group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Result(proc.returncode, out, err)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120, **kw) -> Result:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *args]
    return run_cmd(cmd, timeout=timeout, **kw)


def distcheck(args: list[str], timeout: float = 120, **kw) -> Result:
    return run_cmd([sys.executable, "-m", "distcheck", *args], timeout=timeout, **kw)


def load_report(report_dir: str | os.PathLike) -> dict:
    return json.loads((Path(report_dir) / "report.json").read_text())
