"""Automatic records for zero-code ``compare``: the loss and parameters of the first K steps, the first one's gradients.

    python -m distcheck compare --nproc 2 -- train.py      # DISTCHECK_AUTO_RECORD_STEPS=K in the ranks

The first K steps record, marked automatic: the loss passed to ``backward()`` as ``auto/loss`` at the user's
``backward()`` line (each rank's own value, with the rank's data-parallel coordinate: the analysis combines them
over the ranks, as their mean or, where the parameters prove it, their sum over the data-parallel ranks, so the
training loop waits for no other rank), and after each ``optimizer.step()`` (a global step post-hook) every
parameter that optimizer updates as ``auto/params`` at the user's ``step()`` line, gathered to full tensors (a
collective on the user's process group, which every rank reaches at the same step). At the first step, before the
parameters, every gradient the step used is recorded as ``auto/grads`` (full tensors too, named like the parameters):
an optimizer such as Adam is invariant to a constant scale of the gradients, so matching parameters alone cannot
prove how the loss is reduced over the ranks (a loss divided twice, 1/N gradients, updates like the reference's).
Before the first update (the step pre-hook) the parameters are recorded once more, as ``auto/init``: runs that start
from different parameters are told apart from runs whose steps differ. Parameters are named from the outermost modules whose
forward ran before the first step (a global forward pre-hook, removed at that step), so the names agree with or
without DDP/FSDP wrappers. Outside ``compare`` K is 0 and nothing here runs.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from distcheck.contract import files
from distcheck.rank.autocheck.module_summaries import data_parallel, record_steps_from_env
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import caller_site

log = logging.getLogger("distcheck")

# The gradients of the first step, recorded once (one more gather of the full gradients); analysis/record_*.py
# reads them under the same name.


class AutoRecords(Check):
    name = "auto_records"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the step counters and the watched models
        self.steps = record_steps_from_env()
        self.count = 0
        self._called: dict[int, weakref.ref] = {}  # modules whose forward ran before the first step
        self._naming: Any = None
        self._dp: Any = None  # module_summaries.DataParallel, once a wrapper says
        if self.steps:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._naming = register_module_forward_pre_hook(functools.partial(_note_call, weakref.ref(self)))

    def state(self) -> int:
        return self.count  # records taken

    def on_backward(self, loss: Any) -> None:
        if not self.steps:
            return
        self._record_loss(loss)
        if not self.core.optimizers and self.core.backwards > self.steps:
            self.stop_naming()  # names serve only the parameter records of optimizer steps

    def _record_loss(self, loss: Any) -> None:
        from distcheck.rank import records

        # A step is an optimizer step when the script has an optimizer (several backward() calls per step under
        # gradient accumulation are occurrences of one step), else one backward() call.
        core = self.core
        step = core.loss_step if core.optimizers else core.backwards - 1
        if step >= self.steps or loss.numel() != 1 or not loss.is_floating_point():
            return
        try:
            site = caller_site()
            # Each rank's own loss, not a cross-rank mean: compare averages per-rank values itself, so no rank
            # waits for another here; for tensor parallelism the ranks agree and the mean is the value.
            dp = self._data_parallel()
            records.record_auto(records.AUTO_LOSS, loss.detach().reshape(()), step, site.file, site.line,
                                replicated=False, dp=(dp.index, dp.size) if dp is not None else None)
            self.count += 1
        except Exception as exc:  # recording must never break the user's training
            log.warning("distcheck: recording the loss failed: %s: %s", type(exc).__name__, exc)

    def _parameters(self, optimizer: Any) -> tuple[tuple, list[tuple[str, Any]]]:
        """The outermost modules and (name, parameter) of every parameter ``optimizer`` updates."""
        roots = tuple(self._roots())
        names = self._param_names(roots)
        return roots, [(names.get(id(p)) or f"param_groups.{g}.{i}", p)
                       for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]

    def on_optimizer_step(self, optimizer: Any, step: int) -> None:
        """Before the first update: the parameters both runs start from (``auto/init``). A 1-rank reference and an
        N-rank run that differ here differ from their first forward on, whatever the gradients do."""
        if not self.steps or step != 0:
            return
        from distcheck.rank import records

        try:
            roots, pairs = self._parameters(optimizer)
            site = caller_site()
            records.record_auto(files.AUTO_INIT, pairs, 0, site.file, site.line, roots=roots)
            self.count += 1
        except Exception as exc:
            log.warning("distcheck: recording the initial parameters failed: %s: %s", type(exc).__name__, exc)

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        if not self.steps:
            return
        from distcheck.rank import records

        if step < self.steps:
            try:
                roots, pairs = self._parameters(optimizer)
                site = caller_site()
                if step == 0:
                    self._record_grads(pairs, site, roots)
                records.record_auto(records.AUTO_PARAMS, pairs, step, site.file, site.line, roots=roots)
                self.count += 1
            except Exception as exc:
                log.warning("distcheck: recording the parameters failed: %s: %s", type(exc).__name__, exc)
        # Every model has run forward by the end of the first step: the naming hook has done its job.
        self.stop_naming()

    def _record_grads(self, pairs: list[tuple[str, Any]], site: Any, roots: tuple) -> None:
        from distcheck.rank.checks.fsdp1 import FlatIndex
        from distcheck.rank import records

        try:
            # After the step the gradients are still on the parameters (a closure computed them inside it); a
            # DTensor's full_tensor() is a collective every rank reaches here, as for the parameters. FSDP1's
            # gradients are read from its flat parameters (a view of another rank's chunk has no .grad here), so
            # whether there are any must not depend on this rank's chunk either.
            index = FlatIndex(roots)
            if any(p.grad is not None or index.find(p) is not None for _, p in pairs):
                records.record_auto(files.AUTO_GRADS, pairs, 0, site.file, site.line, roots=roots, gradients=True)
                self.count += 1
        except Exception as exc:
            log.warning("distcheck: recording the gradients failed: %s: %s", type(exc).__name__, exc)

    def _data_parallel(self) -> Any:
        """This rank's data-parallel coordinate (module_summaries.data_parallel), found once."""
        if self._dp is None:
            try:
                self._dp = data_parallel(self.core.models.alive())
            except Exception as exc:
                log.debug("data-parallel coordinate failed: %s", exc)
        return self._dp

    def _roots(self) -> list[Any]:
        """The outermost modules: watched roots, then modules whose forward ran before the first step."""
        from distcheck.rank.autocheck.discovery import outermost

        modules = self.core.models.alive() + [m for m in (r() for r in self._called.values()) if m is not None]
        return outermost(modules)

    def _param_names(self, roots: tuple) -> dict[int, str]:
        """id(parameter) -> its name in the outermost module holding it (watched roots, then modules that ran)."""
        names: dict[int, str] = {}
        for m in roots:
            for n, p in m.named_parameters():
                names.setdefault(id(p), n)
        return names

    def note_call(self, module: Any) -> None:
        if id(module) not in self._called:
            self._called[id(module)] = weakref.ref(module)

    def on_uninstalled(self) -> None:
        self.stop_naming()

    def stop_naming(self) -> None:
        if self._naming is not None:
            self._naming.remove()
            self._naming = None


def _note_call(ref: weakref.ref, module: Any, args: Any) -> None:
    records = ref()
    if records is not None and records.core.active:
        records.note_call(module)
