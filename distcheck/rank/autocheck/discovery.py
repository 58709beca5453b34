"""Model discovery and the first-forward check: find the models of an unmodified script, check each once.

    python -m distcheck run --nproc 2 -- train.py      # installed in every rank by rank/autocheck

Every module passed to fully_shard / DDP / parallelize_module / distribute_module, and every outermost FSDP1
``FullyShardedDataParallel`` (rank/autocheck/patches.py), gets a one-shot forward pre-hook, prepended so it runs
before FSDP's own (the parameters are still sharded). The first forward of a watched module checks its root (the
outermost watched module containing it) once: what ``check_model`` runs (placements, FSDP2/FSDP1/TP coverage,
meshes, replica consistency, all through the side channel, never the user's process group), plus a scan of every
parameter and buffer for values no initializer produces (``bad_values``). Its time goes to the report's ``model_check``.

A model is found by what happens to it, not only by how it is called: a watched model whose own forward never ran
before the first ``optimizer.step()`` (a step built on ``ddp_model.module(x)``, which goes around DDP's forward) is
checked at that step instead, before the update, so its replicas still get their baseline.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from distcheck.analysis.bad_values import FlaggedTensor, classify, plausible, tensor_stats, uninitialized_findings
from distcheck.contract.findings import Finding
from distcheck.contract.site import file_line
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site

log = logging.getLogger("distcheck")

# A fresh copy of a flagged module is initialized on the CPU to show what its own initializer gives; skip it for
# tensors so large that doing so would cost more than the whole check.
MAX_REFERENCE_NUMEL = 1 << 24


def outermost(modules: list[Any]) -> list[Any]:
    """The modules no other one of them contains (the models, not their blocks), in the given order."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def user_name(name: str) -> str:
    """A parameter's name as the user wrote it: DDP's ``module.`` prefix is not part of it, nor FSDP1's and
    activation checkpointing's wrapper modules (torch's own ``clean_tensor_name`` drops the same two)."""
    return name.removeprefix("module.").replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


@dataclass
class FirstForward:
    """A model's first forward, as the ``first_forward`` event hands it to the checks before the model check runs:
    what was found before parallelizing joins it (prewrap.py)."""

    root: Any
    site: Site  # the user's line of the forward (or of the first optimizer.step())
    before: list[Finding] = field(default_factory=list)  # found before parallelizing, reported with this check
    reported: set[str] = field(default_factory=set)  # tensors those findings name: not reported again
    identical_at: dict[str, Any] | None = None  # the last parallelizing call that found every rank identical


