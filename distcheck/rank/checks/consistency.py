"""The pre-launch ``consistency`` check: one registry of checks, run in order on every rank.

    torchrun --nproc-per-node 2 -m distcheck consistency [--model pkg.mod:fn] [--parallel fsdp|ddp|tp] [--steps K]

Checks: environment, collectives, model_consistency (replicas identical before parallelizing), parallel_vs_reference,
replicated_state (after the steps). Each check returns Findings; at the end every rank's findings travel once
through the side channel and rank 0 composes the report, which its node watcher publishes
(commands/consistency.py). A rank that dies or stalls becomes a finding, not a hang.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from distcheck.rank.checks import collectives as collective_sanity

from distcheck.rank.checks import envinfo

from distcheck.rank.checks import reference
from distcheck.analysis.hang import hang_finding
from distcheck.analysis.envdiff import diff_env, render_env_table
from distcheck.rank.checks.batches import BatchMaker, batch_maker
from distcheck.errors import ChannelTimeout, UsageError
from distcheck.options import ConsistencyOptions
from distcheck.analysis.replicas import group_findings
from distcheck.contract.findings import CheckResult, Finding, format_ranks
from distcheck.rank.checks.models import build_model
from distcheck.rank.checks.replicas import compare_replicas
from distcheck.contract.report import Report
from distcheck.rank.runtime import Session
from distcheck.rank.usersite import forward_site, param_site

SEED = 1234


@dataclass
class Context:
    session: Session
    options: ConsistencyOptions  # timeout: the backstop of every wait (options.backstop)
    model: nn.Module | None = None
    maker: BatchMaker | None = None
    outcome: reference.Outcome | None = None
    sections: dict[str, str] = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    results: list = field(default_factory=list)  # (check name, seconds, findings) of the checks run so far


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], list[Finding]]
    note_at_world_1: str  # what the check cannot show with a single rank


def check_environment(ctx: Context) -> list[Finding]:
    s = ctx.session
    config = {"model": ctx.options.model, "parallel": ctx.options.parallel, "steps": str(ctx.options.steps)}
    snaps = s.channel.exchange("env", envinfo.snapshot(s.device, s.backend, config))
    per_rank = dict(enumerate(snaps))
    ctx.sections["environment"] = render_env_table(per_rank, envinfo.HOST_SPECIFIC)
    ctx.data["environment"] = per_rank
    return diff_env(per_rank, envinfo.HOST_SPECIFIC)


def check_collectives(ctx: Context) -> list[Finding]:
    results = collective_sanity.run_local(ctx.session, ctx.options.timeout)
    gathered = ctx.session.channel.exchange("collectives", results)
    return collective_sanity.findings_from([r for rank_results in gathered for r in rank_results])


def check_model_consistency(ctx: Context) -> list[Finding]:
    # Same seed on every rank: any difference is init that depends on the rank (or on something else local).
    ctx.model = build_model(ctx.options.model, seed=SEED).to(ctx.session.device)
    ctx.maker = batch_maker(ctx.model, ctx.options.model)
    items = [(n, "parameter", p) for n, p in ctx.model.named_parameters()]
    items += [(n, "buffer", b) for n, b in ctx.model.named_buffers()]
    findings = compare_replicas("model", items, ctx.session.channel, list(range(ctx.session.world_size)),
                                context="before parallelizing (same seed on every rank)")
    for f in findings:
        _add_site(f, param_site(ctx.model, f.detail.get("name", "")), "created in")
    return one_per_cause(findings, "before parallelizing (same seed on every rank)")


def one_per_cause(findings: list[Finding], where: str) -> list[Finding]:
    """Tensors that differ in one check share one cause (the seed, the step): one ``tensor_divergence`` listing
    them all (analysis/replicas.group_findings), which keeps the first one's name, site and whole message."""
    divs = [f for f in findings if f.kind == "tensor_divergence" and "name" in f.detail]
    if len(divs) <= 1:
        return findings
    grouped = group_findings(findings, where)
    first = divs[0]
    for f in grouped:
        if f.kind == "tensor_divergence" and f.detail.get("count", 0) > 1:
            f.message += f" The first: {first.message}"
            f.detail.update({k: first.detail[k] for k in ("name", "role", "file", "line", "site") if k in first.detail})
    return grouped


def _add_site(finding: Finding, site, label: str) -> None:
    if site:
        finding.message += f" ({label} {site})"
        finding.detail.update(site.detail())


