"""Pure analysis behind ``bad_values`` (no process group): classify values, merge per-rank first-NaN events.

Two bugs end up here:

- *Uninitialized parameters.* A model built on the meta device, sharded, then ``to_empty()``'d keeps whatever the
  allocator handed back until an initializer writes it. When a root ``reset_parameters()`` does not reach the
  children, those parameters hold leftovers: values like 1e31 or 1e38 next to denormals (freed-list pointers and
  integers read as floats), or NaN. No initializer produces a magnitude above 1e6 or a denormal in float32/bf16,
  so those are the signal; exact zeros alone are not (zero-init of biases and residual projections is common).
- *First NaN/Inf.* Each rank records its first bad step (loss or gradient); :func:`first_bad_finding` merges the
  ranks' events into one finding naming the earliest step, the ranks whose *own loss* was bad there (their data),
  and the ranks that only received NaN through the gradient reduction.

:func:`model_check_verdict` and :func:`first_bad_verdict` are the entries of analysis/check_table.py for the
``models`` and ``nan_watch`` checks.

Stats are computed by :func:`tensor_stats` (torch, no communication); everything else works on plain records, so
it is unit-tested without launching ranks.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from distcheck.analysis.check_verdict import Verdict, notes_in
from distcheck.contract.autocheck_file import RunFields
from distcheck.analysis.nan_origin import origin_site, origin_text
from distcheck.contract.findings import CheckResult, Finding, format_names, format_ranks
from distcheck.contract.site import file_line

# No initializer (normal/uniform/xavier/kaiming/trunc_normal/ones/zeros/eye/orthogonal) produces a magnitude above
# this for any realistic fan-in; leftovers of uninitialized memory routinely do (1e31, 1e38).
HUGE = 1e6
# Dtypes whose smallest normal is ~1.2e-38: an initializer drawing N(0, 0.02) hits a denormal with probability
# ~1e-36 per element, so a denormal is leftover memory. float16's smallest normal is 6e-5: denormals are normal
# there, the rule does not apply.
DENORMAL_DTYPES = frozenset({"float32", "float64", "bfloat16"})
MAX_NAMED_PARAMS = 8  # parameters named in one message; all of them are in the detail


@dataclass(frozen=True)
class ValueStats:
    """What one tensor's local values look like (a DTensor: this rank's shard)."""

    numel: int
    nan: int = 0
    inf: int = 0
    huge: int = 0  # finite, |x| > HUGE
    denormal: int = 0  # 0 < |x| < finfo.tiny
    zeros: int = 0
    min: float = 0.0  # over finite values; 0.0 when there are none
    max: float = 0.0
    max_abs: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tensor_stats(t: Any) -> ValueStats:
    """Stats of a floating tensor's local values (one pass of elementwise kernels, no communication)."""
    import torch

    local = t.to_local() if callable(getattr(t, "to_local", None)) else t
    x = local.detach()
    n = x.numel()
    if n == 0 or not x.is_floating_point():
        return ValueStats(numel=n)
    finite = torch.isfinite(x)
    nan = int(torch.isnan(x).sum())
    n_finite = int(finite.sum())
    inf = n - n_finite - nan
    if n_finite:
        vals = x[finite].float() if n_finite < n else x.float()
        a = vals.abs()
        tiny = torch.finfo(x.dtype).tiny
        lo, hi, max_abs = float(vals.min()), float(vals.max()), float(a.max())
        huge = int((a > HUGE).sum())
        denormal = int(((a > 0) & (a < tiny)).sum())
        zeros = int((a == 0).sum())
    else:
        lo = hi = max_abs = 0.0
        huge = denormal = zeros = 0
    return ValueStats(n, nan, inf, huge, denormal, zeros, lo, hi, max_abs)


