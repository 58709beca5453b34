"""A rank that ran fewer training steps than the others: each rank's backward() and optimizer.step() counts.

    python -m distcheck run --nproc 2 -- fixtures/ddp_skipped_step.py   # the hang says rank 1 ran one step fewer

A rank that skips a step the others run (``continue`` on an empty batch, a rank-local early exit) leaves DDP's
gradient all-reduces pairing different steps from then on (each averages one rank's step with another's) until
the ranks' counts run out, and the job hangs with one rank in its bucket all-reduce at ``backward()`` and the other
in whatever comes after its loop. Every rank's Flight Recorder dump counts its ``backward()`` calls and its
optimizers' ``step()`` calls over the whole run (rank/flight_recorder.py; analysis/trace_events.py puts them in
``RankTrace.step_counts``); where they differ, the hang says so. Which step a rank skipped is not in what torch
records (nothing numbers a training step): the counts, and that every all-reduce after the skip paired
different steps, are. Pure.
"""
from __future__ import annotations

from typing import Any, Mapping

from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract.site import file_line

KINDS = (("backward", "backward()"), ("optimizer_step", "optimizer.step()"))


def step_counts(traces: Mapping[int, Any]) -> dict[int, dict[str, int]]:
    """``{rank: {"backward": n, "optimizer_step": m}}`` of the ranks whose dump counted them."""
    out = {}
    for r, t in traces.items():
        counts = getattr(t, "step_counts", None) or {}
        if "backward" in counts or "optimizer_step" in counts:
            out[r] = {k: int(counts.get(k) or 0) for k, _ in KINDS}
    return out


def uneven_steps(traces: Mapping[int, Any], progress: Mapping[int, Any] | None = None
                 ) -> tuple[str, dict[str, Any]] | None:
    """The clause a hang gets when its ranks ran different numbers of backward() (or steps), and its detail; None
    when they agree or fewer than two ranks counted (a script without DDP's phases counts nothing). ``progress``:
    analysis/progress.progress_by_rank of the traces (computed when not given)."""
    counts = step_counts(traces)
    if len(counts) < 2:
        return None
    backward = {r: c["backward"] for r, c in counts.items()}
    fewest, most = min(backward.values()), max(backward.values())
    if fewest == most:  # the same backward() counts: the hang came from elsewhere
        return None
    short = sorted(r for r, n in backward.items() if n == fewest)
    if progress is None:
        from distcheck.analysis.progress import progress_by_rank

        progress = progress_by_rank(dict(traces))
    if not all(_waits_elsewhere(progress.get(r)) for r in short):
        # A rank stuck in its own code before its next backward() (a hung data loader, a straggler) has run fewer
        # too: its counts are the consequence, its place is the cause (the hang's own text says it)
        return None
    parts = []
    for k, label in KINDS:
        by_count: dict[int, list[int]] = {}
        for r, c in sorted(counts.items()):
            by_count.setdefault(c[k], []).append(r)
        if len(by_count) == 1:
            parts.append(f"{label} {next(iter(by_count))} times on every rank")
            continue
        parts.append(f"{label} ran " + ", ".join(f"{n} times on {format_ranks(rs)}"
                                                  for n, rs in sorted(by_count.items(), reverse=True)))
    ahead = sorted(r for r, n in backward.items() if n == most)
    t = traces.get(ahead[0])
    where = file_line((t.step_counts or {}).get("backward_file"), (t.step_counts or {}).get("backward_line")) \
        if t is not None else None
    steps = most - fewest
    clause = (", ".join(parts)
              + f": {format_ranks(short)} ran {steps} training step{'s' if steps > 1 else ''} fewer than "
              f"{format_ranks(ahead)} (a step skipped on some ranks: a `continue` or an early exit that not every "
              "rank takes). DDP pairs the ranks' gradient all-reduces in order, so from the skipped step on each one "
              f"averaged different steps' gradients, and {format_ranks(ahead)}'s backward() #{most}"
              f"{f' at {where}' if where else ''} waits for an all-reduce {format_ranks(short)} never "
              f"issue{'s' if len(short) == 1 else ''}. Fix: make every rank run the same number of steps (skip on "
              "every rank together, e.g. all_reduce an 'empty batch' flag, or use DDP's join() context for uneven "
              "inputs)")
    return clause, {"step_counts": {str(r): c for r, c in sorted(counts.items())}}


def _waits_elsewhere(p: Any) -> bool:
    """The rank waits in a collective of its own (a barrier after its loop, the next step's all-reduce): it went
    on without the step, rather than being stuck before it."""
    pending = getattr(p, "pending", None)
    return pending is not None and not pending.completed


def add_to_hang(finding: Finding, traces: Mapping[int, Any], progress: Mapping[int, Any] | None = None) -> None:
    """Append the uneven-steps clause to a hang finding whose ranks' counts differ."""
    if finding.kind != "hang":
        return
    found = uneven_steps(traces, progress)
    if found is None:
        return
    clause, detail = found
    finding.message += f"; {clause}"
    finding.detail.update(detail)
