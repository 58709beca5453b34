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
from pathlib import Path
from typing import Any

from distcheck.analysis.bad_values import FlaggedTensor, classify, plausible, tensor_stats, uninitialized_findings
from distcheck.contract.findings import Finding
from distcheck.contract.site import file_line

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


class ModelWatch:
    """The models this rank parallelized, and their one check at the first forward."""

    def __init__(self, owner: Any, out_dir: Path, rank: int, emit: bool) -> None:
        self.owner = owner  # the AutoCheck: hooks act only while it is the active one
        self.out_dir = out_dir
        self.rank = rank
        # Under `distcheck run` check_model already writes its findings to the sink (DISTCHECK_REPORT_DIR); in the
        # pytest pool there is no sink, so this object keeps and writes them itself.
        self.emit_findings = emit
        self.watched: list[weakref.ref] = []
        self._hooks: dict[int, Any] = {}  # id(watched module) -> its one-shot forward pre-hook
        self._global: Any = None  # the global forward pre-hook that finds the outermost model
        self._checked: list[weakref.ref] = []  # roots already checked
        self.checking = False
        self.findings: list[Finding] = []
        self.model_checks: list[dict[str, Any]] = []
        self.backward_order: dict[str, int] = {}  # parameter name -> position in backward order
        self.on_watch: list[Any] = []  # callbacks run when a module is watched (names may change)
        self.warnings: list[dict[str, Any]] = []  # report.json "warnings" entries (mixed meshes in a correct model)
        self._stepped = False  # the first optimizer.step() came: models not checked by then are checked there

    def keep(self, found: list[Finding]) -> None:
        """Findings this rank reports for its group (the lead): to the run's sink, or the pytest pool's file."""
        from distcheck.rank import sink

        if not found:
            return
        self.findings += found
        if os.environ.get(sink.ENV_REPORT_DIR):
            sink.emit(found, self.rank)
        elif self.emit_findings:
            sink.append(self.out_dir, self.rank, found)

    def alive(self) -> list[Any]:
        return [m for m in (ref() for ref in self.watched) if m is not None]

    def watch(self, module: Any) -> None:
        import torch.nn as nn

        if not isinstance(module, nn.Module):
            return
        if id(module) not in self._hooks:
            self.watched.append(weakref.ref(module))
            self._hooks[id(module)] = module.register_forward_pre_hook(
                functools.partial(_first_forward, weakref.ref(self.owner)), prepend=True)
        if self._global is None and not self._checked:
            # The model to check is the outermost module whose forward runs the watched ones: with fully_shard on
            # the blocks only (the classic unwrapped root), no watched module holds the root's own parameters.
            # Global forward pre-hooks run before every module's own (FSDP2's unshard included); this one is
            # removed at the first forward, so the training loop never pays for it.
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._global = register_module_forward_pre_hook(functools.partial(_any_forward, weakref.ref(self.owner)))
        for callback in self.on_watch:
            callback()

    def contains_watched(self, module: Any) -> bool:
        return any(id(m) in self._hooks for m in module.modules())

    def root_of(self, module: Any) -> Any:
        """The outermost watched module that contains ``module`` (itself when none does)."""
        root = module
        for other in self.alive():
            if other is not root and any(sub is root for sub in other.modules()):
                root = other
        return root

    def stop(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        if self._global is not None:
            self._global.remove()
            self._global = None

    def on_first_step(self) -> None:
        """The first optimizer.step() (its pre-hook: nothing updated yet): check every watched model whose own
        forward never ran, e.g. a DDP model whose training step calls ``model.module(x)``."""
        if self._stepped or self.checking:
            return
        self._stepped = True
        for root in outermost(self.alive()):
            if not self._is_checked(root):
                self.on_first_forward(root, at="the first optimizer.step()")

    def _is_checked(self, module: Any) -> bool:
        for ref in self._checked:
            done = ref()
            if done is not None and any(sub is module for sub in done.modules()):
                return True
        return False

    def on_first_forward(self, module: Any, at: str = "the first forward") -> None:
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
        self._record_forward_order(root)
        self.owner.drift.on_first_forward()  # the replicas' baseline: before any step could make them drift
        self.owner.write_state()

    def check_root(self, root: Any, at: str = "the first forward") -> list[Finding]:
        import torch

        from distcheck.checks.placement import check_model, describe_model
        from distcheck.rank import sink
        from distcheck.rank.runtime import current_channel
        from distcheck.rank.usersite import caller_site

        forward = caller_site()
        self.owner.precision.note_module(root)  # a model found at its first forward: 16-bit parameters?
        prewrap = self.owner.prewrap
        with torch.no_grad():
            # What differed before parallelizing is one finding (its cause is the init); the first forward's own
            # comparison then covers the rest, and says where they became different when a wrap saw them equal.
            before, reported = prewrap.flush(root, forward)
            self.keep(before)
            since = prewrap.identical_before(root)
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
            per_rank = {self.rank: local}
            if channel is not None:
                gathered = channel.exchange("autocheck/values", [f.to_json() for f in local])
                per_rank = {r: [FlaggedTensor.from_json(d) for d in g] for r, g in enumerate(gathered)}
            lead = min(per_rank)
            bad: list[Finding] = []
            if self.rank == lead:
                names = {f.name for items in per_rank.values() for f in items}
                refs = {name: _reference_range(root, name, rows.get(name)) for name in names}
                for items in per_rank.values():
                    for f in items:
                        f.init_range, f.init_source = refs[f.name]
                bad = uninitialized_findings(per_rank)
                if os.environ.get(sink.ENV_REPORT_DIR):
                    sink.emit(bad, self.rank)
        if self.rank == lead:
            self.findings += findings + bad
            if self.emit_findings:
                if findings or bad:
                    sink.append(self.out_dir, self.rank, findings + bad)
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

    def _record_forward_order(self, root: Any) -> None:
        """Backward order of the parameters = the reverse of the order their modules first run forward in."""
        handles: list[Any] = []
        order: list[Any] = []
        seen: set[int] = set()

        def pre(module: Any, args: Any) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                order.append(module)

        def done(module: Any, args: Any, output: Any) -> None:
            for h in handles:
                h.remove()
            names = {id(p): n for n, p in root.named_parameters()}
            position = 0
            self.backward_order = {}
            for m in reversed(order):
                for p in reversed(list(m.parameters(recurse=False))):
                    name = names.get(id(p))
                    if name is not None and name not in self.backward_order:
                        self.backward_order[name] = position
                        position += 1

        for m in root.modules():
            handles.append(m.register_forward_pre_hook(pre))
        handles.append(root.register_forward_hook(done))


def _first_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    check = ref()
    if check is not None and check.active:
        check.models.on_first_forward(module)


def _any_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    check = ref()
    if check is None or not check.active:
        return
    if not check.models.checking and check.models.contains_watched(module):
        check.models.on_first_forward(module)


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

    from distcheck.checks.fsdp1 import is_fsdp1

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
