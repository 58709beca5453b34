"""One rank of the pytest plugin's pool (started by distcheck.testing.pool; not a user entry point).

It joins the process group once, then runs test bodies sent by the pytest process until told to stop.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client
from pathlib import Path

from distcheck.contract import env
from distcheck.testing import leftovers
from distcheck.testing.pool import PoolOutcome, TestJob


class RankContext:
    """What a distributed test body gets as its ``dist_ctx`` fixture."""

    def __init__(self, rank: int, world_size: int, backend: str, device):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device

    def mesh(self, shape=None, names=None):
        """A DeviceMesh over all ranks: ``dist_ctx.mesh((2,), ("dp",))``; default 1-D over the world."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(shape) if shape is not None else (self.world_size,)
        return init_device_mesh(self.device.type, shape, mesh_dim_names=tuple(names) if names else None)


def _load(job: TestJob):
    """The test function, from its module loaded with pytest's assertion rewriting (as pytest loads it), so a
    failing ``assert`` on a rank shows the values, not a bare AssertionError. Loaded once per module."""
    path = str(Path(job.path).resolve())
    module = sys.modules.get(job.module)
    if module is None or getattr(module, "__file__", None) != path:
        module = _import_rewritten(job.module, path)
    if job.cls:
        return getattr(getattr(module, job.cls)(), job.function)
    return getattr(module, job.function)


def _import_rewritten(name: str, path: str):
    import ast
    import types

    source = Path(path).read_bytes()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path)
    except Exception as exc:  # noqa: BLE001 - plain asserts still work, only without the values
        sys.stderr.write(f"[distcheck] assertion rewriting unavailable for {path}: {exc}\n")
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    return module


class ProcessState:
    """What one test may change in a rank process and the next test must not inherit: environment variables, the
    working directory, torch's global settings and RNG states. Taken before each test, restored after it."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.default_dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
        self.cudnn = (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
                      torch.backends.cudnn.benchmark)
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.threads = torch.get_num_threads()

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        torch.backends.cuda.matmul.allow_tf32 = self.matmul_tf32
        (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
         torch.backends.cudnn.benchmark) = self.cudnn
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        torch.set_num_threads(self.threads)


def _without_runner(frames: list) -> list:
    """A failing test's traceback from the test on: the outermost frames are this runner's (distcheck's), and the
    user's frames are what matter. Frames inside the test (torch's, a library's, distcheck's API) stay, as pytest
    shows them."""
    from distcheck.analysis.frame_owner import DISTCHECK, owner

    start = 0
    while start < len(frames) and owner(frames[start].filename) == DISTCHECK:
        start += 1
    return list(frames[start:]) if start < len(frames) else list(frames)


def _outcome(rank: int, exc: BaseException) -> PoolOutcome:
    name = type(exc).__name__
    if name in ("Skipped", "SkipTest"):
        return PoolOutcome(rank, "skipped", str(exc))
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list(_without_runner(tb.stack))
    return PoolOutcome(rank, "failed", "".join(tb.format()))


def _with_leftovers(result: PoolOutcome, watch, job: TestJob, backend: str) -> PoolOutcome:
    """The test fails when it left a thread, a child process or a pending collective on this rank (the processes
    are ended here); its pool is then retired. A rank whose test failed anyway is not asked about its collectives:
    those left pending are the failure's consequence."""
    # NCCL's synchronous collectives end in its own ring, which only the report's join reads: gloo's trace says it all.
    pending = (leftovers.pending_collectives(job.trace_dir, result.rank)
               if job.trace_dir and backend != "nccl" and result.status == "passed" else None)
    try:
        found = watch.find(pending)
    except Exception as exc:  # noqa: BLE001 - the check must never hide the test's own outcome
        sys.stderr.write(f"[distcheck rank {result.rank}] could not check what the test left: {exc}\n")
        return result
    if watch.left_pids:
        leftovers.end_processes(watch.left_pids)
        for item in found:
            if item.kind == leftovers.PROCESS:
                item.detail += ", ended now"
    if not found:
        return result
    text = leftovers.rank_text(found)
    return PoolOutcome(result.rank, "failed", f"{result.text.rstrip()}\n{text}" if result.text.strip() else text,
                       found)