def plausible(t: Any, role: str = "parameter") -> bool:
    """Fast path of :func:`classify` (two reductions, no counts): True when nothing could be flagged.

    NaN propagates through max, Inf and huge values show in it; the smallest nonzero magnitude shows denormals.
    Only tensors that fail this get the full :func:`tensor_stats`.
    """
    import torch

    local = t.to_local() if callable(getattr(t, "to_local", None)) else t
    x = local.detach()
    if x.numel() == 0 or not x.is_floating_point():
        return True
    a = x.abs()
    top = float(a.max())
    if role == "buffer":
        return top == top  # only NaN counts for buffers
    if not top <= HUGE:  # also False for NaN
        return False
    if str(x.dtype).removeprefix("torch.") not in DENORMAL_DTYPES:
        return True
    smallest = float(torch.where(a > 0, a, torch.full((), float("inf"), dtype=a.dtype, device=a.device)).min())
    return smallest >= torch.finfo(x.dtype).tiny


def classify(stats: ValueStats, dtype: str, role: str = "parameter") -> list[str]:
    """Why these values cannot come from an initializer (empty: they can).

    Parameters: NaN, Inf, |x| > 1e6, denormals (float32/float64/bf16). Buffers legitimately hold -inf masks and
    large constants, so only NaN counts there.
    """
    dtype = dtype.removeprefix("torch.")
    reasons: list[str] = []
    if stats.nan:
        reasons.append(f"{stats.nan} NaN")
    if role == "buffer":
        return reasons
    if stats.inf:
        reasons.append(f"{stats.inf} Inf")
    if stats.huge:
        reasons.append(f"{stats.huge} with |x| > {HUGE:.0e} (max {stats.max_abs:.3g})")
    if stats.denormal and dtype in DENORMAL_DTYPES:
        reasons.append(f"{stats.denormal} denormal")
    return reasons


@dataclass
class FlaggedTensor:
    """A parameter or buffer whose local values on one rank no initializer produces."""

    name: str
    role: str
    dtype: str
    module: str  # fqn of the owning module ("" for the root)
    module_class: str  # the user-visible class (nn.Linear, not FSDPLinear)
    stats: ValueStats
    reasons: list[str]
    file: str | None = None
    line: int | None = None
    init_range: tuple[float, float] | None = None  # what the owning module's own initializer gives
    init_source: str | None = None  # "nn.Linear.reset_parameters()" or why none could be computed

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["stats"] = self.stats.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FlaggedTensor:
        data = dict(data)
        data["stats"] = ValueStats(**data["stats"])
        if data.get("init_range") is not None:
            data["init_range"] = tuple(data["init_range"])
        return cls(**data)


def _range(lo: float, hi: float) -> str:
    return f"[{lo:.3g}, {hi:.3g}]"


_SHOWN = 3  # names a grouped message lists before "(+N more)"; report.json's detail lists them all
_UNINIT = ("built on the meta device and to_empty()'d, then no reset_parameters() or init reached {it}. Such values "
           "are whatever memory held, so they also differ between world sizes and runs")


def _looks_uninitialized(first: FlaggedTensor, by_rank: dict[int, FlaggedTensor]) -> bool:
    nonfinite = any(i.stats.nan or i.stats.inf for i in by_rank.values())
    return bool(first.role == "parameter" and not nonfinite or first.stats.denormal or first.stats.huge)


def _tensor_detail(name: str, by_rank: dict[int, FlaggedTensor]) -> dict[str, Any]:
    ranks = sorted(by_rank)
    first = by_rank[ranks[0]]
    detail: dict[str, Any] = {
        "param": name, "ranks": ranks, "role": first.role, "module": first.module, "module_class": first.module_class,
        "dtype": first.dtype, "reasons": {str(r): by_rank[r].reasons for r in ranks},
        "stats": {str(r): by_rank[r].stats.to_json() for r in ranks},
        "range": [min(i.stats.min for i in by_rank.values()), max(i.stats.max for i in by_rank.values())],
        "init_range": list(first.init_range) if first.init_range else None, "init_source": first.init_source,
    }
    where = file_line(first.file, first.line)
    if where:
        detail.update(file=first.file, line=first.line, site=where)
    return detail


