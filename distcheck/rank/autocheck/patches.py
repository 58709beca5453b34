"""The hooks behind the zero-code checks, installed once per process; they act only while a check is active.

    python -m distcheck run --nproc 2 -- train.py      # every rank installs them (DISTCHECK_AUTOCHECK=0: not)

The functions that parallelize a model are wrapped where users import them from:
``torch.distributed.fsdp.fully_shard`` (also reached as ``torch.distributed._composable.fsdp.fully_shard``),
``DistributedDataParallel.__init__`` (and its ``no_sync``), FSDP1's ``FullyShardedDataParallel.__init__``,
``torch.distributed.tensor.parallel.parallelize_module``, ``torch.distributed.tensor.distribute_module`` and
``distribute_tensor`` (which tensors a call scatters from rank 0, by ``src_data_rank``);
``torch.optim.Optimizer.__init__`` counts the optimizers, global optimizer step hooks and ``Tensor.backward`` mark
the steps. The parallelizing calls first compare the model across ranks (prewrap.py), before torch's own code;
``torch.manual_seed`` notes each rank's seed and ``FSDPModule.set_requires_gradient_sync`` its line;
``torch.autocast.__enter__``, fully_shard's ``mp_policy`` and ``DistributedDataParallel.register_comm_hook`` note
the precision the model computes in (precision.py); torch.distributed.checkpoint's planners and ``load`` feed the
partial-load and resume round-trip checks (dcp_roundtrip.py). The FSDP, DCP and DTensor modules cost seconds to
import, so they are patched when the script imports them (an import hook), not imported here. Every wrapper calls the
original untouched.

The hooks name no check: each fires an event on the active core (``check.fire(event, ...)``, the events of
rank/autocheck/protocol.py), and asks the core only what it shares: ``wrap_depth`` (a parallelizing call inside
another is its part: FSDP1's auto-wrapped units, parallelize_module's distribute_module calls) and
``inside_wrap()``, which counts one; the step hooks go through ``step_begins``/``step_ends``, which make one
training step of a nested optimizer.step().
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any, Callable

log = logging.getLogger("distcheck")


# The AutoCheck of this process while one is installed (distcheck.rank.autocheck.install sets it).
active: Any = None


def current() -> Any:
    return active


_patched = False


_warning_registry: dict = {}  # dedups re-emitted warnings per (text, category, line), as Python's "default" does


def as_user(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on the user's behalf: a warning it raises with a ``stacklevel`` meant for the user's call (torch's
    DDP FutureWarning, ...) would otherwise point at this wrapper; it is re-emitted at the user's line."""
    import warnings

    from distcheck.rank.usersite import caller_site, is_internal

    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return fn(*args, **kwargs)
    finally:  # outside the catching block, so the re-emitted warnings reach the user's filters
        site = caller_site()
        for w in caught:
            where = (site.file, site.line) if is_internal(w.filename) and site else (w.filename, w.lineno)
            warnings.warn_explicit(w.message, w.category, where[0], where[1], registry=_warning_registry)


def _mesh_ranks(mesh: Any) -> list[int] | None:
    """The ranks of a DeviceMesh (None: every rank, torch's default mesh)."""
    try:
        return [int(r) for r in mesh.mesh.flatten().tolist()] if mesh is not None else None
    except Exception:
        return None


def _compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else None


def _before(check: Any, how: str, args: tuple, kwargs: dict) -> None:
    """What a parallelizing call is about to do, before torch runs it: its plan, its precision, its module compared
    across the call's ranks (rank/autocheck/prewrap.py)."""
    try:
        modules = _arg(args, kwargs, 0, "module")
        ranks = _mesh_ranks(_arg(args, kwargs, 1, "mesh" if how == "fully_shard" else "device_mesh"))
        if how == "fully_shard":
            check.fire("mp_policy", kwargs.get("mp_policy"), "fully_shard MixedPrecisionPolicy")
            from distcheck.analysis.placement import FSDP_IGNORED

            for p in kwargs.get("ignored_params") or ():  # left out on purpose: not a coverage gap
                setattr(p, FSDP_IGNORED, True)
        if how == "parallelize_module":
            check.fire("plan", modules, _arg(args, kwargs, 2, "parallelize_plan"), ranks,
                       kwargs.get("src_data_rank", args[3] if len(args) > 3 else 0))
        for m in modules if isinstance(modules, (list, tuple)) else [modules]:
            check.fire("wrap_call", how, m, ranks, True)
    except Exception as exc:
        log.debug("distcheck: could not compare a model before %s: %s", how, exc)


