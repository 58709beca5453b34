"""What a rank runs for ``distcheck run``: the user's script as ``__main__``, traced and checked.

    python -m distcheck run --nproc 2 -- train.py                # the launcher starts each rank with this
    torchrun --nproc-per-node 2 -m distcheck run -- train.py     # every rank runs this under torchrun

Each rank installs the tracer, the zero-code checks and the stack hooks, runs SCRIPT (sys.argv = [SCRIPT,
ARGS...]), records an exception with the user's line in its trace, and writes its exit line. Supervised ranks
end there. Under torchrun a failed rank exits at once with its own code, and the ranks only write files: each
node's watcher (a process outside the ranks, started by local rank 0) watches them, and the watcher of global
rank 0's node writes the report (from the other nodes' summaries too); local rank 0 waits for its node's watcher
after its script and exits with the verdict.
"""
from __future__ import annotations

import logging
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from distcheck.contract import files
from distcheck.contract.report import default_report_dir, prepare_report_dir
from distcheck.options import ENV_SUPERVISED, RunOptions
from distcheck.rank import sink
from distcheck.rank.bootstrap import NodeWatcher, rank_bootstrap
from distcheck.rank.error_context import error_context
from distcheck.rank.stack_hooks import remove_rank_hooks
from distcheck.rank.usersite import traceback_site
from distcheck.rank.runtime import end_rank, hard_exit
from distcheck.processes import agent_pid, restart_count, start_ticks

log = logging.getLogger("distcheck")


def run_in_rank(opts: RunOptions) -> int:
    """Run the script in this rank, traced and checked; under torchrun local rank 0 also starts its node's watcher
    and waits for it after its script."""
    from distcheck.rank import tracer as trace
    from distcheck.rank.runtime import RankInfo, setup_logging

    from distcheck.rank.store_host import ENV_STORE_FDS, host_if_asked

    hosting = ENV_STORE_FDS in os.environ
    host_if_asked()  # first: it forks, and nothing may have started a thread yet
    if hosting:  # the store host outlives this rank (until the launcher's run ends): not one of the script's
        from distcheck.rank.runtime import keep_process
        from distcheck.processes import children_map

        for pid in children_map().get(os.getpid(), []):
            keep_process(pid)
    info = RankInfo.from_env()
    setup_logging(info)
    supervised = os.environ.get(ENV_SUPERVISED) == "1"
    report_dir = Path(opts.report_dir) if opts.report_dir else _torchrun_default_dir()
    report_dir = prepare_report_dir(report_dir).resolve()
    if not supervised:  # several nodes: global rank 0 forks the exchange's store now, while single-threaded
        from distcheck.rank.exchange_host import fork_if_node0

        fork_if_node0(report_dir)
    os.environ[sink.ENV_REPORT_DIR] = str(report_dir)
    if not supervised:
        start_attempt(report_dir, info.rank)
    # Stack hooks (ptrace permission for our launcher, faulthandler fallback); under plain torchrun also the node
    # watcher, a process outside the ranks that dumps their stacks on a hang even when one holds the GIL, and
    # writes the report once every rank has ended (on several nodes: node 0's watcher); the ranks only write files.
    # Before the tracer, the sampler and the zero-code checks: a rank that fails at once gets local rank 0 stopped
    # by torchrun, and had it not started the watcher yet, that attempt went unwatched and a restart's local rank 0
    # started the agent's watcher in its stead (1 clean-clone suite run in 4, 2 in 24 of a restart test under load).
    watcher = rank_bootstrap(report_dir, opts.timeout, native=opts.native, trace=False, watcher=not supervised,
                             stop_dumps=not supervised, command=opts.command)
    tracer = trace.install(report_dir, info.rank)
    from distcheck.rank import sampler

    sampler.install(report_dir, info.rank)  # where the main thread is, for a late rank's time (analysis/stragglers)
    from distcheck.rank import autocheck
    from distcheck.rank.autocheck.replica_drift import ENV_DRIFT_STEPS

    os.environ[ENV_DRIFT_STEPS] = str(opts.drift_steps)  # run --steps K, for rank/autocheck/replica_drift.py
    # Finds the models (fully_shard/DDP/TP) and optimizers by itself; DISTCHECK_AUTOCHECK=0 turns it off.
    checker = autocheck.install(report_dir, info.rank)
    if autocheck.enabled():  # each torch.save to a named file, for several ranks writing one (analysis/shared_files)
        from distcheck.rank import save_watch

        save_watch.install(report_dir, info.rank)
    if not supervised and info.rank == 0 and restart_count() == 0:  # a restart moved them to the attempt's folder
        files.clear_shared(report_dir)
    refuse_self_launch(opts.script)
    if not supervised:
        wait_for_exchange(report_dir)
    ok, code = _execute(opts.script, list(opts.script_args), tracer)
    if checker is not None:
        checker.finish()  # before the exit line: rank 0 reads every rank's autocheck file once all have exited
    sampler.flush()
    tracer.note({"ev": "exit", "ok": ok, "code": code})

    def end(code: int, returned: bool) -> None:
        # The stop-signal dump files stay until the very end: torchrun may still stop this rank while it waits.
        remove_rank_hooks(report_dir, info.rank)
        end_rank(code) if returned else hard_exit(code)

    # A rank whose script returned ends through end_rank (everything is flushed): torch's own interpreter teardown
    # (gloo threads destroyed while joinable: "terminate called without an active exception", SIGABRT) would
    # otherwise turn a correct script into a dead rank. A failed one ends through hard_exit, skipping its atexit
    # handlers too, which may wait on dead peers.
    if supervised or not ok:
        # Under torchrun a failed rank exits at once with its own code, as it would without distcheck: torchrun's
        # agent ends the others (their stop dumps say where they were) and the node watcher writes the report.
        # On several nodes it first waits (bounded) until its node's own report holds its failure: torchrun may
        # return, and a CI step or Slurm kill the watcher, as soon as this process exits.
        if not supervised and not ok:
            wait_until_covered(report_dir, info.rank)
        end(0 if ok else code or 1, returned=ok)
    if watcher is not None:
        # Local rank 0 waits for its node's watcher, so that the report exists when torchrun returns, and exits
        # with its verdict (torchrun's exit code then follows the report). The watcher ends once every rank's
        # script has ended (on several nodes: once node 0 published the report).
        end(_report_verdict(watcher, report_dir, opts.timeout, info.rank == 0), returned=True)
    end(0, returned=True)
    return 0  # not reached