def main() -> int:
    import torch
    import torch.distributed as dist

    from distcheck.rank import autocheck, group_keepalive, save_watch
    from distcheck.rank.error_context import explain

    from distcheck.rank import tracer as trace

    from distcheck.rank.stderr_tee import tee_stderr

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tee_stderr(os.environ[env.POOL_DIR], rank)  # a failing or hung test quotes its stderr
    faulthandler.enable(all_threads=True)  # a fatal signal prints the Python stack into that stderr
    stacks = open(Path(os.environ[env.POOL_DIR]) / f"stacks-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    host, port = os.environ[env.POOL_ADDR].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[env.POOL_AUTH]))
    conn.send(rank)
    backend = os.environ[env.POOL_BACKEND]
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=120))
    group_keepalive.install()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    conn.send("ready")
    ctx = RankContext(rank, world, backend, device)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        state = ProcessState()  # every test starts from the state the previous one started from
        # Each test's collectives are traced into its own directory: a failing test then shows the first
        # collective where the ranks diverged, and a hang each rank's last collective.
        tracer = trace.install(job.trace_dir, rank) if job.trace_dir else None
        # The same zero-code checks as `distcheck run` (models found by themselves, NaN/Inf, uninitialized values).
        checker = autocheck.install(job.trace_dir, rank, emit=True) if job.trace_dir else None
        if checker is not None:  # torch.save calls, for one file that several ranks write (rank/save_watch.py)
            save_watch.install(job.trace_dir, rank)
        watch = leftovers.Watch()  # threads, processes and collectives the test leaves behind
        try:
            fn = _load(job)
            kwargs = {k: (ctx if getattr(v, "_distcheck_placeholder", False) else v) for k, v in job.kwargs.items()}
            watch.start()
            fn(**kwargs)
            result = PoolOutcome(rank, "passed")
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, labelled with its rank
            result = _outcome(rank, exc)
            translated = explain(exc) if result.status == "failed" and isinstance(exc, Exception) else None
            if translated is not None:  # torch's text stays above; what it means, in the model's terms, below
                result = PoolOutcome(rank, "failed", f"{result.text.rstrip()}\n[distcheck] {translated['message']}")
        finally:
            watch.stop()
        if checker is not None:
            # A test whose asserts pass but whose model holds NaN or uncovered parameters fails, with the findings.
            try:
                found = autocheck.test_findings(checker, job.trace_dir)
            except Exception as exc:  # noqa: BLE001 - the test's own outcome must survive a failing check
                found = []
                sys.stderr.write(f"[distcheck rank {rank}] automatic checks failed: {exc}\n")
            autocheck.uninstall()
            if found and result.status in ("passed", "failed"):
                text = autocheck.failure_text(found)
                result = PoolOutcome(rank, "failed", f"{result.text.rstrip()}\n{text}" if result.text else text)
        if tracer is not None:
            tracer.note({"ev": "exit", "ok": result.status == "passed", "code": 0 if result.status == "passed" else 1})
        result = _with_leftovers(result, watch, job, backend)
        if tracer is not None:
            trace.uninstall()
        try:
            state.restore()
        except Exception as exc:  # noqa: BLE001 - a state that cannot be restored retires this pool
            result = PoolOutcome(rank, "failed", f"{result.text}\n[distcheck] the test left state this rank cannot "
                                 f"restore ({type(exc).__name__}: {exc}): the pool is retired".strip())
        fn = kwargs = None  # the test's objects die here, and then the groups it destroyed (see group_keepalive)
        group_keepalive.release()
        conn.send(result)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    group_keepalive.release()  # now, not during the interpreter's finalization
    return 0


if __name__ == "__main__":
    sys.exit(main())
