"""What a rank installs so that its stack can be dumped from outside, even by an unprivileged py-spy.

    python -m distcheck run --nproc 2 -- train.py    # every rank calls install_rank_hooks() before the script

ptrace permission. Under Yama ``ptrace_scope=1`` (the default on Ubuntu and many clusters) a process may only be
ptraced by its ancestors or by a process it named with ``prctl(PR_SET_PTRACER)`` (and that process's
descendants). py-spy is a child of the supervisor or watcher, never an ancestor of the ranks, so each rank names
its parent (torchrun's agent, or the ``distcheck run`` supervisor) as ptracer: py-spy, started by that parent or
by a watcher that a rank spawned, is its descendant and is allowed. The same function registers a faulthandler
dump on a signal, used when py-spy is missing or denied (supervise/stacks.py reads it).
"""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

from distcheck.contract import env, files, stack_dump_file, stack_hook_file
from distcheck.contract.stack_hook_file import HookInfo
from distcheck.processes import agent_pid, yama_scope

log = logging.getLogger("distcheck")

STACK_SIGNAL_ENV = env.STACK_SIGNAL  # signal name for the faulthandler fallback (default SIGUSR2)
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1 & 0xFFFFFFFFFFFFFFFF


def stack_signal() -> signal.Signals:
    name = os.environ.get(STACK_SIGNAL_ENV, "SIGUSR2").upper()
    try:
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except KeyError:
        return signal.SIGUSR2


def hook_path(report_dir: str | os.PathLike, pid: int) -> Path:
    return files.hook_file(report_dir, pid)


def allow_ptrace_from(pid: int | None) -> tuple[bool, str]:
    """prctl(PR_SET_PTRACER, pid): let ``pid`` and its descendants ptrace this process under Yama scope 1.

    Returns (done, reason). Without Yama the call fails with EINVAL, which is fine: nothing restricts ptrace
    beyond the usual same-user rule then.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.c_ulong(PR_SET_PTRACER_ANY if pid is None else pid)
        rc = libc.prctl(ctypes.c_int(PR_SET_PTRACER), value, ctypes.c_ulong(0), ctypes.c_ulong(0),
                        ctypes.c_ulong(0))
    except (OSError, AttributeError) as exc:
        return False, f"prctl unavailable: {exc}"
    if rc == 0:
        return True, f"PR_SET_PTRACER {pid if pid is not None else 'ANY'}"
    err = ctypes.get_errno()
    if err == 22 and yama_scope() is None:
        return False, "no Yama LSM on this kernel: ptrace is not restricted beyond same-user"
    return False, f"prctl(PR_SET_PTRACER) failed: {os.strerror(err)}"


_hook_file: Any = None


def install_rank_hooks(report_dir: str | os.PathLike, rank: int | None = None,
                       ptracer_pid: int | None | str = "parent", stop_dumps: bool = False) -> HookInfo:
    """Call once in each rank process started by distcheck (run/compare/consistency/pytest).

    1. Names the parent process (the launcher) as ptracer, so py-spy started by it or by a watcher below it can
       attach under Yama ptrace_scope=1 (``ptracer_pid=None`` allows any process of the same user).
    2. Registers a faulthandler dump of all threads on SIGUSR2 (``DISTCHECK_STACK_SIGNAL``) into
       ``<report_dir>/faulthandler-rank<R>.txt``: the fallback when py-spy is missing or denied. It is a C signal
       handler, so it works while another thread or native code holds the GIL.
    3. Writes ``stackhook-pid<PID>.json`` so the dumper knows this process accepts the signal (signalling a
       process without the handler would kill it).
    """
    global _hook_file
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    pid = os.getpid()
    if ptracer_pid == "parent":
        # A rank forked by the launcher's zygote has the zygote as parent; the launcher (which runs py-spy)
        # names itself in DISTCHECK_PTRACER.
        target = int(os.environ.get(env.PTRACER) or os.getppid())
    else:
        target = ptracer_pid
    _, reason = allow_ptrace_from(target)  # type: ignore[arg-type]
    if _hook_file is not None:
        _hook_file.close()
    _hook_file = stack_dump_file.open_fallback(report_dir, rank)
    path = _hook_file.name
    sig = stack_signal()
    faulthandler.register(sig, file=_hook_file, all_threads=True, chain=False)
    # A fatal signal (SIGSEGV in a custom op, SIGABRT in torch's teardown) prints every thread's Python stack to
    # stderr, which the report quotes (rank/stderr_tee.py): the line where the rank died.
    faulthandler.enable(file=2, all_threads=True)  # the descriptor: sys.stderr may be a capture without one
    if stop_dumps:
        # Under torchrun a stop signal to the agent reaches every rank: each dumps its own stacks before dying
        # (a C-level handler, so a rank blocked in a collective dumps too), for the node watcher's report.
        # After the dump the signal's default action ends the rank, SIGINT too: a KeyboardInterrupt would wait
        # for a rank blocked in a collective to return to Python, which it never does.
        for name in files.STOP_SIGNAL_NAMES:
            try:
                stop_file = stack_dump_file.open_stop(report_dir, rank, name)
            except OSError as exc:  # a full or failing report disk costs this dump, never the rank
                log.debug("no stop-signal dump file for %s: %s", name, exc)
                continue
            _stop_files.append(stop_file)
            signal.signal(getattr(signal, name), signal.SIG_DFL)
            faulthandler.register(getattr(signal, name), file=stop_file, all_threads=True, chain=True)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    info = HookInfo(pid, rank, int(sig), str(path), reason, socket.gethostname(),
                    agent_pid() if under_torchrun else 0,
                    {k: os.environ[k] for k in env.TORCHRUN_VARS if k in os.environ} if under_torchrun else {})
    try:
        stack_hook_file.write(report_dir, info)
    except OSError as exc:  # the watcher then dumps with py-spy alone; the rank runs on
        log.warning("distcheck: could not write %s (%s): the faulthandler fallback is off for this rank",
                    hook_path(report_dir, pid).name, exc)
    return info


_stop_files: list = []


def remove_rank_hooks(report_dir: str | os.PathLike, rank: int) -> None:
    """At a rank's normal end: its hook file and the dump files nothing was written to go."""
    stack_hook_file.remove(report_dir, os.getpid())
    for fh in _stop_files + ([_hook_file] if _hook_file is not None else []):
        try:
            fh.flush()
        except (OSError, ValueError):
            pass
    files.remove_empty_rank_files(report_dir, rank)