# Seconds a failed rank on one node of several waits for its node's report (~0.2 s) and, early in a job, for the
# exchange store node 0's watcher starts (its `import torch`: 1.5 to 4 s) to be in place on every node.
NODE_REPORT_WAIT = 6.0
# Seconds a rank on one node of several waits, before its script, for the nodes' exchange to be in place: a little
# more than the watchers' own limit (supervise/node_exchange.EXCHANGE_GIVE_UP, 20 s), after which they say so.
EXCHANGE_WAIT = 22.0
# Seconds a stopped rank waits for the watcher to publish the report rank 0 handed it (a report of a few KiB: well
# under a second, unless the machine is loaded).
HANDED_REPORT_WAIT = 5.0
# Seconds to wait for a watcher that is not up at all (local rank 0 starts it; it may have failed to).
WATCHER_START_WAIT = 10.0


def _several_nodes() -> bool:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return False


def wait_for_exchange(report_dir: Path, limit: float = EXCHANGE_WAIT) -> bool:
    """On one node of several, before the script: wait until the node watchers have found node 0's exchange store
    (contract/watcher_file.WatcherState.exchange_attempt). A rank that gloo aborts at its first collective (a shape
    that differs across nodes: SIGABRT, no Python runs after it) ends its torchrun, and the rendezvous store with
    it, within a second; a watcher still importing then never found the exchange, and its node's part never
    reached the report. The watchers start with the ranks and need less than the ranks' own imports, so this
    mostly costs nothing. At once on one node."""
    if not _several_nodes():
        return False
    attempt = restart_count()
    return _wait_for_watcher(report_dir, limit, lambda state: state.exchange_attempt >= attempt,
                             f"the nodes' exchange was not in place within {limit:.0f}s")