def _watching(fn: Callable, pick: Callable[[tuple, dict, Any], Any], how: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check = current()
        outermost = False
        if check is not None:
            _before(check, how, args, kwargs)
            outermost = not check.wrap_depth
            if outermost:  # the parameters it may replace, while an optimizer exists (frozen_step.py)
                check.fire("wrap_begin", _arg(args, kwargs, 0, "module"))
            with check.inside_wrap():  # parallelize_module's own distribute_module calls are part of it
                result = as_user(fn, *args, **kwargs)
        else:
            result = as_user(fn, *args, **kwargs)
        check = current()
        if check is not None:
            try:
                target = pick(args, kwargs, result)
            except Exception as exc:
                log.debug("distcheck: could not watch a model: %s", exc)
                return result
            if outermost:
                from distcheck.rank.usersite import caller_site

                check.fire("wrap_end", f"{how}(...)", target, caller_site())
            for m in target if isinstance(target, (list, tuple)) else [target]:
                check.fire("model_wrapped", m, how)
        return result

    wrapper.__distcheck_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _replace(attr: str, original: Any, wrapper: Any, prefix: str) -> None:
    """Rebind ``attr`` in every loaded module under ``prefix`` that holds ``original`` (package re-exports)."""
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(prefix) and getattr(module, attr, None) is original:
            setattr(module, attr, wrapper)


def _patch_fsdp(_module: Any) -> None:
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard
    if hasattr(original, "__distcheck_original__"):
        return
    wrapper = _watching(original, lambda a, k, r: r if r is not None else a[0], "fully_shard")
    _replace("fully_shard", original, wrapper, "torch.distributed")
    sync = getattr(fsdp.FSDPModule, "set_requires_gradient_sync", None)
    if sync is not None and not hasattr(sync, "__distcheck_original__"):
        @functools.wraps(sync)
        def sync_wrapper(self: Any, requires_gradient_sync: bool, *args: Any, **kwargs: Any) -> Any:
            check = current()
            if check is not None:  # the line that turned FSDP2's reduce-scatter off, for a frozen model's cause
                check.fire("gradient_sync", bool(requires_gradient_sync))
            return sync(self, requires_gradient_sync, *args, **kwargs)

        sync_wrapper.__distcheck_original__ = sync  # type: ignore[attr-defined]
        fsdp.FSDPModule.set_requires_gradient_sync = sync_wrapper
    _patch_fsdp1(fsdp)


def fsdp1_prewrap(bound: dict[str, Any], world_size: int) -> tuple[list[int] | None, bool] | None:
    """What ``FullyShardedDataParallel(**bound)`` leaves per rank, by torch's own code (_init_utils.py, torch 2.13):
    (the ranks that must build the same module, None: every rank; whether its values count). None: the ranks are not
    known alike on every rank (HYBRID_SHARD's pair of groups not tiling the world), so nothing is compared.

    ``sync_module_states=True`` broadcasts rank 0's parameters and buffers before sharding (over the inter-node
    group, then the shard group under HYBRID_SHARD): only the structure counts before it, as before DDP's
    construction. With False (the default) each rank shards its own copy: its values must agree."""
    import torch.distributed as dist

    values = not bool(bound.get("sync_module_states", False))
    mesh, group = bound.get("device_mesh"), bound.get("process_group")
    if mesh is not None:
        return _mesh_ranks(mesh), values
    if group is None:
        return None, values
    if isinstance(group, (tuple, list)):  # HYBRID_SHARD's (shard group, replicate group)
        if len(group) == 2 and group[0].size() * group[1].size() == world_size:
            return None, values
        return None
    return sorted(dist.get_process_group_ranks(group)), values


def _patch_fsdp1(fsdp: Any) -> None:
    """FSDP1's ``FullyShardedDataParallel.__init__``: the outermost call (an auto-wrap policy constructs the inner
    units inside it) compares the module before torch shards it, then watches the wrapped model like DDP's."""
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    if cls is None or hasattr(cls.__init__, "__distcheck_original__"):
        return
    init = cls.__init__

    @functools.wraps(init)
    def fsdp1_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        check = current()
        if check is None or check.wrap_depth:  # no check, or an inner unit of the outer call
            as_user(init, self, *args, **kwargs)
            return
        try:
            import inspect

            import torch.distributed as dist

            bound = inspect.signature(init).bind(self, *args, **kwargs).arguments
            check.fire("mp_policy", bound.get("mixed_precision"), "FullyShardedDataParallel MixedPrecision")
            found = fsdp1_prewrap(bound, dist.get_world_size())
            if found is not None:
                check.fire("wrap_call", "fsdp1", bound.get("module"), found[0], found[1])
        except Exception as exc:
            log.debug("distcheck: could not compare a model before FullyShardedDataParallel: %s", exc)
        from distcheck.rank.checks.fsdp1 import WRAP_SITE
        from distcheck.rank.usersite import caller_site

        site = caller_site()
        check.fire("wrap_begin", _arg(args, kwargs, 0, "module"))
        with check.inside_wrap():
            as_user(init, self, *args, **kwargs)
        check = current()
        if check is None:
            return
        # FSDP1 moved the module's parameters into its flat parameter: optimizers built before hold the old ones
        check.fire("wrap_end", "FullyShardedDataParallel(...)", self, site)
        setattr(self, WRAP_SITE, [site.file, site.line])
        check.fire("model_wrapped", self, "fsdp1")  # its data-parallel ranks' first batches too (dp_inputs.py)

    fsdp1_wrapper.__distcheck_original__ = init  # type: ignore[attr-defined]
    cls.__init__ = fsdp1_wrapper
    cls.no_sync = _no_sync_wrapper(cls.no_sync)  # FSDP1's gradient accumulation, as DDP's


def _no_sync_wrapper(no_sync: Callable) -> Callable:
    """DDP's or FSDP1's ``no_sync()``: the line of the user's ``with model.no_sync():``, for the drift finding's
    cause (an FSDP1 root's no_sync enters its inner units' own: they are one, nested, and counted so)."""
    @functools.wraps(no_sync)
    @contextlib.contextmanager
    def no_sync_wrapper(self: Any) -> Any:
        check = current()
        if check is not None:
            check.fire("no_sync_enter")
        try:
            with no_sync(self):
                yield
        finally:
            if check is not None:
                check.fire("no_sync_exit")

    return no_sync_wrapper


def _patch_tensor(_module: Any) -> None:
    import torch.distributed.tensor as dt

    distribute = dt.distribute_tensor
    if not hasattr(distribute, "__distcheck_original__"):
        @functools.wraps(distribute)
        def distribute_wrapper(tensor: Any, device_mesh: Any = None, placements: Any = None, *args: Any,
                               **kwargs: Any) -> Any:
            check = current()
            if check is not None and not _compiling():
                # which tensors a style scatters from rank 0 (src_data_rank, default 0) and which it keeps
                check.fire("distribute_tensor", tensor, _mesh_ranks(device_mesh), placements,
                           kwargs.get("src_data_rank", 0))
            return distribute(tensor, device_mesh, placements, *args, **kwargs)

        distribute_wrapper.__distcheck_original__ = distribute  # type: ignore[attr-defined]
        # style.py and _api.py's distribute_module call it through their own module globals
        _replace("distribute_tensor", distribute, distribute_wrapper, "torch.distributed")

    original = dt.distribute_module
    if not hasattr(original, "__distcheck_original__"):
        _replace("distribute_module", original,
                 _watching(original, lambda a, k, r: r if r is not None else a[0], "distribute_module"),
                 "torch.distributed")


def _patch_dcp(module: Any) -> None:
    """torch.distributed.checkpoint: its planners and ``load`` (rank/autocheck/dcp_roundtrip.py)."""
    from distcheck.rank.autocheck.dcp_roundtrip import patch

    patch(module, _replace, current, as_user)


def _patch_tp(_module: Any) -> None:
    import torch.distributed.tensor.parallel as tp

    original = tp.parallelize_module
    if not hasattr(original, "__distcheck_original__"):
        _replace("parallelize_module", original,
                 _watching(original, lambda a, k, r: r if r is not None else a[0], "parallelize_module"),
                 "torch.distributed")


class _AfterLoader(importlib.abc.Loader):
    """Runs ``after(module)`` once the real loader has executed the module."""

    def __init__(self, inner: Any, after: Callable[[Any], None]) -> None:
        self.inner, self.after = inner, after

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            self.after(module)
        except Exception as exc:
            log.debug("distcheck: patching %s failed: %s", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, targets: dict[str, Callable[[Any], None]]) -> None:
        self.targets = targets
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.targets or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _AfterLoader(spec.loader, self.targets[fullname])
        return spec


def patch_once() -> None:
    """Install the wrappers (once per process): now for what is imported, on import for the rest."""
    global _patched
    if _patched:
        return
    _patched = True
    import torch
    from torch.nn.parallel import DistributedDataParallel

    targets = {"torch.distributed.fsdp": _patch_fsdp, "torch.distributed.tensor": _patch_tensor,
               "torch.distributed.tensor.parallel": _patch_tp, "torch.distributed.checkpoint": _patch_dcp}
    later = {}
    for name, patch in targets.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            later[name] = patch
    if later:
        sys.meta_path.insert(0, _PatchOnImport(later))

    ddp_init = DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def ddp_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        check = current()
        if check is not None:
            try:  # before DDP's construction broadcast copies rank 0's values over the others'
                import inspect

                import torch.distributed as dist

                bound = inspect.signature(ddp_init).bind(self, *args, **kwargs).arguments
                group, mesh = bound.get("process_group"), bound.get("device_mesh")
                ranks = _mesh_ranks(mesh) if mesh is not None else \
                    dist.get_process_group_ranks(group) if group is not None else None
                # init_sync (the default) broadcasts rank 0's values: only the structure must match before it
                check.fire("wrap_call", "ddp", bound.get("module"), ranks, not bound.get("init_sync", True))
            except Exception as exc:
                log.debug("distcheck: could not compare a model before DDP: %s", exc)
            with check.inside_wrap():
                as_user(ddp_init, self, *args, **kwargs)
        else:
            as_user(ddp_init, self, *args, **kwargs)
        check = current()
        if check is not None:  # found at construction; checked at its first forward or first step
            check.fire("model_wrapped", self, "ddp")

    DistributedDataParallel.__init__ = ddp_wrapper

    from torch.utils.data import DataLoader

    loader_init = DataLoader.__init__

    @functools.wraps(loader_init)
    def loader_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        loader_init(self, *args, **kwargs)
        check = current()
        if check is not None:  # where it was built and whether it splits the data by rank (dp_inputs.py)
            check.fire("loader_built", self)

    DataLoader.__init__ = loader_wrapper

    register_comm_hook = DistributedDataParallel.register_comm_hook

    @functools.wraps(register_comm_hook)
    def comm_hook_wrapper(self: Any, state: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
        check = current()
        if check is not None:  # a compression hook rounds the gradients: compare's tolerance follows it
            check.fire("comm_hook", hook)
        return register_comm_hook(self, state, hook, *args, **kwargs)

    DistributedDataParallel.register_comm_hook = comm_hook_wrapper

    from torch.amp.autocast_mode import autocast

    autocast_enter = autocast.__enter__

    @functools.wraps(autocast_enter)
    def autocast_enter_wrapper(self: Any) -> Any:
        check = current()
        if check is not None and not _compiling():  # the computation's precision, for compare's tolerance
            check.fire("autocast", self)
        return autocast_enter(self)

    autocast.__enter__ = autocast_enter_wrapper

    DistributedDataParallel.no_sync = _no_sync_wrapper(DistributedDataParallel.no_sync)

    opt_init = torch.optim.Optimizer.__init__

    @functools.wraps(opt_init)
    def opt_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        as_user(opt_init, self, *args, **kwargs)
        check = current()
        if check is not None:
            check.fire("optimizer_built", self)

    torch.optim.Optimizer.__init__ = opt_wrapper

    manual_seed = torch.random.manual_seed

    @functools.wraps(manual_seed)
    def seed_wrapper(seed: Any) -> Any:
        check = current()
        if check is not None:  # the seed each rank built its model with, for rank-seeded init's cause
            check.fire("seed_set", seed)
        return manual_seed(seed)

    torch.manual_seed = torch.random.manual_seed = seed_wrapper

    def step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        check = current()
        if check is not None:
            check.step_begins(optimizer)

    def step_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        check = current()
        if check is not None:
            check.step_ends(optimizer)

    # A Work waited for (or seen completed, or handed on as a future: a DDP comm hook returns it to DDP, which
    # waits for it) is no longer one the optimizer may race (async_work.py).
    Work = torch.distributed.Work if hasattr(torch.distributed, "Work") else None
    if Work is not None:
        work_wait, work_done, work_future = Work.wait, Work.is_completed, Work.get_future

        @functools.wraps(work_future)
        def future_wrapper(self: Any) -> Any:
            check = current()
            if check is not None:
                check.fire("work_waited", self)
            return work_future(self)

        @functools.wraps(work_wait)
        def wait_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = work_wait(self, *args, **kwargs)
            check = current()
            if check is not None:
                check.fire("work_waited", self)
            return result

        @functools.wraps(work_done)
        def done_wrapper(self: Any) -> Any:
            done = work_done(self)
            check = current()
            if done and check is not None:
                check.fire("work_waited", self)
            return done

        Work.wait, Work.is_completed, Work.get_future = wait_wrapper, done_wrapper, future_wrapper

    load_state_dict = torch.nn.Module.load_state_dict

    @functools.wraps(load_state_dict)
    def load_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = load_state_dict(self, *args, **kwargs)
        strict = _arg(args, kwargs, 1, "strict")
        check = current()
        if check is not None and strict is False:  # strict=True raised already on any mismatch
            from distcheck.rank.usersite import caller_site

            check.fire("load_state_dict", self, result, caller_site())
        return result

    torch.nn.Module.load_state_dict = load_wrapper

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(step_pre_hook)
    register_optimizer_step_post_hook(step_post_hook)

    backward = torch.Tensor.backward

    @functools.wraps(backward)
    def backward_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        check = current()
        if check is None:
            return backward(self, *args, **kwargs)
        check.fire("backward", self)
        result = backward(self, *args, **kwargs)
        check.fire("after_backward")
        return result

    torch.Tensor.backward = backward_wrapper