def check_parallel_vs_reference(ctx: Context) -> list[Finding]:
    if ctx.model is None:
        raise RuntimeError("the model was not built (model_consistency failed)")
    o = ctx.options
    site = forward_site(ctx.model)
    ctx.outcome = reference.run(ctx.session, ctx.model, o.parallel, ctx.maker, o.steps, SEED, o.rtol, o.atol)
    for f in ctx.outcome.findings:
        _add_site(f, site, "forward at")
    if ctx.outcome.rows:
        ctx.sections[f"parallel ({o.parallel}) vs 1-rank reference"] = reference.render_rows(ctx.outcome.rows)
        ctx.data["reference_steps"] = [vars(r) for r in ctx.outcome.rows]
    return ctx.outcome.findings


def check_placements(ctx: Context) -> list[Finding]:
    """The placement table of the parallelized model, and parameters its sharding left out."""
    from distcheck.rank.checks import placement
    from distcheck.analysis.placement import coverage_findings

    if ctx.outcome is None:
        raise RuntimeError("the parallel run did not complete")
    model = ctx.outcome.parallel.inner
    rows = placement.describe_model(model)
    ctx.sections["placements"] = placement.render_placement_table(rows)
    ctx.data["placements"] = placement.placement_json(rows)
    fsdp = [name for name, _ in placement.fsdp_modules(model)]
    return coverage_findings(rows, fsdp, list(range(ctx.session.world_size)))


def check_replicated_state(ctx: Context) -> list[Finding]:
    if ctx.outcome is None:
        raise RuntimeError("the parallel run did not complete")
    inner = ctx.outcome.parallel.inner
    items = []
    for name, p in inner.named_parameters():
        items.append((name, "parameter", p))
        if p.grad is not None:
            items.append((f"{name}.grad", "gradient", p.grad))
    items += [(n, "buffer", b) for n, b in inner.named_buffers()]
    items.append(("torch.random (CPU RNG state)", "rng state", torch.get_rng_state()))
    if ctx.session.device.type == "cuda":
        items.append(("torch.cuda.random (RNG state)", "rng state", torch.cuda.get_rng_state(ctx.session.device)))
    where = f"after {ctx.options.steps} {ctx.options.parallel} steps"
    return one_per_cause(compare_replicas("replicated", items, ctx.session.channel,
                                          list(range(ctx.session.world_size)), context=where), where)


