"""What every rank runs first under distcheck: stack hooks, the collective tracer, and (under plain torchrun, on
local rank 0) the node watcher.

    torchrun --nproc-per-node 2 -m distcheck consistency      # each rank calls rank_bootstrap()
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from distcheck.contract import watcher_file
from distcheck.contract.watcher_file import WatcherState
from distcheck.processes import (NODE_WATCHER, ROLE_ENV, agent_pid, alive, launcher_id, restart_count,
                                 restarts_left, start_ticks)


def rank_bootstrap(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                   trace: bool = True, watcher: bool = True, stop_dumps: bool = False,
                   command: str | None = None) -> NodeWatcher | None:
    """Call at the start of every rank under torchrun (consistency, the pytest marker, ``torchrun -m distcheck run``).

    On local rank 0 starts the node watcher, or finds the one an earlier attempt of the same torchrun agent started
    (``--max-restarts``; returned there, None elsewhere); copies the rank's stderr
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
    earlier = live_watcher(report_dir) if watcher else None
    if watcher and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        ws = os.environ.get("WORLD_SIZE")
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        # Started before the stderr copy: the watcher prints its report to the job's console, not into the copy.
        node_watcher = NodeWatcher(report_dir, earlier.pid, None) if earlier is not None else \
            start_node_watcher(report_dir, timeout, native, int(ws) if ws else None, int(lws) if lws else None,
                               command)
    tee_stderr(report_dir, rank)  # failure reports quote the last lines of this rank's stderr
    group_keepalive.install()  # a DDP script's end must not deadlock in torch's teardown (see the module)
    isolate_attempt_keys()  # before the script's init_process_group: attempt N must not read attempt N-1's keys
    # A restarted attempt's ranks are not below the watcher an earlier attempt's local rank 0 started (that rank is
    # gone, and the watcher with it from the agent's tree): under Yama ptrace_scope=1 they name the watcher itself
    # as the one process (with its py-spy children) allowed to read their stacks.
    install_rank_hooks(report_dir, rank, ptracer_pid=earlier.pid if earlier is not None else "parent",
                       stop_dumps=stop_dumps)
    if trace:
        from distcheck.rank import tracer as tracing

        if tracing.current() is None:
            tracing.install(report_dir, rank)
    return node_watcher


def isolate_attempt_keys() -> None:
    """Under torchrun on one node, give each attempt (``--max-restarts``) a key space of its own in the agent's store.

    torchrun's agent serves one TCPStore for all its attempts (the same MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE),
    and torch 2.13's env:// rendezvous adds no per-attempt prefix (rendezvous._create_c10d_store: "we create a new
    TCPStore for every retry", which the shared agent store no longer does). So attempt N finds attempt N-1's keys:
    gloo's connectFullMesh reads a dead rank's address ("default_pg/0//cpu//0/<rank>") before its new incarnation
    overwrote it, and connects to it (Connection refused) or picks its listen/connect role from the stale port and
    waits forever (both ranks in init_process_group); distcheck's side channel ("default_pg/0//distcheck/...")
    returns attempt N-1's values. On several nodes the agents' restart counts can differ (a membership change
    restarts without counting), so there the keys stay as torch leaves them."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or os.environ.get("GROUP_WORLD_SIZE") != "1" \
            or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    try:
        import torch.distributed as dist
        import torch.distributed.rendezvous  # noqa: F401 - the name is the module's rendezvous() function

        rendezvous = sys.modules["torch.distributed.rendezvous"]
    except Exception:  # no torch.distributed: no process group to isolate
        return
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "distcheck_attempt", False):
        return
    prefix = f"distcheck/attempt-{restart_count()}"

    def create_c10d_store(*args, **kwargs):
        return dist.PrefixStore(prefix, original(*args, **kwargs))

    create_c10d_store.distcheck_attempt = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = create_c10d_store


class NodeWatcher:
    """The node's watcher as its local rank 0 sees it: the process this rank started (``process``), or the one an
    earlier attempt's local rank 0 started for the same torchrun agent (``--max-restarts``)."""

    def __init__(self, report_dir: str | os.PathLike, pid: int, process: subprocess.Popen | None) -> None:
        self.report_dir, self.pid, self.process = report_dir, pid, process
        self.ticks = start_ticks(pid)

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return alive(self.pid) and start_ticks(self.pid) == self.ticks

    def outcome(self, attempt: int, limit: float) -> int | None:
        """Wait (at most ``limit`` seconds) until the watch of torchrun's ``attempt`` is over: its exit code (the
        report's on the node that writes it), or None when the watcher ended or timed out without saying."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            running = self.running()  # before the read: a watcher that wrote its state and then ended is done
            state = self._done_with(attempt)
            if state is not None:
                if self.process is not None and not restarts_left():
                    # It ends now (no attempt can follow): this rank stays until it has, so that nothing of
                    # distcheck outlives torchrun.
                    self._wait_end(max(0.0, deadline - time.monotonic()))
                return state.code
            if not running:
                return None
            time.sleep(0.05)
        return None

    def _done_with(self, attempt: int) -> WatcherState | None:
        """This watcher's state once it is done with this rank's ``attempt``, else None."""
        state = watcher_file.read(self.report_dir)
        if state is not None and state.pid == self.pid and state.done_with(attempt, os.getpid()):
            return state
        return None

    def stop(self) -> None:
        """End it (``consistency``: its rank 0 wrote the report and the run is over)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self._wait_end(5.0)

    def _wait_end(self, limit: float) -> None:
        try:
            self.process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.process.kill()


def live_watcher(report_dir: str | os.PathLike) -> WatcherState | None:
    """The state of the watcher that an earlier attempt of this rank's torchrun agent started on this node, while
    that watcher runs; None otherwise (the first attempt, a watcher that died, a stale file of another job)."""
    state = watcher_file.read(report_dir)
    if state is None or state.agent != launcher_id(agent_pid()):
        return None
    if not alive(state.pid) or start_ticks(state.pid) != state.ticks:
        return None
    return state


def start_node_watcher(report_dir: str | os.PathLike, timeout: float, native: bool = False,
                       world_size: int | None = None, local_world_size: int | None = None,
                       command: str | None = None) -> NodeWatcher:
    """Start the node's watcher process (call from local rank 0 only). It ends by itself when the ranks end (when
    torchrun may restart them, when its agent ends).

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
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                               env={**os.environ, ROLE_ENV: NODE_WATCHER})
    # The watcher writes its state once its imports are done, a second or more on a loaded machine. An attempt that
    # ends sooner (a rank failing at once) left no state, and the restarted attempt's local rank 0 started a second
    # watcher beside it (1 clean-clone suite run in 4): its state is written here first, for it.
    try:
        watcher_file.write(report_dir, WatcherState(process.pid, start_ticks(process.pid), launcher_id(agent_pid()),
                                                    restart_count()))
    except OSError:  # a full report disk: the watcher's own write fails too, and the ranks then wait for the process
        pass
    return NodeWatcher(report_dir, process.pid, process)
