"""Zero-code checks: find the models of an unmodified script by itself, check them once, and catch bad values.

    python -m distcheck run --nproc 2 -- train.py          # installed in every rank; DISTCHECK_AUTOCHECK=0 turns it off
    pytest -n 2 tests/                                       # the distributed marker installs it per test

Discovery. The functions that parallelize a model are wrapped where users import them from:
``torch.distributed.fsdp.fully_shard`` (also reached as ``torch.distributed._composable.fsdp.fully_shard``),
``DistributedDataParallel.__init__``, ``torch.distributed.tensor.parallel.parallelize_module`` and
``torch.distributed.tensor.distribute_module``; ``torch.optim.Optimizer.__init__`` records the optimizers. The FSDP
and DTensor modules cost seconds to import, so they are patched when the script imports them (an import hook),
not imported here. The wrappers are installed once per process and call the original untouched; they only note
the module when a check is active (a ``distcheck run`` rank, or a test of the pytest marker's pool).

First forward. Every watched module gets a one-shot forward pre-hook, prepended so it runs before FSDP2's own
(the parameters are still sharded DTensors). The first forward of a watched module checks its root (the outermost
watched module containing it) once: what ``check_model`` runs (placements, FSDP2/TP coverage, meshes, replica
consistency, all through the side channel, never the user's process group), plus a scan of every parameter and
buffer for values no initializer produces (``bad_values``). Its time goes to the report's ``model_check``.

Steps. Each ``optimizer.step()`` (a global step pre-hook) checks that step's losses (the scalars passed to
``backward()``) and gradients for NaN/Inf: one ``torch._foreach_norm`` over the local gradients and one host read
per step (on CUDA the read is a non-blocking copy checked at a later step, so there is no added sync). Only the
rank's first bad step is kept, written to ``autocheck-rank<R>.json``; ``build_report`` merges the ranks' events,
so no cross-rank traffic is needed per step.

Automatic records (zero-code compare). Under ``distcheck compare`` (DISTCHECK_AUTO_RECORD_STEPS=K in the ranks'
environment) the first K steps also record, marked automatic: the loss passed to ``backward()`` as ``auto/loss``
at the user's ``backward()`` line (each rank's own value: the analysis averages them over the ranks, so the
training loop waits for no other rank), and after each ``optimizer.step()`` (a global step post-hook) every
parameter that optimizer updates as ``auto/params`` at the user's ``step()`` line, gathered to full tensors (a
collective on the user's process group, which every rank reaches at the same step). Parameters are named from the
outermost modules whose forward ran before the first step (a global forward pre-hook, removed at that step), so
the names agree with or without DDP/FSDP wrappers.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import logging
import math
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from distcheck.analysis.bad_values import (BadEvent, FlaggedTensor, classify, first_bad_finding, loss_value_name,
                                           plausible, tensor_stats, uninitialized_findings)
from distcheck.contract import files
from distcheck.contract.findings import CheckResult, Finding
from distcheck.rank.usersite import caller_site

log = logging.getLogger("distcheck")

ENV_AUTOCHECK = "DISTCHECK_AUTOCHECK"
# A fresh copy of a flagged module is initialized on the CPU to show what its own initializer gives; skip it for
# tensors so large that doing so would cost more than the whole check.
MAX_REFERENCE_NUMEL = 1 << 24


def enabled() -> bool:
    return os.environ.get(ENV_AUTOCHECK, "1").strip().lower() not in ("0", "false", "no", "off")


def state_path(out_dir: str | os.PathLike, rank: int) -> Path:
    return files.rank_file(out_dir, "autocheck", rank)


# -- the active check of this process ----------------------------------------------------------------------------

_active: AutoCheck | None = None


def current() -> AutoCheck | None:
    return _active


class AutoCheck:
    """The zero-code checks of one run (or one pytest test) in this rank."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, emit: bool) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        # Under `distcheck run` check_model already writes its findings to the sink (DISTCHECK_REPORT_DIR); in the
        # pytest pool there is no sink, so this object keeps and writes them itself.
        self.emit_findings = emit
        self.watched: list[weakref.ref] = []
        self._hooks: dict[int, Any] = {}  # id(watched module) -> its one-shot forward pre-hook
        self._global: Any = None  # the global forward pre-hook that finds the outermost model
        self._checked: list[weakref.ref] = []  # roots already checked
        self._checking = False
        self.findings: list[Finding] = []
        self.model_checks: list[dict[str, Any]] = []
        self.opt_steps: dict[int, int] = {}
        self.backwards = 0
        self.optimizers = 0
        self.first_bad: BadEvent | None = None
        self.step_seconds = 0.0  # time spent in the per-step checks
        self._losses: list[tuple[Any, Any]] = []  # (0-d loss tensor, site) since the last step check
        self._pending: list[tuple[int, str, Any, list[str], Any, Any, Any]] = []  # CUDA reads not yet done
        self._names: dict[int, str] = {}  # id(parameter) -> name, for the gradient check
        self._order: dict[str, int] = {}  # parameter name -> position in backward order
        # Zero-code compare: K steps to record by itself (0 outside compare, so `run` pays nothing for it).
        self.record_steps = _auto_record_steps()
        self.auto_records = 0
        self._called: dict[int, weakref.ref] = {}  # modules whose forward ran before the first step
        self._naming: Any = None
        if self.record_steps:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._naming = register_module_forward_pre_hook(functools.partial(_note_call, weakref.ref(self)))

    # -- discovery ------------------------------------------------------------------------------------------------
    def watch(self, module: Any) -> None:
        import torch.nn as nn

        if not isinstance(module, nn.Module):
            return
        if id(module) not in self._hooks:
            self.watched.append(weakref.ref(module))
            self._hooks[id(module)] = module.register_forward_pre_hook(
                functools.partial(_first_forward, weakref.ref(self)), prepend=True)
        if self._global is None and not self._checked:
            # The model to check is the outermost module whose forward runs the watched ones: with fully_shard on
            # the blocks only (the classic unwrapped root), no watched module holds the root's own parameters.
            # Global forward pre-hooks run before every module's own (FSDP2's unshard included); this one is
            # removed at the first forward, so the training loop never pays for it.
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._global = register_module_forward_pre_hook(functools.partial(_any_forward, weakref.ref(self)))
        self._names.clear()  # parameters may have been replaced (fully_shard swaps them for DTensors)

    def _alive(self) -> list[Any]:
        return [m for m in (ref() for ref in self.watched) if m is not None]

    def contains_watched(self, module: Any) -> bool:
        return any(id(m) in self._hooks for m in module.modules())

    def root_of(self, module: Any) -> Any:
        """The outermost watched module that contains ``module`` (itself when none does)."""
        root = module
        for other in self._alive():
            if other is not root and any(sub is root for sub in other.modules()):
                root = other
        return root

    def stop_watching(self) -> None:
        self._stop_naming()
        for handle in self._hooks.values():
            handle.remove()
        if self._global is not None:
            self._global.remove()
            self._global = None

    def on_first_forward(self, module: Any) -> None:
        if self._checking:
            return
        handle = self._hooks.get(id(module))
        if handle is not None:
            handle.remove()
        if self._global is not None:
            self._global.remove()
            self._global = None
        for ref in self._checked:
            done = ref()
            if done is not None and any(sub is module for sub in done.modules()):
                return
        root = self.root_of(module)
        self._checked.append(weakref.ref(root))
        self._checking = True
        started = time.perf_counter()
        found: list[Finding] = []
        try:
            found = self.check_root(root)
        except Exception as exc:  # a failing check must never break the user's training
            log.warning("distcheck: the automatic model check failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._checking = False
        seconds = time.perf_counter() - started
        self.model_checks.append({"root": _root_label(root), "seconds": seconds, "findings": len(found)})
        self._record_forward_order(root)
        self.write_state()

    def check_root(self, root: Any) -> list[Finding]:
        import torch

        from distcheck.rank import sink
        from distcheck.checks.placement import check_model, describe_model
        from distcheck.rank.runtime import current_channel

        with torch.no_grad():
            findings = check_model(root)  # emits on rank 0 when a sink is set
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
                _append_findings(self.out_dir, self.rank, findings + bad)
        return findings + bad

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
            self._order = {}
            for m in reversed(order):
                for p in reversed(list(m.parameters(recurse=False))):
                    name = names.get(id(p))
                    if name is not None and name not in self._order:
                        self._order[name] = position
                        position += 1

        for m in root.modules():
            handles.append(m.register_forward_pre_hook(pre))
        handles.append(root.register_forward_hook(done))

    # -- steps ----------------------------------------------------------------------------------------------------
    def on_backward(self, loss: Any) -> None:
        self.backwards += 1
        if self.record_steps:
            self._record_loss(loss)
            if not self.optimizers and self.backwards > self.record_steps:
                self._stop_naming()  # names serve only the parameter records of optimizer steps
        if self.first_bad is not None or loss.numel() != 1 or not loss.is_floating_point():
            return
        site = caller_site()
        self._losses.append((loss.detach().reshape(()), site))

    def after_backward(self) -> None:
        """Without an optimizer, a step is a backward() call: check right after it."""
        if self.optimizers == 0 and self.first_bad is None:
            params = [p for m in self._alive() for p in m.parameters()]
            self.check_step(self.backwards - 1, "backward", params)

    def on_optimizer_step(self, optimizer: Any) -> None:
        key = id(optimizer)
        step = self.opt_steps.get(key, 0)
        self.opt_steps[key] = step + 1
        if self.first_bad is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.check_step(step, "optimizer.step", params)

    # -- automatic records (zero-code compare) -------------------------------------------------------------------
    def _record_loss(self, loss: Any) -> None:
        from distcheck.rank import records

        # A step is an optimizer step when the script has an optimizer (several backward() calls per step under
        # gradient accumulation are occurrences of one step), else one backward() call.
        step = max(self.opt_steps.values(), default=0) if self.optimizers else self.backwards - 1
        if step >= self.record_steps or loss.numel() != 1 or not loss.is_floating_point():
            return
        try:
            site = caller_site()
            # Each rank's own loss, not a cross-rank mean: compare averages per-rank values itself, so no rank
            # waits for another here; for tensor parallelism the ranks agree and the mean is the value.
            records.record_auto(records.AUTO_LOSS, loss.detach().reshape(()), step, site.file, site.line,
                                replicated=False)
            self.auto_records += 1
        except Exception as exc:  # recording must never break the user's training
            log.warning("distcheck: recording the loss failed: %s: %s", type(exc).__name__, exc)

    def on_optimizer_step_done(self, optimizer: Any) -> None:
        if not self.record_steps:
            return
        from distcheck.rank import records

        step = self.opt_steps.get(id(optimizer), 1) - 1
        if step < self.record_steps:
            try:
                names = self._param_names()
                pairs = [(names.get(id(p)) or f"param_groups.{g}.{i}", p)
                         for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]
                site = caller_site()
                records.record_auto(records.AUTO_PARAMS, pairs, step, site.file, site.line)
                self.auto_records += 1
            except Exception as exc:
                log.warning("distcheck: recording the parameters failed: %s: %s", type(exc).__name__, exc)
        # Every model has run forward by the end of the first step: the naming hook has done its job.
        self._stop_naming()

    def _param_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the outermost module holding it (watched roots, then modules that ran)."""
        modules = self._alive() + [m for m in (r() for r in self._called.values()) if m is not None]
        inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
        names: dict[int, str] = {}
        for m in modules:
            if id(m) in inner:
                continue
            for n, p in m.named_parameters():
                names.setdefault(id(p), n)
        return names

    def note_call(self, module: Any) -> None:
        if id(module) not in self._called:
            self._called[id(module)] = weakref.ref(module)

    def _stop_naming(self) -> None:
        if self._naming is not None:
            self._naming.remove()
            self._naming = None

    def check_step(self, step: int, counter: str, params: list[Any]) -> None:
        import torch

        started = time.perf_counter()
        try:
            self._resolve(block=False)
            if not self._names:
                self._names = {id(p): _strip(n) for m in self._alive() for n, p in m.named_parameters()}
            grads, names = [], []
            for p in params:
                g = p.grad
                if g is None:
                    continue
                grads.append(g.to_local() if callable(getattr(g, "to_local", None)) else g)
                names.append(self._names.get(id(p), f"<parameter {len(names)}>"))
            losses = self._losses
            self._losses = []
            parts = []
            if losses:
                parts.append(torch.stack([t.float() for t, _ in losses]))
            if grads:
                with torch.no_grad():
                    norms = torch._foreach_norm(grads)
                parts.append(torch.stack([n.float().to(parts[0].device if parts else n.device) for n in norms]))
            if not parts:
                return
            device = parts[0].device
            values = torch.cat([p.to(device) for p in parts])
            sites = [s for _, s in losses]
            if device.type == "cpu":
                self._inspect(step, counter, values, len(losses), names, sites)
            else:
                # A non-blocking copy read at a later step: no device->host sync on the training path.
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((step, counter, host, names, sites, event, len(losses)))
        except Exception as exc:
            log.warning("distcheck: the NaN/Inf check failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.step_seconds += time.perf_counter() - started

    def _resolve(self, block: bool) -> None:
        while self._pending and self.first_bad is None:
            step, counter, host, names, sites, event, n_losses = self._pending[0]
            if not block and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            self._inspect(step, counter, host, n_losses, names, sites)
        if self.first_bad is not None:
            self._pending.clear()

    def _inspect(self, step: int, counter: str, values: Any, n_losses: int, names: list[str], sites: list[Any]
                 ) -> None:
        flat = values.tolist()
        losses, norms = flat[:n_losses], flat[n_losses:]
        bad_losses = [i for i, v in enumerate(losses) if not math.isfinite(v)]
        bad_grads = [names[i] for i, v in enumerate(norms) if not math.isfinite(v)]
        if not bad_losses and not bad_grads:
            return
        bad_grads.sort(key=lambda n: self._order.get(n, len(self._order)))
        site = sites[bad_losses[0]] if bad_losses else (sites[0] if sites else None)
        self.first_bad = BadEvent(step, counter, bool(bad_losses),
                                  loss_value_name(losses[bad_losses[0]]) if bad_losses else None, bad_grads,
                                  getattr(site, "file", None), getattr(site, "line", None))
        self._losses = []
        self.write_state()

    # -- results --------------------------------------------------------------------------------------------------
    @property
    def steps_done(self) -> int:
        return max(self.opt_steps.values()) if self.opt_steps else self.backwards

    def state(self) -> dict[str, Any]:
        return {files.FORMAT_KEY: files.FORMAT, "rank": self.rank, "model_checks": self.model_checks, "steps": self.steps_done,
                "counter": "optimizer.step" if self.opt_steps else "backward", "backwards": self.backwards,
                "first_bad": self.first_bad.to_json() if self.first_bad else None,
                "step_check_seconds": self.step_seconds, "auto_records": self.auto_records}

    def write_state(self) -> None:
        from distcheck.contract.report import atomic_write

        try:
            atomic_write(state_path(self.out_dir, self.rank), json.dumps(self.state()) + "\n")
        except OSError as exc:
            log.warning("distcheck: cannot write %s: %s", state_path(self.out_dir, self.rank), exc)

    def finish(self) -> None:
        try:
            self._resolve(block=True)
        except Exception as exc:
            log.warning("distcheck: the NaN/Inf check failed: %s", exc)
        if self._losses and self.first_bad is None:
            # Losses after the last optimizer step (an evaluation, or a script without an optimizer).
            self.check_step(self.steps_done, "optimizer.step" if self.opt_steps else "backward", [])
            self._resolve(block=True)
        self.write_state()


def _first_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    check = ref()
    if check is not None and check is _active:
        check.on_first_forward(module)


def _note_call(ref: weakref.ref, module: Any, args: Any) -> None:
    check = ref()
    if check is not None and check is _active:
        check.note_call(module)


def _auto_record_steps() -> int:
    from distcheck.rank import records

    steps = records.auto_steps()
    # active() caches whether records are written: only ask once compare has asked for automatic records.
    return steps if steps and records.active() else 0


def _any_forward(ref: weakref.ref, module: Any, args: Any) -> None:
    check = ref()
    if check is None or check is not _active:
        return
    if not check._checking and check.contains_watched(module):
        check.on_first_forward(module)


def _strip(name: str) -> str:
    """DDP's ``module.`` prefix is not part of the user's parameter names."""
    return name.removeprefix("module.")


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

    if isinstance(root, DistributedDataParallel):
        return f"DistributedDataParallel({_user_class(root.module).__name__})"
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
        return None, f"{label}.reset_parameters() could not be run on a fresh copy ({type(exc).__name__})"


def _append_findings(out_dir: Path, rank: int, findings: list[Finding]) -> None:
    from distcheck.contract.findings import jsonable
    from distcheck.rank.sink import findings_path

    if not findings:
        return
    with open(findings_path(out_dir, rank), "a", encoding="utf-8") as fh:
        for f in findings:
            fh.write(json.dumps(jsonable(f.to_json())) + "\n")


# -- the wrappers (installed once per process; they act only while a check is active) ---------------------------

_patched = False


def _watching(fn: Callable, pick: Callable[[tuple, dict, Any], Any]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        check = _active
        if check is not None:
            try:
                target = pick(args, kwargs, result)
                for m in target if isinstance(target, (list, tuple)) else [target]:
                    check.watch(m)
            except Exception as exc:
                log.debug("distcheck: could not watch a model: %s", exc)
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
    wrapper = _watching(original, lambda a, k, r: r if r is not None else a[0])
    _replace("fully_shard", original, wrapper, "torch.distributed")


def _patch_tensor(_module: Any) -> None:
    import torch.distributed.tensor as dt

    original = dt.distribute_module
    if not hasattr(original, "__distcheck_original__"):
        _replace("distribute_module", original, _watching(original, lambda a, k, r: r if r is not None else a[0]),
                 "torch.distributed")


def _patch_tp(_module: Any) -> None:
    import torch.distributed.tensor.parallel as tp

    original = tp.parallelize_module
    if not hasattr(original, "__distcheck_original__"):
        _replace("parallelize_module", original,
                 _watching(original, lambda a, k, r: r if r is not None else a[0]), "torch.distributed")


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
               "torch.distributed.tensor.parallel": _patch_tp}
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
        ddp_init(self, *args, **kwargs)
        if _active is not None:
            _active.watch(self)

    DistributedDataParallel.__init__ = ddp_wrapper

    opt_init = torch.optim.Optimizer.__init__

    @functools.wraps(opt_init)
    def opt_wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        opt_init(self, *args, **kwargs)
        if _active is not None:
            _active.optimizers += 1

    torch.optim.Optimizer.__init__ = opt_wrapper

    def step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _active is not None:
            _active.on_optimizer_step(optimizer)

    def step_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _active is not None:
            _active.on_optimizer_step_done(optimizer)

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(step_pre_hook)
    register_optimizer_step_post_hook(step_post_hook)

    backward = torch.Tensor.backward

    @functools.wraps(backward)
    def backward_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        check = _active
        if check is None:
            return backward(self, *args, **kwargs)
        try:
            check.on_backward(self)
        except Exception as exc:
            log.debug("distcheck: loss check failed: %s", exc)
        result = backward(self, *args, **kwargs)
        check.after_backward()
        return result

    torch.Tensor.backward = backward_wrapper


def install(out_dir: str | os.PathLike, rank: int, emit: bool = False) -> AutoCheck | None:
    """Activate the zero-code checks for this process (None when DISTCHECK_AUTOCHECK=0)."""
    global _active
    if not enabled():
        return None
    patch_once()
    _active = AutoCheck(out_dir, rank, emit)
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.stop_watching()
    _active = None


# -- the supervisor's side: merge the ranks' files into findings and checks -------------------------------------

def load_states(report_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in files.rank_files(report_dir, "autocheck").values():
        try:
            data = json.loads(path.read_text())
            files.check_format(data, path)
            out[int(data["rank"])] = data
        except files.FormatError:
            raise
        except (OSError, ValueError, KeyError):
            continue
    return out


def merge_states(states: dict[int, dict[str, Any]]) -> tuple[list[Finding], list[CheckResult]]:
    """The first-NaN finding and the ``model_check`` / ``bad_values`` checks from the ranks' autocheck files."""
    if not states:
        return [], []
    events = {r: BadEvent.from_json(s["first_bad"]) if s.get("first_bad") else None for r, s in states.items()}
    steps = {r: int(s.get("steps", 0)) for r, s in states.items()}
    finding = first_bad_finding(events, steps)
    findings = [finding] if finding is not None else []
    checks: list[CheckResult] = []
    model_checks = [s.get("model_checks", []) for s in states.values()]
    if any(model_checks):
        seconds = max(sum(c["seconds"] for c in mc) for mc in model_checks)
        roots = sorted({c["root"] for mc in model_checks for c in mc})
        bad = sum(c["findings"] for mc in model_checks for c in mc)
        checks.append(CheckResult("model_check", bad == 0, seconds,
                                  note=f"found by itself at the first forward: {', '.join(roots)}"))
    else:
        checks.append(CheckResult("model_check", True, 0.0,
                                  note="no model passed to fully_shard/DDP/parallelize_module/distribute_module"))
    step_seconds = max(float(s.get("step_check_seconds", 0.0)) for s in states.values())
    counter = next(iter(states.values())).get("counter", "optimizer.step")
    done = max(steps.values())
    note = ("" if finding is not None else "no backward() ran" if done == 0 else
            f"loss and gradients finite on every {counter} ({done} steps)")
    checks.append(CheckResult("bad_values", finding is None, step_seconds, note=note))
    return findings, checks


def report_parts(report_dir: str | os.PathLike) -> tuple[list[Finding], list[CheckResult]]:
    return merge_states(load_states(report_dir))


# -- the pytest marker's pool: one verdict per test -------------------------------------------------------------

def test_findings(check: AutoCheck, key: str, timeout: float = 2.0) -> list[Finding]:
    """After a test body: rank 0 gets every rank's first-NaN record (side channel) and returns all findings.

    The other ranks only publish and never wait, so a rank stuck elsewhere cannot stall them; rank 0 waits at most
    ``timeout`` per missing rank and merges what it got.
    """
    from distcheck.errors import ChannelTimeout
    from distcheck.rank.runtime import current_channel

    check.finish()
    channel = current_channel()
    states = {check.rank: check.state()}
    if channel is not None:
        channel.put(f"autocheck/{key}/{check.rank}", states[check.rank])
        if check.rank != 0:
            return []
        # A test that ran no model and no backward here (plain collectives) has nothing to merge: do not wait.
        quiet = not check.model_checks and not check.backwards
        for r in ([] if quiet else range(1, channel.world_size)):
            try:
                states[r] = channel.get(f"autocheck/{key}/{r}", r, timeout=timeout)
            except ChannelTimeout:
                log.warning("distcheck: rank %s sent no automatic-check record for this test", r)
    findings, _ = merge_states(states)
    return list(check.findings) + findings


def failure_text(findings: list[Finding]) -> str:
    from distcheck.contract.findings import format_ranks

    lines = ["distcheck's automatic checks found what the test's asserts did not (DISTCHECK_AUTOCHECK=0 turns "
             "them off):"]
    lines += [f"  [{f.kind}] {format_ranks(f.ranks) if f.ranks else 'all ranks'}: {f.message}" for f in findings]
    return "\n".join(lines)