def _one_tensor_finding(name: str, by_rank: dict[int, FlaggedTensor]) -> Finding:
    ranks = sorted(by_rank)
    first = by_rank[ranks[0]]
    detail = _tensor_detail(name, by_rank)
    del detail["ranks"]  # the finding's own ranks
    lo, hi = detail["range"]
    where = detail.get("site")
    owner = f"{first.module_class} '{first.module}'" if first.module else f"the root {first.module_class}"
    msg = (f"{first.role} '{name}' of {owner}" + (f" ({where})" if where else "") +
           f" holds values no initializer produces at the first forward on {format_ranks(ranks)}: "
           f"{', '.join(first.reasons)} of {first.stats.numel} local values, finite range {_range(lo, hi)}")
    if first.init_range is not None:
        msg += f"; {first.init_source} gives {_range(*first.init_range)}"
    elif first.init_source:
        msg += f" ({first.init_source})"
    if _looks_uninitialized(first, by_rank):
        msg += ". It looks uninitialized: " + _UNINIT.format(it="it")
    else:
        msg += ". Training with it turns every loss and gradient that touches it into NaN/Inf"
    detail["when"] = "first forward"
    return Finding("bad_values", ranks, msg, detail)


def _grouped_finding(members: list[tuple[str, dict[int, FlaggedTensor]]], uninit: bool) -> Finding:
    """One finding for tensors with one cause (left uninitialized after to_empty(), or NaN/Inf from the start)."""
    ranks = sorted({r for _, by_rank in members for r in by_rank})
    name0, by_rank0 = members[0]
    first = by_rank0[min(by_rank0)]
    role = first.role
    names = [name for name, _ in members]
    shown = format_names(names, _SHOWN)
    classes = sorted({by_rank[min(by_rank)].module_class for _, by_rank in members})
    sites: list[str] = []
    for _, by_rank in members:
        item = by_rank[min(by_rank)]
        where = file_line(item.file, item.line)
        if where and where not in sites:
            sites.append(where)
    lo = min(i.stats.min for _, b in members for i in b.values())
    hi = max(i.stats.max for _, b in members for i in b.values())
    nonfinite = sum(1 for _, b in members if any(i.stats.nan or i.stats.inf for i in b.values()))
    msg = (f"{len(names)} {role}s of {', '.join(classes)} layers hold values no initializer produces at the first "
           f"forward on {format_ranks(ranks)}: {shown}" + (f"; {nonfinite} of them NaN/Inf" if uninit and nonfinite
                                                           else "") + f"; finite range {_range(lo, hi)}")
    if first.init_range is not None:
        msg += f" where {first.init_source} gives {_range(*first.init_range)} for '{name0}'"
    if uninit:
        msg += ". They look uninitialized: " + _UNINIT.format(it="them")
    else:
        msg += ". Training with them turns every loss and gradient that touches them into NaN/Inf"
    if sites:
        msg += (f". Created at {', '.join(sites[:_SHOWN])}" + (" ..." if len(sites) > _SHOWN else "") +
                ": initialize these modules after to_empty() (call their reset_parameters())")
    detail: dict[str, Any] = {"params": names, "count": len(names), "role": role, "when": "first forward",
                              "cause": "uninitialized" if uninit else "nonfinite", "range": [lo, hi],
                              "tensors": [_tensor_detail(name, by_rank) for name, by_rank in members]}
    if first.file and first.line:  # the first place to fix: where the first such module is created
        detail.update(file=first.file, line=first.line, site=file_line(first.file, first.line))
    return Finding("bad_values", ranks, msg, detail)


TINY = 1e-30  # finite values all below this (and not all zero) come from left-over memory, not an initializer


def _garbage(by_rank: dict[int, FlaggedTensor]) -> bool:
    """Values only left-over memory holds, on some rank: huge, denormal, all tiny, or nothing but NaN."""
    return any(i.stats.huge or i.stats.denormal or 0 < i.stats.max_abs < TINY or i.stats.nan == i.stats.numel
               for i in by_rank.values())


