"""Replica drift, from the ranks' fingerprints after each early optimizer step (pure: no process group).

    python -m distcheck run --nproc 2 -- train.py      # rank/autocheck/replica_drift.py writes, this compares

Each rank's ``autocheck-rank<R>.json`` holds, in the ``replica_drift`` check's ``checked``, one row per
fingerprinted point: the baseline at the first forward (step -1), then one per optimizer step: every replicated
parameter as ``[name, replica key, dtype, shape, chunk bounds, chunk sums]``, plus how many backward() calls that
step had and how many of them ran under DDP's ``no_sync()``, and the line of a forward that went around DDP
(``model.module(x)``) when the step was built on one. Parameters the baseline already shows different are the first
forward's ``tensor_divergence`` (check_model), not drift. The first step after which some parameter differs
between ranks with equal keys is one ``tensor_divergence`` finding for all the parameters it touched.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from distcheck.analysis.check_verdict import Verdict
from distcheck.analysis.replicas import Entry, Fingerprint, find_divergences
from distcheck.contract.autocheck_file import RunFields
from distcheck.contract.findings import CheckResult, Finding, format_names, format_ranks
from distcheck.contract.site import file_line

FIRST_NAMES = 4  # names spelled out in the message; detail.params has them all

_WHY = {
    "ddp": ("DDP did not average their gradients over the ranks (no_sync(), require_backward_grad_sync=False, "
            "or gradients changed after backward())"),
    "tp": ("a plain (non-DTensor) parameter of a tensor-parallel model got a different gradient on each rank, "
           "e.g. a norm applied to sequence-sharded activations: give it a plan entry (SequenceParallel()) so its "
           "gradient is reduced"),
    "fsdp1": ("FSDP1's replicas (NO_SHARD, or HYBRID_SHARD's replicate group) got different gradients or updates: a "
              "gradient changed on one rank after FSDP reduced it, or an update under a rank condition"),
    "fsdp1_ignored": ("a parameter of FullyShardedDataParallel's ignored_modules got a different gradient on each "
                      "rank: FSDP1 never reduces it, so all-reduce its gradient yourself (and divide by the world "
                      "size) before optimizer.step(), or let FSDP manage it"),  # when its wrap site is unknown
    "dtensor": ("Replicate DTensor parameters (HSDP's replicate dim, a TP layer's replicated bias) got different "
                "gradients or updates on different ranks: a gradient not reduced over the replicate mesh dim, or "
                "changed on one rank after the reduction"),
}


def fingerprint_row(name: str, key: Any, fp: Fingerprint) -> list:
    return [name, key, fp.dtype, list(fp.shape), list(fp.bounds), list(fp.sums)]


def _entries(row: dict[str, Any]) -> dict[str, Entry]:
    out = {}
    for name, key, dtype, shape, bounds, sums in row.get("params", []):
        fp = Fingerprint(dtype, tuple(shape), tuple(bounds), tuple(sums))
        out[name] = Entry(name, "parameter", json.dumps(key), fp)
    return out


def drift_finding(states: Mapping[int, dict[str, Any]]) -> tuple[Finding | None, int]:
    """The first step's drift as one finding (None when replicas stayed identical), and the steps compared, from
    ``{rank: the replica_drift check's state}``."""
    rows: dict[int, dict[int, dict[str, Any]]] = {}  # step -> rank -> row
    for rank, state in states.items():
        for row in state.get("checked", []):
            rows.setdefault(int(row["step"]), {})[rank] = row
    if -1 not in rows:
        return None, 0
    differed = {d.name for d in _divergences(rows[-1])}  # the first forward's finding, not drift
    steps = sorted(s for s in rows if s >= 0)
    for step in steps:
        divs = [d for d in _divergences(rows[step]) if d.name not in differed]
        if divs:
            return _finding(step, divs, rows[step]), steps.index(step) + 1
    return None, len(steps)


def _divergences(by_rank: dict[int, dict[str, Any]]) -> list:
    per_rank = {r: list(_entries(row).values()) for r, row in by_rank.items()}
    # A name some rank lacks (a rank that crashed mid-write, pipeline stages) is not drift: compare shared names.
    shared = set.intersection(*({e.name for e in es} for es in per_rank.values())) if per_rank else set()
    return find_divergences({r: [e for e in es if e.name in shared] for r, es in per_rank.items()})


def _site(detail: dict | None) -> tuple[str | None, int | None]:
    return (detail.get("file"), detail.get("line")) if detail else (None, None)


def _where(file: str | None, line: int | None) -> str:
    return file_line(file, line) or "?"


def _finding(step: int, divs: list, by_rank: dict[int, dict[str, Any]]) -> Finding:
    names = [d.name for d in divs]
    ranks = sorted({r for d in divs for r in d.blamed})
    row = by_rank[min(by_rank)]
    step_file, step_line = _site(row.get("site"))
    no_sync = next((r for _, r in sorted(by_rank.items())
                    if r.get("backwards") and r.get("unsynced") == r.get("backwards")), None)
    bypass = next((r["ddp_bypass_site"] for _, r in sorted(by_rank.items()) if r.get("ddp_bypass_site")), None)
    shown = format_names(names, FIRST_NAMES)
    count = f"{len(names)} parameter{'s' if len(names) != 1 else ''}"
    ordinal = "the first optimizer.step()" if step == 0 else f"optimizer.step() #{step}"
    message = (f"{count} that must be identical across replicas differ{'s' if len(names) == 1 else ''} between "
               f"{format_ranks(sorted({r for d in divs for r in d.ranks}))} after {ordinal} "
               f"({_where(step_file, step_line)}), though they agreed before it: {shown}.")
    cause = None
    file, line = step_file, step_line
    if bypass is not None:
        file, line = _site(bypass)
        message += (f"\nDDP never averaged the gradients: the step's forward called the wrapped module directly at "
                    f"{_where(file, line)} (model.module(...)), so DistributedDataParallel's own forward, which arms "
                    "the gradient all-reduce of the next backward(), never ran in that step. Call model(x), not "
                    "model.module(x), for the training forward.")
        cause = "ddp_bypassed"
    elif no_sync is not None:
        file, line = _site(no_sync.get("no_sync_site"))
        n = no_sync["backwards"]
        message += (f"\nGradients were not all-reduced: {'the' if n == 1 else 'all'} {n} backward() "
                    f"call{'s' if n != 1 else ''} before that step ran under no_sync() at {_where(file, line)}; "
                    "run the last micro-batch's backward() outside no_sync() so DDP (or FSDP) reduces the gradients.")
        cause = "no_sync"
    elif _ignored_site(divs, by_rank) is not None:
        file, line = _ignored_site(divs, by_rank)
        them = "its gradient" if len(names) == 1 else "their gradients"
        message += (f"\nFSDP1 never reduces {them}: {'it is' if len(names) == 1 else 'they are'} in the "
                    f"ignored_modules of FullyShardedDataParallel(...) at {_where(file, line)}, so each rank "
                    f"applied its own; all-reduce {them} yourself (and divide by the world size) before "
                    "optimizer.step(), or let FSDP manage the module.")
        cause = "fsdp1_ignored"
    else:
        kinds = sorted({key[0] if isinstance(key[0], str) else "dtensor" for key in _keys(divs, by_rank)})
        message += "\nLikely cause: " + "; or ".join(_WHY[k] for k in kinds if k in _WHY) + "."
    detail = {"file": file, "line": line, "step": step, "count": len(names), "params": names, "cause": cause,
              "groups": {d.name: d.groups for d in divs},
              "odd_chunks": {d.name: {str(r): c for r, c in d.odd.items()} for d in divs},
              "step_site": row.get("site"),
              "backwards": {str(r): [x.get("backwards"), x.get("unsynced")] for r, x in sorted(by_rank.items())}}
    return Finding("tensor_divergence", ranks, message, detail)


def _ignored_site(divs: list, by_rank: dict[int, dict[str, Any]]) -> tuple[str, int] | None:
    """Where the FSDP1 model whose ignored_modules hold every drifted parameter was wrapped (the key's third item:
    ``["fsdp1_ignored", ranks, [file, line]]``), or None when some of them are something else."""
    keys = _keys(divs, by_rank)
    sites = {tuple(k[2]) for k in keys if k and k[0] == "fsdp1_ignored" and len(k) > 2 and k[2]}
    if len(sites) != 1 or any(not k or k[0] != "fsdp1_ignored" for k in keys):
        return None
    file, line = next(iter(sites))
    return file, line


def _keys(divs: list, by_rank: dict[int, dict[str, Any]]) -> list:
    names = {d.name for d in divs}
    row = by_rank[min(by_rank)]
    return [key for name, key, *_ in row.get("params", []) if name in names]


_FROZEN = {
    "gradient_sync_off": ("every gradient was None: FSDP2's gradient reduction was turned off with "
                          "set_requires_gradient_sync(False) at {sync} and never turned back on, so FSDP2 keeps the "
                          "unreduced gradients to itself and never writes the sharded .grad the optimizer reads. Call "
                          "set_requires_gradient_sync(True) before the last micro-batch's backward()"),
    "requires_grad_false": ("all {params} parameters of the optimizer (built at {built}) have requires_grad=False: "
                            "nothing gets a gradient. Unfreeze what should train (requires_grad_(True)) before "
                            "building the optimizer"),
    "no_params": ("the optimizer (built at {built}) holds no parameters: build it over the model's parameters "
                  "(an exhausted generator or a filter that kept nothing gives an empty list)"),
    "built_before_wrap": ("every gradient was None: the optimizer was built at {built}, before {wrap_call} at "
                          "{wrapped} replaced the model's parameters with new ones, so it holds the old tensors, "
                          "which no backward() reaches. Build the optimizer after {wrap_call}, over the "
                          "parameters it put in the model (model.parameters())"),
    "no_backward": "every gradient was None: no backward() ran before the step",
    "no_grad": ("every gradient was None though backward() ran: it never reached the optimizer's parameters (a loss "
                "computed under torch.no_grad() or detached, or an optimizer over another model's parameters)"),
}


def frozen_finding(states: Mapping[int, list[dict[str, Any]]]) -> Finding | None:
    """Ranks on which no checked optimizer.step() had anything to update (rank/autocheck/frozen_step.py), from
    ``{rank: the frozen check's rows}``: one finding naming the cause, or None when some step updated something on
    every rank."""
    frozen: dict[int, list[dict[str, Any]]] = {}
    for rank, rows in sorted(states.items()):
        rows = rows or []
        if rows and all(r.get("cause") for r in rows):
            frozen[rank] = rows
    if not frozen:
        return None
    rows = frozen[min(frozen)]
    first = rows[0]
    cause = first["cause"]
    step_file, step_line = _site({"file": first["site"][0], "line": first["site"][1]} if first.get("site") else None)
    sync = first.get("sync_off") or [None, None]
    built = first.get("built") or [None, None]
    wrapped = first.get("wrap_site") or [None, None]
    why = _FROZEN.get(cause, "nothing had a gradient").format(
        sync=_where(*sync), built=_where(*built), params=first.get("params"), wrapped=_where(*wrapped),
        wrap_call=first.get("wrap_call") or "the parallelizing call")
    n = len(rows)
    message = (f"optimizer.step() changed no parameter on {format_ranks(sorted(frozen))} in the first "
               f"{n} step{'s' if n != 1 else ''} ({first.get('optimizer', 'optimizer')} at "
               f"{_where(step_file, step_line)}): {why}.")
    file, line = {"gradient_sync_off": sync, "requires_grad_false": built, "no_params": built,
                  "built_before_wrap": built}.get(cause, [step_file, step_line])
    detail = {"cause": cause, "file": file, "line": line, "steps": n, "step_site": first.get("site"),
              "params": first.get("params"), "per_rank": {str(r): [x.get("cause") for x in rs]
                                                          for r, rs in frozen.items()}}
    if cause == "built_before_wrap":  # the call that replaced the parameters the optimizer holds
        detail.update(wrap_call=first.get("wrap_call"), wrap_site=first.get("wrap_site"), built=first.get("built"))
    return Finding("bad_values", sorted(frozen), message, detail)


# -- the entries of analysis/check_table.py ------------------------------------------------------------------------

def frozen_verdict(states: Mapping[int, list[dict[str, Any]]], runs: Mapping[int, RunFields],
                   facts: Mapping[str, Any]) -> Verdict:
    """The ``frozen_model`` check; its fact ``frozen``: no step updated anything on some rank."""
    frozen = frozen_finding(states)
    checked = max((len(rows or []) for rows in states.values()), default=0)
    if frozen is None and not checked:
        return Verdict()
    return Verdict([frozen] if frozen is not None else [],
                   [CheckResult("frozen_model", frozen is None, 0.0,
                                note="" if frozen is not None else
                                f"every rank's optimizer had gradients to apply in the first {checked} "
                                f"step{'s' if checked != 1 else ''}")],
                   facts={"frozen": frozen is not None})


def prewrap_verdict(states: Mapping[int, dict[str, Any]], runs: Mapping[int, RunFields],
                    facts: Mapping[str, Any]) -> Verdict:
    """The prewrap check reports by itself, in the ranks; its states tell the drift check one fact,
    ``differed_before_wrap``: some parallelizing call found the ranks' models different."""
    differed = any(not p.get("identical", True) for s in states.values() for p in s.get("points", []))
    return Verdict(facts={"differed_before_wrap": differed})


def drift_verdict(states: Mapping[int, dict[str, Any]], runs: Mapping[int, RunFields],
                  facts: Mapping[str, Any]) -> Verdict:
    """The drift finding and the ``replica_drift`` check; not judged under a frozen model (its replicas' comparison
    would pass for the wrong reason) nor, when they drifted, after models that differed before parallelizing."""
    if facts.get("frozen"):
        return Verdict()
    drift, compared = drift_finding(states)
    if drift is not None and facts.get("differed_before_wrap"):
        # The model already differed across ranks before it was parallelized (its own finding): replicas fed by
        # those different layers get different gradients, a consequence and not a second cause.
        return Verdict(checks=[CheckResult("replica_drift", True, 0.0, note="not judged: the ranks' models differed "
                                           "before parallelizing (see that finding), so their replicas' updates "
                                           "differ too")])
    if not compared and drift is None:
        return Verdict()
    seconds = max(float(s.get("seconds", 0.0)) for s in states.values())
    return Verdict([drift] if drift is not None else [],
                   [CheckResult("replica_drift", drift is None, seconds,
                                note="" if drift is not None else
                                f"replicated parameters identical on every rank after {compared} optimizer "
                                f"step{'s' if compared != 1 else ''}")])
