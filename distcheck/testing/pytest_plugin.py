"""pytest plugin (registered through the ``pytest11`` entry point): the ``distributed`` marker.

    import pytest, torch, torch.distributed as dist

    @pytest.mark.distributed(nprocs=2, timeout=60)
    def test_all_reduce(dist_ctx):
        t = torch.ones(4, device=dist_ctx.device) * dist_ctx.rank
        dist.all_reduce(t)
        assert t[0].item() == sum(range(dist_ctx.world_size))

The body runs on every rank of a pool of live rank processes (gloo on CPU; nccl when CUDA has at least nprocs
devices, otherwise the test is skipped). ``dist_ctx`` gives rank, world_size, backend, device and ``mesh(shape,
names)``. Other fixtures are computed here, in the pytest process, and sent to the ranks (they must pickle).
A failure on any rank fails the test once, with each failing rank's traceback labelled by rank; a hang fails it
with every rank's stack. Works under pytest-xdist: each worker has its own pools, GPUs are handed out under a
file lock so two tests never share a device.
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import tempfile
from pathlib import Path

import pytest

from distcheck.contract import env, files

DEFAULT_NPROCS = 2
DEFAULT_TIMEOUT = 60.0

_pools: dict[int, object] = {}


class _Placeholder:
    """Stands in for dist_ctx in the pytest process; each rank replaces it with its real RankContext."""

    _distcheck_placeholder = True

    def __reduce__(self):
        return (_Placeholder, ())


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed(nprocs=2, timeout=60): run the test body on every rank with an initialized process group",
    )


@pytest.fixture
def dist_ctx():
    """Inside a @pytest.mark.distributed test: rank, world_size, backend, device, and mesh(shape, names)."""
    return _Placeholder()


def _marker_args(item) -> tuple[int, float]:
    marker = item.get_closest_marker("distributed")
    kwargs = dict(marker.kwargs)
    if marker.args:
        kwargs.setdefault("nprocs", marker.args[0])
    return int(kwargs.get("nprocs", DEFAULT_NPROCS)), float(kwargs.get("timeout", DEFAULT_TIMEOUT))


def _backend_for(nprocs: int) -> tuple[str, str]:
    """(backend, skip reason). nccl needs a device per rank; CPU-only machines use gloo."""
    forced = os.environ.get(env.BACKEND, "").lower()
    try:
        import torch

        cuda = torch.cuda.is_available() and forced != "gloo"
        count = torch.cuda.device_count() if cuda else 0
    except Exception:  # pragma: no cover - torch import problems surface in the test itself
        cuda, count = False, 0
    if not cuda:
        return "gloo", ""
    if count < nprocs:
        return "nccl", (f"distributed(nprocs={nprocs}) needs {nprocs} CUDA devices, this machine has {count} "
                        f"(set DISTCHECK_BACKEND=gloo to run it on the CPU)")
    return "nccl", ""


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("distributed") is None:
        return
    nprocs, _ = _marker_args(item)
    backend, reason = _backend_for(nprocs)
    if reason:
        pytest.skip(reason)


def _cache_dir() -> Path:
    # Shared by every xdist worker of this user: compiled-kernel caches and GPU lock files.
    path = Path(tempfile.gettempdir()) / f"distcheck-pytest-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


def _claim_gpus(nprocs: int) -> tuple[list[int], list]:
    """Take nprocs GPUs no other xdist worker holds (file locks in the shared cache dir)."""
    import torch
    from filelock import FileLock, Timeout

    locks, devices = [], []
    for index in range(torch.cuda.device_count()):
        lock = FileLock(str(_cache_dir() / f"gpu-{index}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        locks.append(lock)
        devices.append(index)
        if len(devices) == nprocs:
            return devices, locks
    for lock in locks:
        lock.release()
    raise RuntimeError(f"could not claim {nprocs} free GPUs: other test workers hold them")


def _get_pool(nprocs: int, backend: str):
    from distcheck.testing.pool import Pool

    pool = _pools.get(nprocs)
    if pool is not None and pool.healthy:
        return pool
    if pool is not None:
        _retire(pool)
        for lock in getattr(pool, "_gpu_locks", []):
            lock.release()
    devices, locks = _claim_gpus(nprocs) if backend == "nccl" else ([], [])
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache_dir() / "inductor"))
    pool = Pool(nprocs, backend, devices)
    pool._gpu_locks = locks
    pool.start(list(sys.path))
    _pools[nprocs] = pool
    return pool


_kept_dirs: list[str] = []  # work dirs of failed tests' pools: their traces back the failure messages until the end
KEEP_ENV = env.KEEP_POOL_DIRS


def _retire(pool) -> None:
    pool.close()
    if not pool.healthy and pool.workdir:
        _kept_dirs.append(pool.workdir)


@atexit.register
def _close_pools() -> None:
    import shutil

    for pool in list(_pools.values()):
        _retire(pool)
    _pools.clear()
    if os.environ.get(KEEP_ENV) != "1":  # temporary directories do not outlive the session
        for path in _kept_dirs:
            shutil.rmtree(path, ignore_errors=True)
        _kept_dirs.clear()


def pytest_unconfigure(config) -> None:
    _close_pools()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("distributed") is None:
        return None
    from distcheck.testing.pool import TestJob

    nprocs, timeout = _marker_args(pyfuncitem)
    backend, _ = _backend_for(nprocs)
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    try:
        pickle.dumps(kwargs)
    except Exception as exc:
        pytest.fail(f"distributed test arguments must pickle to reach the ranks: {exc}", pytrace=False)
    pool = _get_pool(nprocs, backend)
    job = TestJob(str(pyfuncitem.path), pyfuncitem.module.__name__,
                  pyfuncitem.cls.__name__ if pyfuncitem.cls else None, pyfuncitem.originalname, kwargs, timeout,
                  trace_dir=pool.job_dir())
    outcomes, hung, stop_reason = pool.run(job, should_stop=_stuck_check(job.trace_dir))
    diagnosis = _diagnose(pool, job, outcomes, hung, nprocs, timeout, stop_reason) if not all(
        o.status in ("passed", "skipped") for o in outcomes) else ""
    if not pool.healthy:
        _retire(pool)
        _pools.pop(nprocs, None)
    if all(o.status == "passed" for o in outcomes):
        return True
    if not hung and all(o.status in ("passed", "skipped") for o in outcomes):
        pytest.skip(next(o.text for o in outcomes if o.status == "skipped"))
    pytest.fail(diagnosis, pytrace=False)


def _stuck_check(trace_dir: str):
    """Whether the ranks provably cannot progress (from their traces), so a mismatch fails in seconds."""
    from distcheck.analysis.stop_rule import provably_stuck
    from distcheck.analysis.trace_events import load_traces

    def check(finished: set[int]) -> str | None:
        try:
            return provably_stuck(load_traces(trace_dir), finished)
        except Exception:  # a half-written trace: ask again next time
            return None

    return check


def _pipeline_cause(trace_dir: str) -> str:
    """Pipeline stages whose schedules disagree (the ranks' autocheck files, written before each step ran): the
    cause of the shape error or the hang that follows, named first. The ranks that got through publish it
    themselves (rank/autocheck test_findings); a stage stuck waiting for a microbatch never gets there."""
    from distcheck.analysis.check_table import judge
    from distcheck.contract import autocheck_file
    from distcheck.contract.findings import headline

    try:
        found = judge(autocheck_file.read_all(trace_dir), only=("pipeline",)).findings
    except Exception:  # an unreadable file must not hide the failure itself
        return ""
    return "\n".join(headline(f) for f in found)


def _diagnose(pool, job, outcomes, hung: bool, nprocs: int, timeout: float, stop_reason: str | None) -> str:
    """The failure text: the hang diagnosis (grouped stacks) or each failing rank's traceback, plus the first
    collective where the ranks' traces diverge. Runs while a hung pool is still alive, so its stacks are real."""
    from distcheck.analysis import rank_outcomes, trace_align
    from distcheck.analysis.trace_events import load_traces

    parts: list[str] = []
    stacks: dict[int, str] = {}
    cause = _pipeline_cause(job.trace_dir)
    if cause:
        parts.append(cause)
    if hung:
        try:
            from distcheck.supervise.hang import diagnose_hang

            [finding] = diagnose_hang(pool.pids, job.trace_dir, timeout=None if stop_reason else timeout,
                                      world_size=nprocs)
            head = f"cannot progress ({stop_reason})" if stop_reason else "hung"
            parts.append(f"distributed test {head}: {finding.message}")
            stacks_json = Path(job.trace_dir) / files.STACKS_JSON
            if stacks_json.exists():  # its structure, rendered here; stacks.txt keeps every thread uncollapsed
                from distcheck.supervise.stacks import summary_of_document

                parts.append(summary_of_document(stacks_json).rstrip())
        except Exception as exc:  # py-spy missing or not permitted: faulthandler stacks instead
            stuck = [o.rank for o in outcomes if o.status == "hung"]
            parts.append(f"distributed test hung: rank(s) {','.join(map(str, stuck))} did not finish within "
                         f"{timeout:g}s (world size {nprocs}); py-spy diagnosis unavailable ({exc})")
            stacks = pool.dump_stacks()
    left = {o.rank: o.leftovers for o in outcomes if getattr(o, "leftovers", None)}
    if left:  # what the test left behind, once for all the ranks that left it (testing/leftovers.py)
        from distcheck.testing.leftovers import headline

        parts.append(headline(left))
    for o in outcomes:
        if o.status in ("failed", "died"):
            parts.append(f"---------- [rank {o.rank}] ----------\n{o.text.rstrip()}")
    for o in outcomes:
        if o.status in ("died", "hung"):
            lines = pool.stderr_tail(o.rank)
            if lines:
                parts.append(f"---------- [rank {o.rank}] stderr (last {len(lines)} lines) ----------\n"
                             + "\n".join(lines))
    for rank, text in sorted(stacks.items()):
        parts.append(f"---------- [rank {rank}] stack (faulthandler) ----------\n{text.rstrip()}")
    state = {"passed": rank_outcomes.STATE_OK, "skipped": rank_outcomes.STATE_OK, "failed": rank_outcomes.STATE_ERROR,
             "died": rank_outcomes.STATE_DIED, "hung": rank_outcomes.STATE_HUNG}
    try:
        traces = load_traces(job.trace_dir)
        ranks = {o.rank: rank_outcomes.RankOutcome(o.rank, state[o.status]) for o in outcomes}
        divergences = [f for f in trace_align.analyze_run(traces, ranks, nprocs, timeout=timeout)
                       if f.kind == "collective_mismatch"]
    except Exception as exc:  # a trace the analysis cannot read must not hide the failure itself
        divergences = []
        parts.append(f"(collective traces unreadable: {exc})")
    if divergences:
        parts.append("---------- collective traces ----------\nfirst divergence: " + divergences[0].message +
                     f"\n(per-rank traces: {job.trace_dir}, removed when the session ends unless {KEEP_ENV}=1)")
    return "\n".join(parts)