def uninitialized_findings(per_rank: dict[int, list[FlaggedTensor]]) -> list[Finding]:
    """``bad_values`` findings for tensors no initializer could have produced, one per cause: the tensors left
    uninitialized (meta device + to_empty(), no init) are one finding however many there are, in model order, as
    are those holding NaN/Inf; a cause with a single tensor gets that tensor's own, more detailed, message."""
    merged: dict[str, dict[int, FlaggedTensor]] = {}
    for rank in sorted(per_rank):
        for item in per_rank[rank]:
            merged.setdefault(item.name, {})[rank] = item
    causes: dict[tuple[bool, str], list[tuple[str, dict[int, FlaggedTensor]]]] = {}
    for name, by_rank in merged.items():
        first = by_rank[min(by_rank)]
        causes.setdefault((_looks_uninitialized(first, by_rank), first.role), []).append((name, by_rank))
    # Left-over memory holds NaN bit patterns too: a NaN parameter of a layer class whose other parameters look
    # uninitialized, and that looks like left-over memory on some rank, has the same cause (the initializer that
    # never ran), so it joins them in model order.
    uninit, nonfinite = causes.get((True, "parameter")), causes.get((False, "parameter"))
    if uninit and nonfinite:
        classes = {b[min(b)].module_class for _, b in uninit}
        joined = {name for name, b in nonfinite if b[min(b)].module_class in classes and _garbage(b)}
        if joined:
            keep = {name for name, _ in uninit} | joined
            causes[(True, "parameter")] = [(n, b) for n, b in merged.items() if n in keep]
            rest = [(n, b) for n, b in nonfinite if n not in joined]
            if rest:
                causes[(False, "parameter")] = rest
            else:
                del causes[(False, "parameter")]
    findings: list[Finding] = []
    for (uninit, _), members in causes.items():
        if len(members) == 1:
            findings.append(_one_tensor_finding(*members[0]))
        else:
            findings.append(_grouped_finding(members, uninit))
    return findings


@dataclass
class BadEvent:
    """A rank's first step with a non-finite loss or gradient (local values, before any cross-rank check)."""

    step: int
    counter: str  # "optimizer.step" or "backward"
    loss_bad: bool  # this rank's own loss (what it passed to backward) was NaN/Inf
    loss_value: str | None = None  # "nan", "inf", "-inf"
    grad_params: list[str] = field(default_factory=list)  # non-finite gradients, in backward order
    file: str | None = None  # the user's backward() line
    line: int | None = None
    # Past the dense steps gradients are checked every few steps (rank/autocheck/nan_watch.py): the last step
    # whose gradients were checked and finite, so the first bad gradient lies after it.
    last_clean_grads: int | None = None
    # Where the bad loss came from on this rank (rank/autocheck/nan_origin.py): the batch, a module, the loss.
    origin: dict[str, Any] | None = None
    # The ranks of the DDP group whose gradients these were too (rank/autocheck/ddp_grad_share.py: one rank checks
    # a step's gradients for the group); set on the checking rank's event
    replicated: list[int] = field(default_factory=list)
    # On an event given to a rank of that group by :func:`spread_replicated`: the rank that checked
    checked_on: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BadEvent:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def spread_replicated(events: Mapping[int, BadEvent | None]) -> dict[int, BadEvent | None]:
    """Each rank of a DDP group gets the bad gradients one rank of the group found for all (they hold the same
    all-reduced gradients; only one checked that step): as its event at that step when its own came later or not at
    all, or added to its own event at that step when that one has no gradients (a bad loss on another rank's turn is
    checked in full, so this is a rank whose loss was finite)."""
    out = dict(events)
    for rank, e in sorted(events.items()):
        if e is None or not e.replicated or not e.grad_params:
            continue
        for peer in e.replicated:
            own = out.get(peer)
            if peer == rank or own is not None and (own.step < e.step or own.step == e.step and own.grad_params):
                continue
            if own is not None and own.step == e.step:
                out[peer] = replace(own, grad_params=list(e.grad_params), checked_on=rank)
            else:
                out[peer] = BadEvent(e.step, e.counter, False, None, list(e.grad_params), e.file, e.line,
                                     e.last_clean_grads, checked_on=rank)
    return out


