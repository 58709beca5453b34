"""Processes seen through /proc, for every distcheck process (launcher, node watcher, ranks, the pytest pool):
liveness, environment, descendants, the one kill routine, and the run's tag that every process of one run carries.
No torch, nothing of distcheck's but contract/env.py: a rank uses it for its own children (``end_descendants``,
``ensure_run_id``), a supervisor for the ranks' trees (supervise/procs.py builds on it).

    python -m distcheck stacks 12345        # resolves a torchrun agent's pid to its rank processes with these
    python -m distcheck run --nproc 2 -- train.py   # every process of the run carries DISTCHECK_RUN_ID

Only pids distcheck started, that descend from a rank, or that carry the run's tag (``RUN_ID_ENV``), or that the
user named are ever signalled: never a process found by its name.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterable

from distcheck.contract import env

# Set on every rank of a run (by the launcher, or by the rank itself under torchrun), so every process a rank
# execs inherits it: /proc/PID/environ then names the run even after the process left the rank's session or was
# orphaned. (A process a rank only forks, such as a DataLoader worker, shows the environment its rank was exec'd
# with: tagged for a fresh rank, not for one forked by a zygote; the tree walk finds those.)
RUN_ID_ENV = env.RUN_ID
# "pid:start ticks" of what launched the ranks (distcheck's launcher, or torchrun's agent): a rank's stderr copy
# ends the rank's processes itself when both the rank and it are gone (rank/stderr_tee.Orphaned: a SIGKILLed
# launcher runs no sweep).
LAUNCHER_ENV = env.LAUNCHER
# distcheck's own processes among a rank's descendants (they carry the tag too): never ended as leftovers before
# they are done, never dumped as the user's. A stderr copy ends by itself once every writer of its pipe is gone.
ROLE_ENV = env.ROLE
STDERR_COPY, NODE_WATCHER = "stderr-copy", "node-watcher"


def _proc_file(pid: int | str, name: str, whole: bool = False) -> bytes:
    """/proc/PID/NAME's bytes (OSError when the process is gone). os.open and os.read rather than pathlib's text
    reads: the sweeps read every process's stat and environ files several times a run, and a scan of /proc takes a
    sixth of the time this way. ``whole``: read to the end (an environment can pass a page); else one read, which
    holds a stat line."""
    fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
    try:
        data = os.read(fd, 4096)
        if whole and data:
            parts = [data]
            while data:
                data = os.read(fd, 65536)
                parts.append(data)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def _stat_fields(pid: int | str) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (state first); OSError when the process is gone."""
    return _proc_file(pid, "stat").rsplit(b")", 1)[1].split()


