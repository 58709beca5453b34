"""Compose the one ``hang`` finding from grouped stacks and each rank's last collectives. Pure: no processes.

The message names the rank or ranks that are somewhere other than the rest, e.g.
``rank 1 is in load_shard (train.py:41) while ranks 0,2-3 wait in all_reduce #57 (train.py:88)``.

Who is "somewhere else": the ranks outside the largest stack group. When groups tie (always possible with 2
ranks), the group blocked in a collective over the widest process group is the one waiting, because every member
of that group should be in the same collective and the others are not; the remaining ranks are the odd ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from distcheck.analysis.ops import PEER_OPS
# Each rank's last collectives come from the one model of progress; the names stay importable from here for
# readers of stacks.json (commands/report.py) and older callers.
from distcheck.analysis.progress import CollectiveRef, RankProgress, rank_progress as progress_from_events
from distcheck.analysis.stack_groups import (
    Frame, RankStack, StackGroup, group_stacks, innermost_user_frame, stack_collective,
)
from distcheck.contract.findings import Finding, format_ranks

__all__ = ["CollectiveRef", "HangDiagnosis", "Location", "RankProgress", "compose_hang_finding", "diagnose",
           "hang_finding", "locate", "progress_from_events"]


# --- where each group is ---------------------------------------------------------------------------------------


@dataclass
class Location:
    ranks: list[int]
    collective: str | None = None
    seq: int | None = None
    pg: list[int] | None = None
    file: str = ""
    line: int = 0
    func: str = ""
    owns_gil: bool = False
    unknown_reason: str = ""
    absent: list[int] = field(default_factory=list)  # members of a subgroup collective that are elsewhere
    via: str | None = None  # who issued a collective Python never called ("DDP gradient bucket all-reduce")

    @property
    def in_collective(self) -> bool:
        return self.collective is not None

    def site(self) -> str:
        if not self.file:
            return "?"
        return f"{os.path.basename(self.file)}:{self.line}" if self.line else os.path.basename(self.file)

    def text(self, world_size: int) -> str:
        if self.unknown_reason and not self.file and not self.collective:
            return f"an unknown place ({self.unknown_reason})"
        gil = " holding the GIL" if self.owns_gil else ""
        if self.collective:
            seq = f" #{self.seq}" if self.seq is not None else ""
            group = f" on group {','.join(map(str, self.pg))}" if self.pg and len(self.pg) < world_size else ""
            absent = ""
            if group and self.absent:
                absent = f" where {format_ranks(self.absent)} never arrived"
            where = f"{self.via} at {self.site()}" if self.via else self.site()
            return f"{self.collective}{seq}{group} ({where}){gil}{absent}"
        return f"{self.func or '?'} ({self.site()}){gil}"

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "collective": self.collective, "seq": self.seq, "pg": self.pg,
                "file": self.file, "line": self.line, "func": self.func, "owns_gil": self.owns_gil,
                "absent": self.absent, "via": self.via}


def locate(ranks: list[int], stack: RankStack | None, progress: RankProgress | None, error: str = "") -> Location:
    """Where a rank (the representative of its group) is: the collective it waits in, else its user frame.

    The trace supplies the collective's sequence number, group and call site. A rank whose stack is elsewhere
    but that has a collective issued and not completed still waits in it: async ops and every NCCL op return
    once queued, and the host runs on until something (``wait()``, ``.item()``, a poll loop) blocks on it.
    """
    loc = Location(list(ranks), unknown_reason=error or "no stack and no trace")
    pending = progress.pending if progress else None
    main = stack.main_thread() if stack else None
    if main is not None:
        frame: Frame | None = innermost_user_frame(main)
        loc.owns_gil = bool(main.owns_gil)
        if frame is not None:
            loc.file, loc.line, loc.func = frame.file, frame.line, frame.name
        op = stack_collective(main)
        if pending is not None:
            loc.collective, loc.seq, loc.pg, loc.via = pending.op, pending.seq, pending.pg, pending.via
            if pending.file:
                loc.file, loc.line = pending.file, pending.line
        elif op is not None:
            loc.collective = op
        return loc
    if pending is not None:
        loc.collective, loc.seq, loc.pg, loc.via = pending.op, pending.seq, pending.pg, pending.via
        loc.file, loc.line, loc.func = pending.file, pending.line, pending.op
    return loc


# --- the diagnosis ------------------------------------------------------------------------------------------------


@dataclass
class HangDiagnosis:
    message: str
    odd: list[Location]
    waiting: Location | None
    locations: list[Location]
    groups: list[StackGroup]
    all_ranks: list[int]
    primary: Location | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def odd_ranks(self) -> list[int]:
        return sorted(r for loc in self.odd for r in loc.ranks)

    def to_finding(self, stacks: Sequence[RankStack], progress: dict[int, RankProgress],
                   errors: Sequence[str] = ()) -> Finding:
        site = (self.primary.file, self.primary.line) if self.primary is not None and self.primary.file else None
        return hang_finding(self.odd_ranks or self.all_ranks, self.message, timeout=self.extra.get("timeout"),
                            stacks=stacks, progress=progress, site=site, odd_ranks=self.odd_ranks,
                            waiting_ranks=self.waiting.ranks if self.waiting else [], locations=self.locations,
                            groups=self.groups, errors=errors,
                            **{k: v for k, v in self.extra.items() if k != "timeout"})


def hang_finding(ranks: Sequence[int], message: str, *, timeout: float | None = None,
                 stacks: Sequence[RankStack] = (), progress: dict[int, RankProgress] | None = None,
                 site: tuple[str | None, int | None] | None = None, odd_ranks: Sequence[int] = (),
                 waiting_ranks: Sequence[int] = (), locations: Sequence[Location] = (),
                 groups: Sequence[StackGroup] = (), errors: Sequence[str] = (), **extra: Any) -> Finding:
    """Every ``hang`` finding distcheck makes, whoever declares it (a watch loop with stacks, the trace analysis
    alone, a check whose peers never arrived): one detail shape, so readers of report.json need one code path.

    ``detail``: timeout, odd_ranks, waiting_ranks, locations, groups, methods and stacks (py-spy-style JSON per
    rank, ``{}`` when none could be dumped), last_collectives, errors; file/line when a user line is known; then
    whatever the caller adds (artifacts, positions, the check that was waiting).
    """
    detail: dict[str, Any] = {}
    if site is not None and site[0]:
        detail["file"], detail["line"] = site
    detail.update({
        "timeout": timeout,
        "odd_ranks": list(odd_ranks),
        "waiting_ranks": list(waiting_ranks),
        "locations": [loc.to_json() for loc in locations],
        "groups": [g.to_json() for g in groups],
        "methods": {str(s.rank): s.method for s in stacks},
        "stacks": {str(s.rank): s.to_json() for s in sorted(stacks, key=lambda s: s.rank)},
        "last_collectives": {str(r): p.to_json() for r, p in sorted((progress or {}).items())},
        "errors": list(errors),
    })
    detail.update(extra)
    return Finding("hang", list(ranks), message, detail)


def _verb(loc: Location, one: str, many: str) -> str:
    return one if len(loc.ranks) == 1 else many


def diagnose(stacks: Sequence[RankStack], progress: dict[int, RankProgress] | None = None,
             world_size: int | None = None, timeout: float | None = None,
             errors_by_rank: dict[int, str] | None = None, prefix: str | None = None) -> HangDiagnosis:
    """Group the ranks by where they are and name the ranks that are somewhere other than the rest.

    The message starts with ``prefix``, by default "no progress for <timeout>s: ".
    """
    progress = dict(progress or {})
    errors_by_rank = dict(errors_by_rank or {})
    by_rank = {s.rank: s for s in stacks}
    groups = group_stacks(stacks)
    all_ranks = sorted(set(by_rank) | set(progress) | set(errors_by_rank))
    world = max(world_size or 0, (max(all_ranks) + 1) if all_ranks else 0)

    locations = [locate(g.ranks, by_rank[g.ranks[0]], progress.get(g.ranks[0])) for g in groups]
    # Ranks without a stack are placed by their trace alone, one location per distinct pending collective.
    stackless: dict[tuple, list[int]] = {}
    for r in all_ranks:
        if r in by_rank:
            continue
        p = progress.get(r)
        pend = p.pending if p else None
        key = (pend.op, pend.seq, tuple(pend.pg or ()), pend.file, pend.line) if pend else ("?", errors_by_rank.get(r, ""))
        stackless.setdefault(key, []).append(r)
    for ranks in stackless.values():
        locations.append(locate(ranks, None, progress.get(ranks[0]), errors_by_rank.get(ranks[0], "")))

    known = [loc for loc in locations if loc.file or loc.collective]
    for loc in known:
        if loc.collective and loc.pg:
            loc.absent = [r for r in loc.pg if r not in loc.ranks]
    waiting = _pick_waiting(known, world)
    if prefix is None:
        prefix = f"no progress for {timeout:g}s: " if timeout else ""
    odd = [loc for loc in known if loc is not waiting] if waiting is not None else []

    if waiting is not None and not odd:
        n = len(waiting.ranks)
        who = f"all {n} ranks" if n > 1 else format_ranks(waiting.ranks)
        verb = ("wait in" if n > 1 else "waits in") if waiting.in_collective else ("are in" if n > 1 else "is in")
        message = f"{prefix}{who} {verb} {waiting.text(world)}"
        primary = waiting
    elif waiting is not None:
        parts = [f"{format_ranks(loc.ranks)} {_verb(loc, 'is', 'are')} in {loc.text(world)}" for loc in odd]
        wverb = (_verb(waiting, "waits", "wait") + " in") if waiting.in_collective else _verb(waiting, "is in", "are in")
        message = f"{prefix}{'; '.join(parts)} while {format_ranks(waiting.ranks)} {wverb} {waiting.text(world)}"
        primary = odd[0]
    else:
        parts = [f"{format_ranks(loc.ranks)} {_verb(loc, 'is', 'are')} in {loc.text(world)}" for loc in known]
        if parts:
            message = prefix + "; ".join(parts)
        elif by_rank:  # stacks exist but show neither user code nor a collective: say that, not "not dumped"
            message = prefix + (f"{format_ranks(sorted(by_rank))} dumped, but no stack shows user code or a "
                                "collective and no trace says where the ranks are (see the stacks)")
        else:
            message = prefix + "no rank could be dumped and no trace says where the ranks are"
        primary = known[0] if known else None

    # Highlight what the diagnosis singled out, which can differ from plain group size (e.g. a 1-1 tie).
    odd_set = {r for loc in odd for r in loc.ranks}
    if odd_set:
        for g in groups:
            g.minority = bool(odd_set & set(g.ranks))
    unknown = sorted(r for loc in locations if loc not in known for r in loc.ranks)
    missing = [r for r in range(world) if r not in all_ranks] if world_size else []
    undumped = [r for r in unknown if r not in by_rank]  # a rank with a stack was dumped, whatever it shows
    if undumped and (known or by_rank):
        reasons = sorted({errors_by_rank.get(r, "") for r in undumped} - {""})
        message += f"; {format_ranks(undumped)} not dumped" + (f" ({'; '.join(reasons)})" if reasons else "")
    if missing:
        message += f"; {format_ranks(missing)} not found"
    return HangDiagnosis(message, odd, waiting, locations, groups, all_ranks, primary,
                         {"unknown_ranks": unknown, "missing_ranks": missing, "timeout": timeout})


def _pick_waiting(known: list[Location], world: int) -> Location | None:
    if not known:
        return None
    if len(known) == 1:
        return known[0]
    ordered = sorted(known, key=lambda loc: (-len(loc.ranks), loc.ranks[0]))
    if len(ordered[0].ranks) > len(ordered[1].ranks):
        return ordered[0]
    # A tie: the waiting side is the one blocked in the collective that spans the most ranks (its missing
    # members are exactly the ranks elsewhere); point-to-point waits are weaker evidence than group collectives.
    top = len(ordered[0].ranks)
    tied = [loc for loc in ordered if len(loc.ranks) == top]
    in_coll = [loc for loc in tied if loc.in_collective]
    if not in_coll:
        return None
    def scope(loc: Location) -> tuple:
        return (-(len(loc.pg) if loc.pg else world), loc.collective in PEER_OPS, loc.ranks[0])
    best = sorted(in_coll, key=scope)
    if len(best) > 1 and scope(best[0])[:2] == scope(best[1])[:2]:
        return None  # two groups in equally wide collectives: nothing singles one out
    return best[0]


def compose_hang_finding(stacks: Sequence[RankStack], progress: dict[int, RankProgress] | None = None,
                         world_size: int | None = None, timeout: float | None = None,
                         errors_by_rank: dict[int, str] | None = None, errors: Sequence[str] = ()) -> Finding:
    """The ``hang`` finding: message naming the odd ranks, detail with every stack and last collective."""
    diag = diagnose(stacks, progress, world_size, timeout, errors_by_rank)
    return diag.to_finding(stacks, dict(progress or {}), errors)