CHECKS = (
    Check("environment", check_environment, "1 rank: nothing to compare"),
    Check("collectives", check_collectives, "1 rank: collectives are trivial"),
    Check("model_consistency", check_model_consistency, "1 rank: no replicas to compare"),
    Check("parallel_vs_reference", check_parallel_vs_reference, "1 rank: the parallel run is the reference"),
    Check("placements", check_placements, ""),
    Check("replicated_state", check_replicated_state, "1 rank: no replicas to compare"),
)


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stops every rank when one exits): write what we know, then exit."""


def run_checks(session: Session, options: ConsistencyOptions, ctx: Context | None = None,
               before_check: Callable[[str, list], None] | None = None,
               ) -> tuple[list[tuple[str, float, list[Finding]]], Context]:
    """Run every check on this rank. Returns (name, seconds, findings) per check that ran.

    ``before_check(name, results_so_far)`` runs before each check (rank 0 hands a partial report to its
    watcher there, so a job killed mid-check still leaves a report that says how far it got).
    """
    ctx = ctx or Context(session, options)
    results = ctx.results
    for check in CHECKS:
        if before_check is not None:
            before_check(check.name, results)
        start = time.perf_counter()
        try:
            findings = check.run(ctx)
        except UsageError:
            raise  # bad --model/--parallel input: exit 2 on every rank, not a finding
        except ChannelTimeout as exc:
            findings = [hang_finding(exc.missing_ranks,
                                     f"{format_ranks(exc.missing_ranks)} did not reach the {check.name} check "
                                     f"within {exc.seconds:g}s (dead or stuck): later checks were skipped",
                                     timeout=exc.seconds, check=check.name, missing_ranks=exc.missing_ranks)]
            results.append((check.name, time.perf_counter() - start, findings))
            break
        except Exception as exc:
            findings = [failure_finding(ctx, check.name, exc)]
            results.append((check.name, time.perf_counter() - start, findings))
            break
        results.append((check.name, time.perf_counter() - start, findings))
    return results, ctx


def failure_finding(ctx: Context, check: str, exc: Exception) -> Finding:
    """A check that raised: torch's error translated where distcheck knows it (the model's parameter names for
    DDP's errors), torch's text kept in detail. The message names no rank, so ranks failing alike merge into one."""
    from distcheck.analysis.torch_errors import first_line
    from distcheck.rank.error_context import explain

    tb = traceback.format_exc()
    ddp_model = ctx.model if ctx.options.parallel == "ddp" else None
    translated = explain(exc, ddp_model=ddp_model)
    text = translated["message"] if translated else first_line(str(exc))
    detail = {"check": check, "exception": type(exc).__name__, "error": str(exc), "traceback": tb}
    detail.update((translated or {}).get("detail") or {})
    return Finding("rank_failure", [ctx.session.rank], f"raised {type(exc).__name__} in the {check} check: {text}",
                   detail)


def merge(all_ranks: list[list[tuple[str, float, list[Finding]]]], rank0: list[tuple[str, float, list[Finding]]],
          world_size: int) -> tuple[list[CheckResult], list[Finding]]:
    """Pure: one CheckResult per check (rank 0's time) and the de-duplicated findings of all ranks."""
    notes = {c.name: c.note_at_world_1 for c in CHECKS}
    findings: list[Finding] = []
    failed: set[str] = set()
    merged: dict[tuple[str, str], Finding] = {}
    for results in all_ranks:
        for name, _, fs in results:
            for f in fs:
                failed.add(name)
                key = (f.kind, f.message)
                if key in merged:  # every rank found it, or several ranks failed alike: one finding, all ranks
                    merged[key].ranks = sorted(set(merged[key].ranks) | set(f.ranks))
                else:
                    merged[key] = f
                    findings.append(f)
    checks = [CheckResult(name, name not in failed, seconds, notes.get(name, "") if world_size == 1 else "")
              for name, seconds, _ in rank0]
    ran = {name for name, _, _ in rank0}
    checks += [CheckResult(c.name, False, 0.0, "skipped: an earlier check could not complete")
               for c in CHECKS if c.name not in ran]
    return checks, findings


def build_report(session: Session, options: ConsistencyOptions, local: list, ctx: Context) -> Report:
    try:
        gathered = session.channel.exchange("consistency/results", local)
    except ChannelTimeout as exc:
        missing = exc.missing_ranks
        gathered = [local]
        lost = hang_finding(missing, f"{format_ranks(missing)} never reported their results within "
                                     f"{exc.seconds:g}s (dead or stuck)", timeout=exc.seconds, missing_ranks=missing)
        local = local + [("results", 0.0, [lost])]
    checks, findings = merge(gathered, local if session.rank == 0 else gathered[0], session.world_size)
    return Report(options.command, session.world_size, findings, checks, {}, ctx.data, ctx.sections)


def interrupted_report(session: Session, options: ConsistencyOptions, ctx: Context, current: str, why: str,
                       suspects: list[int]) -> Report:
    """Rank 0's report when the run cannot finish: what completed, and a finding saying where it stopped."""
    ranks = suspects or list(range(session.world_size))
    # The watchdog replaces this finding with its own diagnosis when it is the one that ended the run: it names the
    # check marked "interrupted" below (supervise/node_report.superseded_by_diagnosis).
    stopped = Finding("rank_failure", ranks, f"the consistency run stopped during the '{current}' check: {why}",
                      {"check": current, "suspect_ranks": suspects})
    checks, findings = merge([ctx.results], ctx.results, session.world_size)
    checks = [c if c.name != current else CheckResult(current, False, 0.0, "interrupted") for c in checks]
    return Report(options.command, session.world_size, findings + [stopped], checks, {}, ctx.data, ctx.sections)


def ranks_behind(session: Session) -> list[int]:
    """Ranks this rank is still waiting for in a side-channel exchange (dead, or stuck before it)."""
    try:
        return session.channel.missing()
    except Exception:  # the store itself may be gone with the launcher
        return []


def report_files(report_dir: Path) -> dict[str, str]:
    """The artifacts to list: every file but the ranks' hook files, empty dump files and progress counters
    (flight-rank<R>.status), which the ranks remove as they exit (contract/files.py)."""
    from distcheck.contract import files

    hooks = {p.name for p in files.hook_files(report_dir)}
    hooks |= {p.name for p in files.rank_files(report_dir, "flight_status").values()}
    return {p.name: p.name for p in sorted(report_dir.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.name not in hooks and p.stat().st_size > 0}