def read_environ(pid: int) -> dict[str, str]:
    raw = _proc_file(pid, "environ", whole=True)
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
        state = _stat_fields(pid)[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")  # a zombie has exited; only its exit status remains


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
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(name)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def live_parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every live process (zombies left out), from one scan of /proc."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = _stat_fields(name)
            if fields[0] not in (b"Z", b"X"):
                parents[int(name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def environ_holds(pid: int, item: str) -> bool:
    """Whether the process's environment holds ``item`` ("KEY=value") exactly; False when it cannot be read."""
    return item.encode() in _environ_entries(pid)


def cmdline(pid: int) -> list[str] | None:
    """The process's argv, None when it is gone or cannot be read."""
    try:
        raw = _proc_file(pid, "cmdline", whole=True)
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


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


def yama_scope() -> str | None:
    """The kernel's Yama ptrace scope ("0" to "3"), None without Yama: who may attach py-spy to a rank."""
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return None


def die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the parent dies (Linux PR_SET_PDEATHSIG), so a killed distcheck never
    leaves ranks behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


AGENT_PID_ENV = env.AGENT_PID  # in a torchrun rank a zygote forked (zygote.stand_in): the agent's pid


def agent_pid() -> int:
    """The process that started this rank: torchrun's agent under torchrun. That is the parent, except for a rank a
    zygote forked in place of the process the agent started, which names the agent in DISTCHECK_AGENT_PID."""
    try:
        return int(os.environ[AGENT_PID_ENV])
    except (KeyError, ValueError):
        return os.getppid()


# --- a run's process tree -------------------------------------------------------------------------------------


def new_run_id() -> str:
    import uuid

    return uuid.uuid4().hex


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot): with its pid, it names one process, never a later one
    that reuses the pid."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def torchrun_run_id(attempt: int | None = None, agent: int | None = None) -> str:
    """The run id of the torchrun job this rank belongs to, the same on every local rank: its agent's pid and start
    time (torchrun's own TORCHELASTIC_RUN_ID is "none" unless the user sets --rdzv-id), and the attempt
    (``--max-restarts``: TORCHELASTIC_RESTART_COUNT), so that one attempt's sweeps never reach the next one's.
    ``agent``: whose (the node watcher's, for an attempt's ranks); by default this rank's."""
    agent = agent or agent_pid()
    if attempt is None:
        attempt = restart_count()
    return f"torchrun-{agent}-{start_ticks(agent)}" + (f"-attempt{attempt}" if attempt else "")


def restart_count(environ: dict[str, str] | None = None) -> int:
    """torchrun's attempt number (``--max-restarts``) in ``environ`` (this process's by default): 0 for the first."""
    try:
        return int((os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def restarts_left(environ: dict[str, str] | None = None) -> bool:
    """Whether torchrun may start another attempt after this one: it tells the ranks its ``--max-restarts``."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > restart_count(environ)
    except ValueError:
        return False


def launcher_id(pid: int) -> str:
    return f"{pid}:{start_ticks(pid)}"


def ensure_run_id(supervised: bool) -> str:
    """This rank's run id: its launcher's (``run --nproc``), else the torchrun job's, exported so that every process
    the rank execs from now on carries it (and its launcher's identity, LAUNCHER_ENV). Under torchrun an id in
    the environment is an outer run's (a job started from inside another's rank): never this job's, whose sweeps
    must not reach the outer run's processes."""
    if supervised and os.environ.get(RUN_ID_ENV) and os.environ.get(LAUNCHER_ENV):
        return os.environ[RUN_ID_ENV]
    os.environ[RUN_ID_ENV] = run_id = torchrun_run_id()
    os.environ[LAUNCHER_ENV] = launcher_id(agent_pid())
    return run_id


def set_child_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux PR_SET_CHILD_SUBREAPER): a grandchild whose parent exits (a
    daemonizing helper, a DataLoader worker's own child) stays in this process's tree instead of moving to init, so
    the tree walk still finds it while this process lives."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def _environ_entries(pid: int) -> list[bytes]:
    try:
        return _proc_file(pid, "environ", whole=True).split(b"\0")
    except OSError:
        return []


def role_of(pid: int) -> str | None:
    """distcheck's role for one of its own processes (ROLE_ENV), None for everything else."""
    prefix = f"{ROLE_ENV}=".encode()
    for item in _environ_entries(pid):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def tagged(run_id: str) -> dict[int, str | None]:
    """``{pid: role}`` of every live process whose environment carries this run id."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    prefix = f"{ROLE_ENV}=".encode()
    found: dict[int, str | None] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        items = _environ_entries(pid)
        if needle in items and alive(pid):
            found[pid] = next((i[len(prefix):].decode(errors="replace") for i in items if i.startswith(prefix)), None)
    return found


def descendants(roots: dict[int, int], children: dict[int, list[int]] | None = None) -> dict[int, int]:
    """``{pid: root key}`` of every live descendant of each root pid (``roots``: pid -> key, e.g. its rank)."""
    children = children_map() if children is None else children
    found: dict[int, int] = {}
    for root, key in roots.items():
        stack = list(children.get(root, []))
        while stack:
            pid = stack.pop()
            if pid in found or pid in roots:
                continue
            found[pid] = key
            stack.extend(children.get(pid, []))
    return {pid: key for pid, key in found.items() if alive(pid)}


def reap(pids: Iterable[int]) -> None:
    """Collect the exit status of those of ``pids`` that are this process's children and have ended (orphans a
    subreaper adopted), so that no zombie is left; a pid that is not our child is skipped."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def end_descendants(keep: Iterable[int] = (), grace: float = 1.0) -> list[int]:
    """In a rank that is ending: end the processes it started and their children (the rank is a subreaper, so its
    whole tree is below it), except distcheck's own (``keep``, and any with a ROLE_ENV). Returns their pids."""
    mine = descendants({os.getpid(): 0})
    keep = set(keep)
    users = [pid for pid in mine if pid not in keep and role_of(pid) is None]
    if users:
        terminate(users, grace=grace)
        reap(users)
    return users
