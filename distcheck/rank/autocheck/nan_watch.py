"""The NaN/Inf watch: the first step whose loss or gradients are not finite, on each rank.

    python -m distcheck run --nproc 2 -- train.py      # installed in every rank by rank/autocheck

Each ``optimizer.step()`` (a global step pre-hook) checks that step's losses (the scalars passed to
``backward()``) and gradients: one ``torch._foreach_norm`` over the local gradients and one host read per step
(on CUDA the read is a non-blocking copy checked at a later step, so there is no added sync). Without an
optimizer a step is a ``backward()`` call. Only the rank's first bad step is kept, written to
``autocheck-rank<R>.json``; the supervisor merges the ranks' events, so no cross-rank traffic is needed per step.
A DDP group's gradients, the same on each of its ranks, are checked in the first GRAD_DENSE_STEPS steps by one rank
per step, in turn (ddp_grad_share.py).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

from distcheck.analysis.bad_values import BadEvent, loss_value_name
from distcheck.rank.autocheck.ddp_grad_share import DdpGradShare, Share
from distcheck.rank.autocheck.discovery import user_name
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.autocheck.nan_origin import HeldInputs, locate
from distcheck.rank.usersite import caller_site

log = logging.getLogger("distcheck")


# The gradient norms are one pass over every local gradient (about 1.5% of a 10 ms DDP step of 4 MB of gradients on
# one CPU thread): every step at first, where a bad init or learning rate shows, then every GRAD_EVERY-th step, which
# keeps a long run within 3% of plain torchrun (bench/bench_ddp_step.py). The loss is checked at every step.
GRAD_DENSE_STEPS = 50
GRAD_EVERY = 10


def bad_flat_parts(name: str, flat: Any, grad: Any) -> list[str] | None:
    """The original parameters of an FSDP1 FlatParameter whose part of this rank's gradient shard is not finite,
    named as the user wrote them (``blocks.0.fc.weight`` for ``blocks.0._flat_param``); None when torch's shard
    metadata is missing."""
    import torch

    fqns, infos = getattr(flat, "_fqns", None), getattr(flat, "_shard_param_infos", None)
    if not fqns or infos is None or len(infos) != len(fqns):
        return None
    prefix = name.rsplit("_flat_param", 1)[0]
    values = grad.reshape(-1)
    out = []
    for fqn, info in zip(fqns, infos):
        if info.in_shard and info.numel_in_shard:
            part = values[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
            if not bool(torch.isfinite(part).all()):
                out.append(prefix + fqn)
    return out or None


def grads_checked(step: int) -> bool:
    return step < GRAD_DENSE_STEPS or step % GRAD_EVERY == 0


class NanWatch(Check):
    name = "nan_watch"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the step counters and the watched models
        self.first_bad: BadEvent | None = None
        self.seconds = 0.0  # time spent in the per-step checks
        self._losses: list[tuple[Any, Any]] = []  # (0-d loss tensor, site) since the last step check
        self._pending: list[tuple[int, str, Any, list[str], Any, Any, int]] = []  # CUDA reads not yet done
        self._names: dict[int, str] = {}  # id(parameter) -> name, for the gradient check
        self.last_clean_grads: int | None = None  # the last step whose gradients were checked and finite
        self.backward_order: dict[str, int] = {}  # parameter name -> position in backward order
        self.held = HeldInputs()  # this step's forward inputs, for where a first bad loss came from (nan_origin.py)
        self.ddp = DdpGradShare()  # the dense steps' gradients of a DDP group: checked by one rank in turn

    def state(self) -> dict[str, Any] | None:
        if self.first_bad is None and not self.seconds:
            return None
        return {"first_bad": self.first_bad.to_json() if self.first_bad else None, "seconds": self.seconds}

    def on_model_wrapped(self, module: Any, how: str) -> None:
        self._names.clear()  # parameters may have been replaced (fully_shard swaps them for DTensors)
        if self.first_bad is None:
            self.held.watch(module)
            if how == "ddp":
                self.ddp.watch(module)

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        self.held.clear()  # the inputs of the step just checked: the next step's forward holds its own

    def on_model_checked(self, root: Any) -> None:
        """Backward order of the parameters = the reverse of the order their modules first run forward in, which
        the next forward of the model just checked shows."""
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

    def on_backward(self, loss: Any) -> None:
        if self.first_bad is not None or loss.numel() != 1 or not loss.is_floating_point():
            return
        import torch

        from distcheck.rank.checks.fingerprint import local_tensor

        # A DTensor loss (a sequence-parallel output left as DTensor): its local value is finite exactly when this
        # rank's part is; stacking it with plain tensors would raise.
        value = loss.detach() if type(loss) is torch.Tensor else local_tensor(loss)
        self._losses.append((value.reshape(()), caller_site()))

    def on_after_backward(self) -> None:
        """Without an optimizer, a step is a backward() call: check right after it."""
        if self.core.optimizers == 0 and self.first_bad is None:
            params = [p for m in self.core.models.alive() for p in m.parameters()]
            self.check_step(self.core.backwards - 1, "backward", params)
            self.held.clear()

    def on_optimizer_step(self, optimizer: Any, step: int) -> None:
        if self.first_bad is None:
            # The parameters are listed only on a step whose gradients are checked: on the others (9 in 10 after
            # GRAD_DENSE_STEPS) the loss alone is.
            params = [p for g in optimizer.param_groups for p in g["params"]] if grads_checked(step) else []
            share = None
            if step < GRAD_DENSE_STEPS:
                try:
                    share = self.ddp.share(optimizer, params, step)
                except Exception as exc:  # an optimizer or model unlike torch's: every gradient is checked here
                    log.debug("distcheck: the DDP gradient share failed: %s", exc)
                    self.ddp.stop()
            elif not self.ddp.off:
                self.ddp.stop()
            self.check_step(step, "optimizer.step", params, share)

    def check_step(self, step: int, counter: str, params: list[Any], share: Share | None = None) -> None:
        """``share``: this step's gradients are a DDP group's (ddp_grad_share.py); on another rank's turn they are
        checked here only if a loss is bad, so that this rank's event holds them too."""
        import torch

        from distcheck.rank.checks.fingerprint import local_tensor

        started = time.perf_counter()
        try:
            self._resolve(block=False)
            losses = self._losses
            # CPU losses are read once, here (a host read, no device sync): for another rank's turn and the check.
            on_cpu = all(t.device.type == "cpu" for t, _ in losses)
            loss_values = [float(t) for t, _ in losses] if on_cpu else []
            if share is not None and not share.mine and params and on_cpu and all(map(math.isfinite, loss_values)):
                params = []  # every loss finite: the gradients are the turn rank's to check
            grads, names = [], []
            owners: list[Any] = []  # the parameter of each gradient: an FSDP1 FlatParameter is named when bad
            if params and grads_checked(step):  # else the loss only (see GRAD_EVERY)
                if not self._names:
                    self._names = {id(p): user_name(n) for m in self.core.models.alive()
                                   for n, p in m.named_parameters()}
                plain = torch.Tensor
                for p in params:
                    g = p.grad
                    if g is None:
                        continue
                    owners.append(p)
                    grads.append(g if type(g) is plain else local_tensor(g))  # a DTensor's: its local part
                    names.append(self._names.get(id(p), f"<parameter {len(names)}>"))
            self._losses = []
            if not losses and not grads:
                return
            sites = [s for _, s in losses]
            norms = []
            if grads:
                with torch.no_grad():
                    norms = torch._foreach_norm(grads)
            if on_cpu and (not norms or norms[0].device.type == "cpu"):
                # Plain floats, without stacking the scalars first (the torch calls that would cost more than the
                # check itself on a loss-only step).
                values = loss_values + (torch.stack(norms).tolist() if norms else [])
                self._inspect(step, counter, values, len(losses), names, sites, live=True, owners=owners,
                              replicated=share.ranks if share is not None and grads else [])
                return
            parts = []
            if losses:
                parts.append(torch.stack([t.float() for t, _ in losses]))
            if norms:
                parts.append(torch.stack([n.float().to(parts[0].device if parts else n.device) for n in norms]))
            device = parts[0].device
            values = torch.cat([p.to(device) for p in parts])
            # A non-blocking copy read at a later step: no device->host sync on the training path.
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, counter, host, names, sites, event, len(losses)))
        except Exception as exc:
            log.warning("distcheck: the NaN/Inf check failed: %s: %s", type(exc).__name__, exc)
        finally:
            self.seconds += time.perf_counter() - started

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

    def _inspect(self, step: int, counter: str, values: Any, n_losses: int, names: list[str], sites: list[Any],
                 live: bool = False, owners: list[Any] | None = None, replicated: list[int] | None = None) -> None:
        """``live``: read at the step itself (CPU), before the update: its forward inputs are still held.
        ``owners``: each gradient's parameter; a bad FSDP1 FlatParameter is named by the original parameters that
        hold the NaN/Inf (use_orig_params=False gives the optimizer only them), looked up only once one is bad.
        ``replicated``: the ranks of the DDP group whose gradients these are too (ddp_grad_share.py)."""
        flat = values if isinstance(values, list) else values.tolist()
        losses, norms = flat[:n_losses], flat[n_losses:]
        bad_losses = [i for i, v in enumerate(losses) if not math.isfinite(v)]
        bad_grads = []
        for i, v in enumerate(norms):
            if not math.isfinite(v):
                owner = owners[i] if owners else None
                inside = bad_flat_parts(names[i], owner, owner.grad) if owner is not None else None
                bad_grads += inside or [names[i]]
        if not bad_losses and not bad_grads:
            if norms:
                self.last_clean_grads = step
            return
        order = self.backward_order
        bad_grads.sort(key=lambda n: order.get(n, len(order)))
        site = sites[bad_losses[0]] if bad_losses else (sites[0] if sites else None)
        self.first_bad = BadEvent(step, counter, bool(bad_losses),
                                  loss_value_name(losses[bad_losses[0]]) if bad_losses else None, bad_grads,
                                  getattr(site, "file", None), getattr(site, "line", None),
                                  None if step < GRAD_DENSE_STEPS else self.last_clean_grads,
                                  locate(self.held.forwards) if bad_losses and live else None,
                                  list(replicated or []))
        self._losses = []
        self.held.stop()
        self.ddp.stop()
        self.core.write_state()

    def finish(self) -> None:
        self.ddp.stop()
        try:
            self._resolve(block=True)
        except Exception as exc:
            log.warning("distcheck: the NaN/Inf check failed: %s", exc)
        if self._losses and self.first_bad is None:
            # Losses after the last optimizer step (an evaluation, or a script without an optimizer).
            self.check_step(self.core.steps_done, self.core.counter, [])
            self._resolve(block=True)