def first_bad_finding(events: dict[int, BadEvent | None], steps_done: dict[int, int]) -> Finding | None:
    """Merge the ranks' first-bad events into one ``bad_values`` finding (None when every rank stayed finite).

    ``steps_done[r]``: how many steps rank r completed (to tell "clean at that step" from "never got there").
    The ranks whose own loss was bad at the earliest step are the origin; a NaN there on some ranks only points
    to those ranks' data (their batch), since every rank runs the same model on the same parameters.
    """
    bad = {r: e for r, e in spread_replicated(events).items() if e is not None}
    if not bad:
        return None
    step = min(e.step for e in bad.values())
    at_step = {r: e for r, e in bad.items() if e.step == step}
    counter = next(iter(at_step.values())).counter
    loss_ranks = sorted(r for r, e in at_step.items() if e.loss_bad)
    grad_ranks = sorted(r for r, e in at_step.items() if e.grad_params)
    everyone = sorted(set(events) | set(steps_done))
    clean = [r for r in everyone if r not in at_step and steps_done.get(r, 0) > step]
    origin = loss_ranks or sorted(at_step)
    first = at_step[origin[0]]
    where = file_line(first.file, first.line)
    unit = "optimizer step" if counter == "optimizer.step" else "backward() call"
    parts = [f"first NaN/Inf at step {step} (0-based {unit} count) on {format_ranks(origin)}"]
    if loss_ranks:
        values = sorted({at_step[r].loss_value or "nan" for r in loss_ranks})
        parts.append(f"the loss passed to backward()" + (f" at {where}" if where else "") +
                     f" was {'/'.join(values)} on {format_ranks(loss_ranks)}")
    first_param = next((at_step[r].grad_params[0] for r in origin if at_step[r].grad_params), None)
    if first_param is None and grad_ranks:
        first_param = at_step[grad_ranks[0]].grad_params[0]
    if first_param:
        parts.append(f"first non-finite gradient in backward order: '{first_param}' (on "
                     f"{format_ranks(grad_ranks)})")
    origin_of = next((r for r in loss_ranks if at_step[r].origin), None)
    found = at_step[origin_of].origin if origin_of is not None else None
    said = origin_text(found, origin_of) if found is not None else None
    if said:
        parts.append(said)
    msg = "; ".join(parts)
    if loss_ranks and len(loss_ranks) < len(everyone):
        finite_loss = sorted(r for r in everyone if r not in loss_ranks
                             and (r in at_step or steps_done.get(r, 0) > step))
        if finite_loss:
            msg += f". {format_ranks(finite_loss).capitalize()} had a finite loss at that step"
            via = [r for r in finite_loss if r in grad_ranks]
            if via:
                msg += (f" ({'its' if len(via) == 1 else 'their'} gradients on {format_ranks(via)} got the NaN/Inf "
                        "through the gradient reduction)")
        whose = "that rank's" if len(loss_ranks) == 1 else "those ranks'"
        msg += (f". A NaN/Inf on {'one rank' if len(loss_ranks) == 1 else 'some ranks'} only points to {whose} "
                f"data: check the batch {format_ranks(loss_ranks)} loaded at step {step}")
    elif not loss_ranks:
        msg += (". Every loss was finite: the NaN/Inf arose in backward (overflow, division by zero, log of 0) or "
                "came from a parameter")
        since = [at_step[r].last_clean_grads for r in grad_ranks if at_step[r].last_clean_grads is not None]
        if since:
            msg += (f" (after the first steps gradients are checked every few steps: they were last finite at "
                    f"step {max(since)}, so the first bad one lies in steps {max(since) + 1}-{step})")
    if clean:
        msg += f". {format_ranks(clean).capitalize()} stayed finite at that step"
    detail: dict[str, Any] = {
        "step": step, "counter": counter, "origin_ranks": origin, "loss_ranks": loss_ranks,
        "grad_ranks": grad_ranks, "first_param": first_param, "clean_ranks": clean,
        "events": {str(r): e.to_json() for r, e in sorted(bad.items())},
    }
    if where:
        detail.update(file=first.file, line=first.line, site=where)
    if found is not None:
        detail["origin"] = dict(found, rank=origin_of)
        made = origin_site(found)
        if made is not None:  # the line that made the first non-finite value, not the backward() it reached
            detail.update(file=made[0], line=made[1], site=file_line(*made), backward_site=where)
    return Finding("bad_values", origin, msg, detail)


