"""The processes distcheck supervises, seen from outside: liveness, environment, descendants, and the one kill
routine every supervisor uses (the launcher, the node watcher, the torchrun monitor and the pytest pool).

    python -m distcheck stacks 12345        # resolves a torchrun agent's pid to its rank processes with these

Only pids distcheck started (or that the user named) are ever signalled.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterable


def read_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its exit status remains


def is_python(pid: int) -> bool | None:
    """True/False from the process's memory map (interpreter binary or libpython); None when unreadable."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except PermissionError:
        return None
    except OSError:
        return False
    return any("python" in os.path.basename(line.split()[-1]) for line in maps.splitlines()
               if line.count(" ") >= 5 and "/" in line)


def children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def rank_descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """The topmost descendants of ``pid`` that have RANK in their environment: torchrun's workers.

    The search stops at a rank: its own children (DataLoader workers) inherit RANK but are not ranks.
    """
    children = children_map() if children is None else children
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        try:
            env = read_environ(child)
        except OSError:
            env = {}
        if "RANK" in env and alive(child):
            found.append(child)
        else:
            stack.extend(children.get(child, []))
    return sorted(found)


def safe_environ(pid: int) -> dict[str, str]:
    try:
        return read_environ(pid)
    except OSError:
        return {}


def terminate(pids: Iterable[int], grace: float = 3.0, group: bool = False) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds. ``group=True`` signals each pid's process
    group (ranks started in their own session, so their DataLoader workers go too).

    The caller reaps its own children (``Popen.wait``) afterwards; a zombie already counts as ended here.
    """
    pids = [p for p in pids if p and p > 0]

    def send(pid: int, sig: int) -> None:
        try:
            if group:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    for pid in pids:
        if alive(pid):
            send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid) or group:
            send(pid, signal.SIGKILL)


def die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the parent dies (Linux PR_SET_PDEATHSIG), so a killed distcheck never
    leaves ranks behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


AGENT_PID_ENV = "DISTCHECK_AGENT_PID"  # in a torchrun rank a zygote forked (zygote.stand_in): the agent's pid


def agent_pid() -> int:
    """The process that started this rank: torchrun's agent under torchrun. That is the parent, except for a rank a
    zygote forked in place of the process the agent started, which names the agent in DISTCHECK_AGENT_PID."""
    try:
        return int(os.environ[AGENT_PID_ENV])
    except (KeyError, ValueError):
        return os.getppid()
