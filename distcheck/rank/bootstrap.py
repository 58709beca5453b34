"""What every rank runs first under distcheck: stack hooks, the collective tracer, and (under plain torchrun, on
local rank 0) the node watcher.

    torchrun --nproc-per-node 2 -m distcheck consistency      # each rank calls rank_bootstrap()
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from distcheck.processes import NODE_WATCHER, ROLE_ENV, agent_pid


def rank_bootstrap(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                   trace: bool = True, watcher: bool = True, stop_dumps: bool = False,
                   command: str | None = None) -> subprocess.Popen | None:
    """Call at the start of every rank under torchrun (consistency, the pytest marker, ``torchrun -m distcheck run``).

    On local rank 0 starts the node watcher (its Popen is returned there, None elsewhere); copies the rank's stderr
    into the report dir, installs the stack hooks (ptracer + faulthandler) and the collective tracer (progress and
    last collectives). ``watcher=False``
    when a supervisor outside the ranks already watches them. ``stop_dumps``: dump every thread on a stop signal
    (torchrun passing on SIGTERM/SIGINT/SIGHUP), for a command that leaves its report to the node watcher then.
    ``command``: the node watcher writes this ``distcheck run`` command's report (the ranks only write files).
    """
    from distcheck.rank import group_keepalive
    from distcheck.rank.stack_hooks import install_rank_hooks
    from distcheck.rank.stderr_tee import tee_stderr
    from distcheck.processes import ensure_run_id, set_child_subreaper

    Path(report_dir).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    # Every process this rank starts from now on stays findable: below it in the process tree (a subreaper keeps
    # orphaned grandchildren there) and tagged with the run id in its environment (what it execs). So a hang dump
    # reaches a stuck DataLoader worker, and nothing the rank started outlives the run (supervise/procs.RunTree).
    set_child_subreaper()
    ensure_run_id(supervised=not watcher)
    node_watcher = None
    if watcher and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ws = os.environ.get("WORLD_SIZE")
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        # Started before the stderr copy: the watcher prints its report to the job's console, not into the copy.
        node_watcher = start_node_watcher(report_dir, timeout, native, int(ws) if ws else None,
                                          int(lws) if lws else None, command)
    tee_stderr(report_dir, rank)  # failure reports quote the last lines of this rank's stderr
    group_keepalive.install()  # a DDP script's end must not deadlock in torch's teardown (see the module)
    install_rank_hooks(report_dir, rank, stop_dumps=stop_dumps)
    if trace:
        from distcheck.rank import tracer as tracing

        if tracing.current() is None:
            tracing.install(report_dir, rank)
    return node_watcher


def start_node_watcher(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                       world_size: int | None = None, local_world_size: int | None = None,
                       command: str | None = None) -> subprocess.Popen:
    """Start the node's watcher process (call from local rank 0 only). It ends by itself when the ranks end.

    Its own session keeps torchrun's teardown signals from killing it halfway through writing the report.
    """
    cmd = [sys.executable, "-m", "distcheck.supervise.node_watcher", "--report-dir", str(report_dir),
           "--timeout", str(timeout), "--parent", str(os.getpid()), "--agent", str(agent_pid())]
    if native:
        cmd.append("--native")
    if world_size:
        cmd += ["--world-size", str(world_size)]
    if local_world_size:
        cmd += ["--local-world-size", str(local_world_size)]
    if command:
        cmd += ["--command", command]
    cmd += ["--log", str(Path(report_dir) / f"watcher-{socket.gethostname()}.log")]
    # stdout/stderr: the rank's, i.e. the job's console, where the report is printed; the log goes to a file.
    # Its role keeps the ranks' own sweeps (runtime.end_processes) from ending it with the script's processes.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                            env={**os.environ, ROLE_ENV: NODE_WATCHER})