def loss_value_name(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def model_check_verdict(states: Mapping[int, dict[str, Any]], runs: Mapping[int, RunFields],
                        facts: Mapping[str, Any]) -> Verdict:
    """The ``model_check`` check from the first-forward checks the ranks ran (rank/autocheck/discovery.py), and the
    warnings those wrote (parameters on mixed meshes in a correct model)."""
    model_checks = [s.get("model_checks", []) for s in states.values()]
    warnings = notes_in({r: s.get("warnings") for r, s in states.items()})
    if not any(model_checks):
        return Verdict(checks=[CheckResult("model_check", True, 0.0, note="no model passed to fully_shard/DDP/"
                                           "parallelize_module/distribute_module")], notes=warnings)
    seconds = max(sum(c["seconds"] for c in mc) for mc in model_checks)
    roots = sorted({c["root"] for mc in model_checks for c in mc})
    bad = sum(c["findings"] for mc in model_checks for c in mc)
    # A model whose own forward never ran is checked at the first optimizer.step(); its label says so.
    when = "" if any(" (at " in r for r in roots) else " at the first forward"
    return Verdict(checks=[CheckResult("model_check", bad == 0, seconds,
                                       note=f"found by itself{when}: {', '.join(roots)}")], notes=warnings)


def first_bad_verdict(states: Mapping[int, dict[str, Any]], runs: Mapping[int, RunFields],
                      facts: Mapping[str, Any]) -> Verdict:
    """The first-NaN finding and the ``bad_values`` check from each rank's first bad step (nan_watch.py)."""
    events = {r: BadEvent.from_json(states[r]["first_bad"]) if (states.get(r) or {}).get("first_bad") else None
              for r in runs}
    steps = {r: run.steps for r, run in runs.items()}
    finding = first_bad_finding(events, steps)
    seconds = max((float(s.get("seconds", 0.0)) for s in states.values()), default=0.0)
    counter = next(iter(runs.values())).counter
    done = max(steps.values())
    note = ("" if finding is not None else "no backward() ran" if done == 0 else
            f"loss and gradients finite on every {counter} ({done} steps)")
    return Verdict([finding] if finding is not None else [],
                   [CheckResult("bad_values", finding is None, seconds, note=note)])


def fold_first_bad(findings: list[Finding]) -> list[Finding]:
    """Parameters left uninitialized at the first forward explain the first NaN/Inf of training: one finding for the
    one cause, the first bad step told in it (and kept in ``detail.first_bad``) instead of a second finding."""
    uninit = next((f for f in findings if f.kind == "bad_values" and f.detail.get("cause") == "uninitialized"), None)
    first = next((f for f in findings if f.kind == "bad_values" and "counter" in f.detail), None)
    if uninit is None or first is None:
        return findings
    d = first.detail
    where = f" ({d['site']})" if d.get("site") else ""
    when = "at once: the first bad" if d["step"] == 0 else "later: the first bad"
    uninit.message += (f". Training went NaN/Inf {when} {d['counter']} is step {d['step']}{where}, "
                       f"on {format_ranks(d['origin_ranks'])}")
    uninit.detail["first_bad"] = dict(d, message=first.message)
    return [f for f in findings if f is not first]
