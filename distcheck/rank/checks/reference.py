"""Parallel vs 1-rank reference: train K steps in parallel and compare with the same steps on one rank.

Every rank trains the parallelized model on its share of a deterministic global batch; rank 0 also trains an
unparallelized copy of the same initial model on the whole batch (the reference a 1-GPU run would give) and
compares, step by step: the loss, every gradient and every parameter after the step (gathered to full tensors).
It also evaluates the reference on each rank's share of the batch, so a rank whose own forward differs is named.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from distcheck.analysis.tolerance import Comparison, compare, ratio_hint, tolerance_for
from distcheck.rank.checks.batches import BatchMaker, global_batch
from distcheck.contract.findings import Finding, format_ranks
from distcheck.rank.checks.parallelize import Parallel, apply, full_tensor
from distcheck.rank.runtime import Session

LR = 0.05


@dataclass
class StepRow:
    step: int
    loss: float
    ref_loss: float
    loss_err: float
    grad_err: float
    param_err: float


@dataclass
class Outcome:
    parallel: Parallel
    findings: list[Finding] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)


def _slices(batch: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(batch.chunk(world))


def _first_mismatch(kind: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    rtol, atol) -> tuple[str, Comparison, float] | None:
    worst = 0.0
    first = None
    for name, ref in expected.items():
        if name not in actual:
            cmp = Comparison(False, float("inf"), float("inf"), [], float("nan"), float("nan"), 0.0, 0.0,
                             note=f"the parallel run has no {kind} for it")
        else:
            cmp = compare(actual[name], ref, rtol, atol)
        worst = max(worst, cmp.max_abs)
        if not cmp.ok and first is None:
            first = (name, cmp)
    return (first[0], first[1], worst) if first else None


def _max_err(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((compare(actual[n], e).max_abs if n in actual else float("inf") for n, e in expected.items()),
               default=0.0)


def run(session: Session, model: nn.Module, mode: str, maker: BatchMaker, steps: int, seed: int,
        rtol: float | None = None, atol: float | None = None) -> Outcome:
    world, rank = session.world_size, session.rank
    reference = copy.deepcopy(model) if rank == 0 else None
    par = apply(model, mode, session.device, world)
    opt = torch.optim.SGD(par.module.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR) if reference is not None else None
    batch_size = 4 * world
    out = Outcome(par)
    found = False
    for step in range(steps):
        batch = global_batch(maker, batch_size, seed, step, session.device)
        local = _slices(batch, world)[rank] if par.splits_batch else batch
        opt.zero_grad(set_to_none=False)
        loss = maker.loss(par.module(local), local)
        loss.backward()
        grads = {n: full_tensor(p.grad) for n, p in par.inner.named_parameters() if p.grad is not None}
        opt.step()
        params = {n: full_tensor(p) for n, p in par.inner.named_parameters()}
        local_losses = session.channel.exchange("reference/loss", float(loss.detach()))
        if reference is None or found:
            continue
        # The reference, on rank 0: each rank's share first (what that rank's loss should be), then the step.
        with torch.no_grad():
            shares = _slices(batch, world) if par.splits_batch else [batch] * world
            share_losses = [float(maker.loss(reference(s), s)) for s in shares]
        ref_opt.zero_grad(set_to_none=False)
        ref_loss = maker.loss(reference(batch), batch)
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
        ref_opt.step()
        ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
        # Averaged in float64 so the mean itself adds no error; judged with the loss dtype's tolerance.
        par_loss = torch.tensor(sum(local_losses) / world, dtype=torch.float64)
        loss_rtol, loss_atol = tolerance_for(ref_loss.dtype, rtol, atol)
        loss_cmp = compare(par_loss, ref_loss.detach().double(), loss_rtol, loss_atol)
        out.rows.append(StepRow(step, float(par_loss), float(ref_loss.detach()), loss_cmp.max_abs,
                                _max_err(grads, ref_grads), _max_err(params, ref_params)))
        odd_ranks = [r for r in range(world) if not compare(torch.tensor(local_losses[r]),
                                                             torch.tensor(share_losses[r]), loss_rtol, loss_atol).ok]
        finding = None
        if not loss_cmp.ok:
            finding = _finding(step, "loss", "", loss_cmp, par_loss, ref_loss.detach(), world, odd_ranks,
                               local_losses, share_losses)
        else:
            for kind, actual, expected in (("gradient", grads, ref_grads), ("parameter", params, ref_params)):
                hit = _first_mismatch(kind, actual, expected, rtol, atol)
                if hit:
                    name, cmp, _ = hit
                    finding = _finding(step, kind, name, cmp, actual.get(name, expected[name]), expected[name],
                                       world, odd_ranks,
                                       local_losses, share_losses)
                    break
        if finding is not None:
            out.findings.append(finding)
            found = True
    return out


def _finding(step: int, kind: str, name: str, cmp: Comparison, actual: torch.Tensor, expected: torch.Tensor,
             world: int, odd_ranks: list[int], local_losses: list[float], share_losses: list[float]) -> Finding:
    what = "the loss" if kind == "loss" else f"the {kind} of '{name}'" + (" after the optimizer step"
                                                                         if kind == "parameter" else "")
    message = f"step {step}: {what} differs from the 1-rank reference: {cmp.describe()}"
    hint = ratio_hint(actual, expected, world)
    if hint:
        message += f"; {hint}"
    if odd_ranks and len(odd_ranks) < world:
        message += (f"; {format_ranks(odd_ranks)} computed a different loss than the reference on the same "
                    f"share of the batch: look at what differs on {'that rank' if len(odd_ranks) == 1 else 'them'}")
    elif kind != "loss":
        message += "; every rank's loss matched the reference, so the difference is in how gradients are " \
                   "reduced or applied"
    ranks = odd_ranks if odd_ranks and len(odd_ranks) < world else list(range(world))
    detail = {"step": step, "tensor": name or "loss", "quantity": kind, "abs_err": cmp.max_abs,
              "rel_err": cmp.max_rel, "index": cmp.index, "value": cmp.actual, "reference": cmp.expected,
              "rtol": cmp.rtol, "atol": cmp.atol, "local_losses": local_losses,
              "reference_share_losses": share_losses}
    if hint:
        detail["hint"] = hint
    return Finding("reference_mismatch", ranks, message, detail)


def render_rows(rows: list[StepRow]) -> str:
    lines = ["step  loss          reference     loss err   max grad err  max param err"]
    for r in rows:
        lines.append(f"{r.step:<5} {r.loss:<13.7g} {r.ref_loss:<13.7g} {r.loss_err:<10.3g} {r.grad_err:<13.3g} "
                     f"{r.param_err:.3g}")
    return "\n".join(lines)