def wait_until_covered(report_dir: Path, rank: int, limit: float = NODE_REPORT_WAIT) -> bool:
    """On one node of several, wait until the node watcher's own report of this node holds this rank's end
    (contract/watcher_file.WatcherState.covers); at once on one node, or without a live watcher."""
    if not _several_nodes():
        return False
    attempt = restart_count()
    return _wait_for_watcher(report_dir, limit, lambda state: state.covers(attempt, rank),
                             f"this node's report did not hold rank {rank}'s failure within {limit:.0f}s")


def wait_for_handed_report(report_dir: Path, limit: float = HANDED_REPORT_WAIT) -> bool:
    """A rank that torchrun stops after rank 0 died (consistency): wait until the report rank 0 handed this node's
    watcher before it died (contract/report_handoff.py) is published. torchrun returns once this rank has
    ended, and a CI step or Slurm then kills the watcher: the report must be out by then. At once when no offer
    waits (rank 0 on another node, or it published already)."""
    from distcheck.contract import report_handoff

    if not report_handoff.pending(report_dir):
        return True
    return _wait_for_watcher(report_dir, limit, lambda state: not report_handoff.pending(report_dir),
                             f"the report rank 0 handed over was not published within {limit:.0f}s")


def _wait_for_watcher(report_dir: Path, limit: float, done, late: str) -> bool:
    """Poll this node's live watcher's state until ``done(state)``, at most ``limit`` seconds. A watcher not up yet
    (local rank 0 started it with this attempt; its imports take seconds on a loaded machine) is waited for, at most
    WATCHER_START_WAIT seconds; one that was up and is gone will not do it: False at once."""
    from distcheck.rank.bootstrap import live_watcher

    started = time.monotonic()
    deadline = started + limit
    seen = False
    while time.monotonic() < deadline:
        state = live_watcher(report_dir)
        if state is None:
            if seen or time.monotonic() - started >= WATCHER_START_WAIT:
                return False
            time.sleep(0.02)
            continue
        seen = True
        if done(state):
            return True
        time.sleep(0.02)
    log.warning("distcheck: %s", late)
    return False


def start_attempt(report_dir: Path, rank: int) -> None:
    """This rank's files start afresh. After a torchrun restart the earlier attempt's files go to ``attempt-<N>/``
    (each rank moves its own, local rank 0 the shared report), once the node watcher is done with the earlier
    attempt (contract/watcher_file.py): it may still be writing that attempt's report from them."""
    attempt = restart_count()
    if attempt == 0:
        files.remove_rank_files(report_dir, [rank])
        return
    from distcheck.rank.bootstrap import live_watcher

    deadline = time.monotonic() + 60.0  # it is writing a report from files that are all there: seconds
    while time.monotonic() < deadline:
        state = live_watcher(report_dir)
        if state is None or state.done_with(attempt - 1):
            break
        time.sleep(0.05)
    dest = report_dir / files.ATTEMPT_DIR.format(attempt=attempt - 1)
    files.archive_rank_files(report_dir, rank, dest)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        files.archive_shared(report_dir, dest)


def _report_verdict(watcher: NodeWatcher, report_dir: Path, timeout: float, has_report: bool) -> int:
    """Wait (bounded) until the node watcher is done with this attempt; on the node of rank 0 (``has_report``) the
    report's exit code, on another node the watcher's (0, unless it diagnosed a hang or a stop itself)."""
    from distcheck.contract.report import load_report

    code = watcher.outcome(restart_count(), timeout + 60)
    if code is None:
        log.warning("distcheck: the node watcher did not write the report within %.0fs", timeout + 60)
        return 1
    if not has_report:
        return 0 if code == 0 else 1
    try:
        return load_report(report_dir).exit_code  # the report file's one reader
    except Exception:  # none, or not a report: the run did not pass
        return 1


class SelfLaunchError(RuntimeError):
    """A script under ``distcheck run`` that starts its own ranks (torch.multiprocessing.spawn)."""