class ModelWatch(Check):
    """The models this rank parallelized, and their one check at the first forward."""

    name = "models"

    def __init__(self, core: Any) -> None:
        super().__init__(core)
        self._hooks: dict[int, Any] = {}  # id(watched module) -> its one-shot forward pre-hook
        self._global: Any = None  # the global forward pre-hook that finds the outermost model
        self._checked: list[weakref.ref] = []  # roots already checked
        self.checking = False
        self.model_checks: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []  # report.json "warnings" entries (mixed meshes in a correct model)
        self._stepped = False  # the first optimizer.step() came: models not checked by then are checked there

    def state(self) -> dict[str, Any] | None:
        if not self.model_checks and not self.warnings:
            return None
        return {"model_checks": self.model_checks, "warnings": self.warnings}

    def on_model_wrapped(self, module: Any, how: str) -> None:
        import torch.nn as nn

        if not isinstance(module, nn.Module):
            return
        if id(module) not in self._hooks:
            self._hooks[id(module)] = module.register_forward_pre_hook(
                functools.partial(_first_forward, weakref.ref(self)), prepend=True)
        if self._global is None and not self._checked:
            # The model to check is the outermost module whose forward runs the watched ones: with fully_shard on
            # the blocks only (the classic unwrapped root), no watched module holds the root's own parameters.
            # Global forward pre-hooks run before every module's own (FSDP2's unshard included); this one is
            # removed at the first forward, so the training loop never pays for it.
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._global = register_module_forward_pre_hook(functools.partial(_any_forward, weakref.ref(self)))

    def contains_watched(self, module: Any) -> bool:
        return any(id(m) in self._hooks for m in module.modules())

    def root_of(self, module: Any) -> Any:
        """The outermost watched module that contains ``module`` (itself when none does)."""
        root = module
        for other in self.core.models.alive():
            if other is not root and any(sub is root for sub in other.modules()):
                root = other
        return root

    def on_uninstalled(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        if self._global is not None:
            self._global.remove()
            self._global = None

    def on_optimizer_step(self, optimizer: Any, step: int) -> None:
        """The first optimizer.step() (its pre-hook: nothing updated yet): check every watched model whose own
        forward never ran, e.g. a DDP model whose training step calls ``model.module(x)``."""
        if self._stepped or self.checking:
            return
        self._stepped = True
        for root in outermost(self.core.models.alive()):
            if not self._is_checked(root):
                self.check_once(root, at="the first optimizer.step()")

    def _is_checked(self, module: Any) -> bool:
        for ref in self._checked:
            done = ref()
            if done is not None and any(sub is module for sub in done.modules()):
                return True
        return False

    def check_once(self, module: Any, at: str = "the first forward") -> None:
        if self.checking:
            return
        handle = self._hooks.get(id(module))
        if handle is not None:
            handle.remove()
        if self._global is not None:
            self._global.remove()
            self._global = None
        if self._is_checked(module):
            return
        root = self.root_of(module)
        self._checked.append(weakref.ref(root))
        self.checking = True
        started = time.perf_counter()
        found: list[Finding] = []
        try:
            found = self.check_root(root, at)
        except Exception as exc:  # a failing check must never break the user's training
            log.warning("distcheck: the automatic model check failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.checking = False
        seconds = time.perf_counter() - started
        label = _root_label(root) if at == "the first forward" else f"{_root_label(root)} (at {at})"
        self.model_checks.append({"root": label, "seconds": seconds, "findings": len(found)})
        self.core.fire("model_checked", root)  # the replicas' baseline, before any step could make them drift
        self.core.write_state()

    def check_root(self, root: Any, at: str = "the first forward") -> list[Finding]:
        import torch

        from distcheck.rank.checks.placement import check_model, describe_model
        from distcheck.rank import sink
        from distcheck.rank.runtime import current_channel
        from distcheck.rank.usersite import caller_site

        forward = caller_site()
        core = self.core
        with torch.no_grad():
            # What differed before parallelizing is one finding (its cause is the init); the first forward's own
            # comparison then covers the rest, and says where they became different when a wrap saw them equal.
            ctx = FirstForward(root, forward)
            core.fire("first_forward", ctx)
            before, reported, since = ctx.before, ctx.reported, ctx.identical_at
            core.keep(before)
            cause = ""
            if since is not None:
                label = {"ddp": "DistributedDataParallel's construction",
                         "fsdp1": "FullyShardedDataParallel's construction"}.get(since["how"], since["how"])
                cause = (f"They were identical at {label} at {_site_text(since['site'])} and differ at {at} at "
                         f"{forward}: something in between changed some ranks' copies (a checkpoint or state loaded "
                         f"on one rank only, an update under a rank condition).")
            findings = check_model(root, skip=reported, where=f"at {at} ({forward})", cause=cause,
                                   warnings=self.warnings)  # emits on rank 0 when a sink is set
            local = self._scan_values(root)
            # Source lines cost an inspect per parameter: only for what is flagged (normally nothing).
            rows = {r.name: r for r in describe_model(root)} if local else {}
            for f in local:
                row = rows.get(f.name)
                if row is not None:
                    f.file, f.line = row.file, row.line
            channel = current_channel()
            per_rank = {core.rank: local}
            if channel is not None:
                gathered = channel.exchange("autocheck/values", [f.to_json() for f in local])
                per_rank = {r: [FlaggedTensor.from_json(d) for d in g] for r, g in enumerate(gathered)}
            lead = min(per_rank)
            bad: list[Finding] = []
            if core.rank == lead:
                names = {f.name for items in per_rank.values() for f in items}
                refs = {name: _reference_range(root, name, rows.get(name)) for name in names}
                for items in per_rank.values():
                    for f in items:
                        f.init_range, f.init_source = refs[f.name]
                bad = uninitialized_findings(per_rank)
                if os.environ.get(sink.ENV_REPORT_DIR):
                    sink.emit(bad, core.rank)
        if core.rank == lead:
            # check_model and the lines above wrote them to the run's sink already: only the pool's file is left
            core.findings += findings + bad
            if core.keeps_file and (findings or bad):
                sink.append(core.out_dir, core.rank, findings + bad)
        return before + findings + bad

    def _scan_values(self, root: Any) -> list[FlaggedTensor]:
        out: list[FlaggedTensor] = []
        named = [(n, "parameter", p) for n, p in root.named_parameters()]
        named += [(n, "buffer", b) for n, b in root.named_buffers() if b is not None]
        for name, role, t in named:
            if not t.is_floating_point() or t.device.type == "meta" or plausible(t, role):
                continue
            stats = tensor_stats(t)
            dtype = str(t.dtype).removeprefix("torch.")
            reasons = classify(stats, dtype, role)
            if not reasons:
                continue
            module = name.rpartition(".")[0]
            out.append(FlaggedTensor(name, role, dtype, module, _class_label(_submodule(root, module)), stats,
                                     reasons))
        return out

def _first_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    watch = ref()
    if watch is not None and watch.core.active:
        watch.check_once(module)


def _any_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    watch = ref()
    if watch is None or not watch.core.active:
        return
    if not watch.checking and watch.contains_watched(module):
        watch.check_once(module)


def _site_text(site: list | None) -> str:
    return file_line(site[0], site[1]) or "?" if site else "?"


def _submodule(root: Any, fqn: str) -> Any:
    try:
        return root.get_submodule(fqn) if fqn else root
    except AttributeError:
        return root


def _user_class(module: Any) -> type:
    """The class the user wrote or picked (nn.Linear), not fully_shard's generated FSDPLinear or DDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    for klass in type(module).__mro__:
        if not (FSDPModule and issubclass(klass, FSDPModule)):
            return klass
    return type(module)


def _root_label(root: Any) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from distcheck.rank.checks.fsdp1 import is_fsdp1

    if isinstance(root, DistributedDataParallel):
        return f"DistributedDataParallel({_user_class(root.module).__name__})"
    if is_fsdp1(root):
        return f"FullyShardedDataParallel({_user_class(root.module).__name__})"
    return _user_class(root).__name__


def _class_label(module: Any) -> str:
    klass = _user_class(module)
    return f"nn.{klass.__name__}" if klass.__module__.startswith("torch.nn") else klass.__name__


def _reference_range(root: Any, name: str, row: Any) -> tuple[tuple[float, float] | None, str | None]:
    """What the owning module's own initializer gives for ``name``: (min, max) and which initializer.

    A fresh stand-in of the module's class gets plain CPU tensors of the global shapes and its own
    ``reset_parameters()`` (torch's layers and most user modules have one). The global RNG is forked so the
    user's random stream is untouched.
    """
    import torch

    module_name, _, attr = name.rpartition(".")
    owner = _submodule(root, module_name)
    klass = _user_class(owner)
    label = _class_label(owner)
    if not callable(getattr(klass, "reset_parameters", None)):
        return None, f"{label} defines no reset_parameters(), so nothing initializes it after to_empty()"
    shapes = {k: tuple(v.shape) for k, v in list(owner._parameters.items()) + list(owner._buffers.items())
              if v is not None}
    if sum(math.prod(s) for s in shapes.values()) > MAX_REFERENCE_NUMEL:
        return None, f"{label}.reset_parameters() not run for the comparison (too large)"
    try:
        fresh = klass.__new__(klass)
        state = dict(owner.__dict__)
        state["_parameters"] = {k: torch.nn.Parameter(torch.zeros(s), requires_grad=False)
                                for k, s in shapes.items() if k in owner._parameters}
        state["_buffers"] = {k: torch.zeros(s) for k, s in shapes.items() if k in owner._buffers}
        state["_modules"] = {}
        fresh.__dict__.update(state)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            klass.reset_parameters(fresh)
        value = fresh._parameters.get(attr, fresh._buffers.get(attr))
        if value is None or value.numel() == 0:
            return None, None
        return (float(value.min()), float(value.max())), f"{label}.reset_parameters()"
    except Exception as exc:  # a reset_parameters that needs more than the module's own tensors
        log.debug("reference init of %s failed: %s", name, exc)
        return None, f"{label}.reset_parameters() could not be run on a fresh copy for comparison"