def refuse_self_launch(script: Path) -> None:
    """Make ``torch.multiprocessing.spawn`` / ``start_processes`` raise one line that says what to do instead.

        python -m distcheck run --nproc 2 -- train_spawn.py    # train_spawn.py calls mp.spawn(main, nprocs=2)

    distcheck already started this rank; a script that spawns its own ranks from it starts a second job of
    ranks × nprocs processes that inherit this rank's rendezvous variables (RANK, MASTER_PORT,
    TORCHELASTIC_USE_AGENT_STORE), retry a store that is not theirs for up to 30 minutes, and leave every rank
    waiting in ``spawn``: a hang that names ``<module>``. Refused at the call instead, before any process starts:
    "train_spawn.py starts its own ranks with torch.multiprocessing.spawn(nprocs=2), but distcheck already started
    them: run it with plain python, or drop mp.spawn and use --nproc 2" (at the user's mp.spawn line). A script
    that starts its own process group some other way is named at the hang (analysis/hang.self_launch_hint).
    """
    try:
        import torch.multiprocessing as tmp
    except Exception:  # no torch: no torch.multiprocessing to refuse
        return
    spawn_module = sys.modules.get("torch.multiprocessing.spawn")

    def refusing(name: str):
        def refuse(*args, **kwargs):
            nprocs = kwargs.get("nprocs", args[2] if len(args) > 2 else 1)
            # One line, short enough to be quoted whole in the rank_failure finding (200 characters).
            raise SelfLaunchError(
                f"{script.name} starts its own ranks with torch.multiprocessing.{name}(nprocs={nprocs}), but "
                f"distcheck already started them: run it with plain python, or drop mp.spawn and use "
                f"--nproc {nprocs}")

        refuse.__name__ = refuse.__qualname__ = name
        refuse.distcheck_refuses = True  # type: ignore[attr-defined]
        return refuse

    for name in ("spawn", "start_processes"):
        original = getattr(tmp, name, None)
        if original is None or getattr(original, "distcheck_refuses", False):
            continue
        patched = refusing(name)
        setattr(tmp, name, patched)
        if spawn_module is not None and getattr(spawn_module, name, None) is original:
            setattr(spawn_module, name, patched)


def _torchrun_default_dir() -> Path:
    """All local ranks must agree on the default directory: stamp it with the start time of their common parent
    (torchrun's agent), not each rank's own clock."""
    agent = agent_pid()
    ticks = start_ticks(agent)
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        btime = None
    if ticks is not None and btime is not None:
        return default_report_dir(btime + ticks / os.sysconf("SC_CLK_TCK"), suffix=agent)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return Path.cwd() / f"distcheck-report-{run_id}"


def _execute(script: Path, script_args: list[str], tracer) -> tuple[bool, int]:
    """Run the script as __main__; record an exception (with the user's line) in the trace. (ok, exit code)"""
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
        return True, 0
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return True, 0
        exc_info = (type(exc), exc, exc.__traceback__)
        status = code if isinstance(code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure of the script is a finding
        exc_info = (type(exc), exc, exc.__traceback__)
        status = 1
    text = "".join(traceback.format_exception(*exc_info))
    _report_mesh_error(exc_info[1], tracer.rank)
    sys.stderr.write(f"[distcheck rank {tracer.rank}] the script raised:\n{text}")
    sys.stderr.flush()
    where = traceback_site(exc_info[2])
    record = {"ev": "error", "exc_type": exc_info[0].__name__, "message": str(exc_info[1]), "traceback": text,
              "site": where.site, "file": where.file, "line": where.line}
    context = error_context(exc_info[0].__name__, str(exc_info[1]), script=script)
    if context is not None:
        record["context"] = context
    tracer.note(record)
    return False, status


def _report_mesh_error(exc: BaseException, rank: int) -> None:
    """A torch error from building a DeviceMesh is a mesh_mismatch (with the user's line), not just a crash."""
    try:
        from distcheck.rank.checks.mesh import mesh_error_finding

        finding = mesh_error_finding(exc, exc.__traceback__)
    except Exception as err:  # the diagnosis must never hide the script's own error
        log.debug("mesh error check failed: %s", err)
        return
    if finding is not None:
        sink.emit([finding], rank)
