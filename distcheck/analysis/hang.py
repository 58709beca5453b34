"""Compose the one ``hang`` finding from grouped stacks and each rank's last collectives. Pure: no processes.

The message names the rank or ranks that are somewhere other than the rest, e.g.
``rank 1 is in load_shard (train.py:41) while ranks 0,2-3 wait in all_reduce #57 (train.py:88)``.

Who is "somewhere else": the ranks outside the largest stack group. When groups tie (always possible with 2
ranks), the group blocked in a collective over the widest process group is the one waiting, because every member
of that group should be in the same collective and the others are not; the remaining ranks are the odd ones.

A rank blocked on a process it started (its DataLoader's workers, a subprocess, multiprocessing) is placed where
that process is, when the process was dumped too (``processes``): ``rank 1's DataLoader worker 0 (pid 4242) is in
read_record (train.py:22), which rank 1 waits for at train.py:40``, and the finding's line is the worker's. A
process of a rank that is inside init_process_group means the script starts its own ranks: the message says how
to run it instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from distcheck.analysis.ops import PEER_OPS
# Each rank's last collectives come from the one model of progress; the names stay importable from here for
# readers of stacks.json (commands/report.py) and older callers.
from distcheck.analysis.progress import CollectiveRef, RankProgress, rank_progress as progress_from_events
from distcheck.analysis.stack_groups import (
    Frame, RankStack, StackGroup, group_stacks, innermost_user_frame, process_group_call, stack_collective, waits_on,
)
from distcheck.contract.site import base_name, file_line
from distcheck.contract.findings import (
    SMALL_WORLD, Finding, format_ranks, parse_rank_ranges, rank_ranges, ranks_keyed,
)

__all__ = ["CollectiveRef", "HangDiagnosis", "Location", "RankProgress", "compose_hang_finding", "diagnose",
           "hang_finding", "locate", "progress_from_events", "progress_by_rank_json", "progress_from_json",
           "progress_json"]


# --- where each group is ---------------------------------------------------------------------------------------


@dataclass
class Location:
    ranks: list[int]
    collective: str | None = None
    seq: int | None = None
    pg: list[int] | None = None
    group: str | None = None  # the collective's process group key (analysis/progress.process_group)
    file: str = ""
    line: int = 0
    func: str = ""
    owns_gil: bool = False
    unknown_reason: str = ""
    absent: list[int] = field(default_factory=list)  # members of a subgroup collective that are elsewhere
    via: str | None = None  # who issued a collective Python never called ("DDP gradient bucket all-reduce")
    process: dict[str, Any] | None = None  # the process the rank waits for: role, pid, func, file, line

    @property
    def in_collective(self) -> bool:
        return self.collective is not None

    def site(self) -> str:
        return _site(self.file, self.line)

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

    def clause(self, world_size: int) -> str:
        """``rank 1 is in load_shard (train.py:23)``, or where a rank waits for a process it started: ``rank 1's
        DataLoader worker 0 (pid 4242) is in read_record (train.py:22), which rank 1 waits for at train.py:40``."""
        who = format_ranks(self.ranks)
        if self.process is None:
            return f"{who} {'is' if len(self.ranks) == 1 else 'are'} in {self.text(world_size)}"
        p = self.process
        site = _site(p["file"], p["line"])
        where = f"{p['func']} ({site})" if p.get("func") else site
        if len(self.ranks) > 1:  # ranks with the same stack: one representative's process is named
            return (f"the {p['role']} of each of {who} (rank {self.ranks[0]}'s: pid {p['pid']}) is in {where}, "
                    f"which they wait for at {self.site()}")
        return (f"rank {self.ranks[0]}'s {p['role']} (pid {p['pid']}) is in {where}, which {who} waits for at "
                f"{self.site()}")

    @property
    def primary_site(self) -> tuple[str, int]:
        """The line the finding points at: the process's, when the rank waits for one."""
        if self.process is not None and self.process.get("file"):
            return self.process["file"], self.process["line"]
        return self.file, self.line

    def to_json(self) -> dict[str, Any]:
        # A big group's ranks as rank ranges: every location of a 4096-rank job would repeat them.
        out = {"ranks": self.ranks, "collective": self.collective, "seq": self.seq, "pg": _ranks_field(self.pg),
               "file": self.file, "line": self.line, "func": self.func, "owns_gil": self.owns_gil,
               "absent": _ranks_field(self.absent), "via": self.via}
        if self.process is not None:
            out["process"] = dict(self.process)
        return out


def _ranks_field(ranks: Sequence[int] | None) -> list[int] | str | None:
    """A process group's ranks in JSON: the list, or past SMALL_WORLD ranks their rank ranges (``"0-4095"``)."""
    if ranks is None:
        return None
    return list(ranks) if len(ranks) <= SMALL_WORLD else rank_ranges(ranks)


def progress_json(progress: dict[int, RankProgress] | None, small: int = SMALL_WORLD) -> dict[str, Any]:
    """``last_collectives`` of report.json and stacks.json: each rank's :meth:`RankProgress.to_json`, keyed by
    rank; past ``small`` ranks, ranks with the same progress share one entry keyed by their rank ranges, and each
    ``pg`` is rank ranges too (every rank's refs name its group's W ranks: W squared). Read back with
    :func:`progress_from_json`."""
    progress = progress or {}
    if len(progress) <= small:
        return {str(r): p.to_json() for r, p in sorted(progress.items())}
    # Each ref may hold its own copy of its group's ranks: text each distinct group once (a tuple's hash is a C loop).
    by_id: dict[int, tuple[Any, str]] = {}
    by_ranks: dict[tuple, str] = {}

    def ranges(pg: Any) -> Any:
        if not isinstance(pg, (list, tuple)):
            return pg
        hit = by_id.get(id(pg))
        if hit is None or hit[0] is not pg:
            key = tuple(pg)
            text = by_ranks.get(key)
            if text is None:
                text = by_ranks[key] = rank_ranges(key)
            hit = by_id[id(pg)] = (pg, text)
        return hit[1]

    def compact(p: RankProgress) -> dict[str, Any]:
        out = p.to_json()
        for key in ("last_started", "last_completed", "first_open", "last_failed"):
            if out.get(key):
                out[key]["pg"] = ranges(out[key].get("pg"))
        for g in (out.get("groups") or {}).values():
            g["pg"] = ranges(g.get("pg"))
        return out

    return ranks_keyed(progress, compact, small=small)


def progress_by_rank_json(mapping: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """:func:`progress_json`'s map (either form) keyed by rank, each ``pg`` a list again; the ranks of one entry
    share one dict (and its pg lists), so reading a big job's file costs O(W), not O(W^2)."""
    def expanded(d: dict[str, Any]) -> dict[str, Any]:
        d = dict(d)
        for key in ("last_started", "last_completed", "first_open", "last_failed"):
            if isinstance(d.get(key), dict) and isinstance(d[key].get("pg"), str):
                d[key] = {**d[key], "pg": parse_rank_ranges(d[key]["pg"])}
        if isinstance(d.get("groups"), dict):
            d["groups"] = {k: ({**g, "pg": parse_rank_ranges(g["pg"])} if isinstance(g.get("pg"), str) else g)
                           for k, g in d["groups"].items()}
        return d

    out: dict[int, dict[str, Any]] = {}
    for key, value in (mapping or {}).items():
        if isinstance(value, dict):
            value = expanded(value)
            for rank in parse_rank_ranges(key):
                out[rank] = value
    return out


def progress_from_json(mapping: dict[str, Any] | None) -> dict[int, RankProgress]:
    """Each rank's progress back from :func:`progress_json` (either form)."""
    return {rank: RankProgress.from_json(rank, d) for rank, d in progress_by_rank_json(mapping).items()}


def _site(file: str, line: int) -> str:
    return file_line(file, line) or (base_name(file) if file else "?")


def place_on_process(loc: Location, stack: RankStack | None, processes: Sequence[RankStack]) -> None:
    """A rank (not in a collective) whose main thread waits for a process it started is placed where that process
    is: the one among ``processes`` (its rank's) in the user's code, a DataLoader worker first when the rank
    waits for its DataLoader."""
    if loc.collective is not None or stack is None:
        return
    what = waits_on(stack.main_thread())
    if what is None:
        return
    mine = [p for p in processes if p.rank == loc.ranks[0]]
    if what == "DataLoader":
        mine.sort(key=lambda p: not p.role.startswith("DataLoader worker"))
    best = None
    for p in mine:
        frame = innermost_user_frame(p.main_thread())
        if frame is not None:
            best = (p, frame)
            break
    if best is None:
        return
    p, frame = best
    loc.process = {"role": p.role, "pid": p.pid, "func": frame.name, "file": frame.file, "line": frame.line}


def self_launch_hint(processes: Sequence[RankStack]) -> str:
    """The fix, when a process a rank started is inside init_process_group: the script launches its own ranks."""
    for p in sorted(processes, key=lambda p: (p.rank, p.pid)):
        main = p.main_thread()
        if process_group_call(main):
            frame = innermost_user_frame(main)
            at = f" at {frame.where}" if frame is not None else ""
            return (f"; {p.label} is in init_process_group{at}: the script starts its own ranks, but distcheck "
                    "started them already: run it with plain python, or drop mp.spawn (or the processes that "
                    "call init_process_group) and use --nproc")
    return ""


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
            loc.group = pending.group
            if pending.file:
                loc.file, loc.line = pending.file, pending.line
        elif op is not None:
            loc.collective = op
        return loc
    if pending is not None:
        loc.collective, loc.seq, loc.pg, loc.via = pending.op, pending.seq, pending.pg, pending.via
        loc.group = pending.group
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
    processes: list[RankStack] = field(default_factory=list)  # the dumped processes the ranks started

    @property
    def odd_ranks(self) -> list[int]:
        return sorted(r for loc in self.odd for r in loc.ranks)

    def to_finding(self, stacks: Sequence[RankStack], progress: dict[int, RankProgress],
                   errors: Sequence[str] = ()) -> Finding:
        site = self.primary.primary_site if self.primary is not None and self.primary.file else None
        return hang_finding(self.odd_ranks or self.extra.get("absent_ranks") or self.all_ranks, self.message, timeout=self.extra.get("timeout"),
                            stacks=stacks, progress=progress, site=site, odd_ranks=self.odd_ranks,
                            waiting_ranks=self.waiting.ranks if self.waiting else [], locations=self.locations,
                            groups=self.groups, errors=errors, processes=self.processes,
                            **{k: v for k, v in self.extra.items() if k != "timeout"})


def hang_finding(ranks: Sequence[int], message: str, *, timeout: float | None = None,
                 stacks: Sequence[RankStack] = (), progress: dict[int, RankProgress] | None = None,
                 site: tuple[str | None, int | None] | None = None, odd_ranks: Sequence[int] = (),
                 waiting_ranks: Sequence[int] = (), locations: Sequence[Location] = (),
                 groups: Sequence[StackGroup] = (), errors: Sequence[str] = (),
                 processes: Sequence[RankStack] = (), **extra: Any) -> Finding:
    """Every ``hang`` finding distcheck makes, whoever declares it (a watch loop with stacks, the trace analysis
    alone, a check whose peers never arrived): one detail shape, so readers of report.json need one code path.

    ``detail``: timeout, odd_ranks, waiting_ranks, locations, groups, methods and stacks (py-spy-style JSON per
    rank, ``{}`` when none could be dumped), last_collectives, errors; processes (the processes the ranks started
    that were dumped: rank, pid, role, stack) when there are any; file/line when a user line is known; then
    whatever the caller adds (artifacts, positions, the check that was waiting).

    Past SMALL_WORLD ranks the per-rank maps (methods, stacks, last_collectives) key ranks with the same value by
    their rank ranges (``"0-4093,4095"``: contract.findings.per_rank reads both forms), a big group's ranks are
    rank ranges, and processes and errors are bounded: the detail grows with the distinct stacks, not with W.
    """
    detail: dict[str, Any] = {}
    if site is not None and site[0]:
        detail["file"], detail["line"] = site
    by_rank = {s.rank: s for s in stacks}
    detail.update({
        "timeout": timeout,
        "odd_ranks": list(odd_ranks),
        "waiting_ranks": list(waiting_ranks),
        "locations": [loc.to_json() for loc in locations],
        "groups": [g.to_json() for g in groups],
        "methods": ranks_keyed(by_rank, lambda s: s.method, lambda s: s.method),
        "stacks": ranks_keyed(by_rank, RankStack.to_json, RankStack.content_key),
        "last_collectives": progress_json(progress),
        "errors": _bounded(list(errors)),
    })
    if processes:
        detail["processes"] = processes_json(processes)
    detail.update(extra)
    return Finding("hang", list(ranks), message, detail)


def processes_json(processes: Sequence[RankStack]) -> list[dict[str, Any]]:
    """The hang finding's ``processes``: rank, pid, role, method and stack of each; past SMALL_WORLD processes,
    one entry per distinct stack and role, with its ``ranks`` (rank ranges), ``count`` and first process's."""
    ordered = sorted(processes, key=lambda p: (p.rank, p.pid))
    if len(ordered) <= SMALL_WORLD:
        return [{"rank": p.rank, "pid": p.pid, "role": p.role, "method": p.method, "stack": p.to_json()}
                for p in ordered]
    same: dict[tuple, list[RankStack]] = {}
    for p in ordered:
        same.setdefault(p.content_key(), []).append(p)
    return [{"rank": ps[0].rank, "pid": ps[0].pid, "role": ps[0].role, "method": ps[0].method,
             "ranks": rank_ranges([p.rank for p in ps]), "count": len(ps), "stack": ps[0].to_json()}
            for ps in same.values()]


def _bounded(lines: list[str], most: int = SMALL_WORLD) -> list[str]:
    """At most ``most`` lines (one dump error per rank of a big job is in stacks.json), then how many more."""
    return lines if len(lines) <= most else lines[:most] + [f"... and {len(lines) - most} more (stacks.json)"]


def _verb(loc: Location, one: str, many: str) -> str:
    return one if len(loc.ranks) == 1 else many


def diagnose(stacks: Sequence[RankStack], progress: dict[int, RankProgress] | None = None,
             world_size: int | None = None, timeout: float | None = None,
             errors_by_rank: dict[int, str] | None = None, prefix: str | None = None,
             processes: Sequence[RankStack] = ()) -> HangDiagnosis:
    """Group the ranks by where they are and name the ranks that are somewhere other than the rest.

    The message starts with ``prefix``, by default "no progress for <timeout>s: ". ``processes``: the dumped
    processes the ranks started (``RankStack.role`` set), which a rank blocked on one of them is placed on.
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
        # Unplaced ranks: one location per dump error, or past SMALL_WORLD ranks one in all (each error names
        # its pid: one location per rank otherwise; every error is in stacks.json).
        unplaced = ("?", errors_by_rank.get(r, "") if len(all_ranks) <= SMALL_WORLD else "")
        key = (pend.op, pend.seq, _group_id(pend), pend.file, pend.line) if pend else unplaced
        stackless.setdefault(key, []).append(r)
    for ranks in stackless.values():
        reason = errors_by_rank.get(ranks[0], "")
        if reason and len(ranks) > 1 and len(all_ranks) > SMALL_WORLD:
            reason += f" (rank {ranks[0]}'s; every rank's in stacks.json)"
        locations.append(locate(ranks, None, progress.get(ranks[0]), reason))

    known = [loc for loc in locations if loc.file or loc.collective]
    procs_of: dict[int, list[RankStack]] = {}  # by rank: a scan of every process per location is W squared
    for proc in processes:
        procs_of.setdefault(proc.rank, []).append(proc)
    for loc in known:
        if loc.collective and loc.pg:
            here = set(loc.ranks)
            loc.absent = [r for r in loc.pg if r not in here]
        place_on_process(loc, by_rank.get(loc.ranks[0]), procs_of.get(loc.ranks[0], []))
    waiting = _pick_waiting(known, world)
    if prefix is None:
        prefix = f"no progress for {timeout:g}s: " if timeout else ""
    odd = [loc for loc in known if loc is not waiting] if waiting is not None else []

    if waiting is not None and not odd:
        n = len(waiting.ranks)
        who = f"all {n} ranks" if n > 1 else format_ranks(waiting.ranks)
        verb = ("wait in" if n > 1 else "waits in") if waiting.in_collective else ("are in" if n > 1 else "is in")
        message = (f"{prefix}{waiting.clause(world)}" if waiting.process is not None
                   else f"{prefix}{who} {verb} {waiting.text(world)}")
        primary = waiting
    elif waiting is not None:
        parts = _clauses(odd, world)
        wverb = (_verb(waiting, "waits", "wait") + " in") if waiting.in_collective else _verb(waiting, "is in", "are in")
        message = f"{prefix}{'; '.join(parts)} while {format_ranks(waiting.ranks)} {wverb} {waiting.text(world)}"
        primary = odd[0]
    else:
        parts = _clauses(known, world)
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
    placed = {id(loc) for loc in known}
    unknown = sorted(r for loc in locations if id(loc) not in placed for r in loc.ranks)
    present = set(all_ranks)
    missing = [r for r in range(world) if r not in present] if world_size else []
    undumped = [r for r in unknown if r not in by_rank]  # a rank with a stack was dumped, whatever it shows
    # Ranks the waiting side's collective lacks, whose stacks could not be taken (py-spy too slow on a loaded host,
    # a rank that ended): they hold the others up, so the finding names them, not every rank.
    absent = []
    if waiting is not None and waiting.in_collective and not odd:
        members = set(waiting.pg) if waiting.pg else set(range(world))
        absent = [r for r in undumped if r in members and r not in waiting.ranks
                  and not _passed(progress.get(r), waiting)]
    if undumped and (known or by_rank):
        reasons = sorted({errors_by_rank.get(r, "") for r in undumped} - {""})
        shown = reasons[:MESSAGE_PARTS] + ([f"+{len(reasons) - MESSAGE_PARTS} more in stacks.txt"]
                                           if len(reasons) > MESSAGE_PARTS else [])
        message += f"; {format_ranks(undumped)} not dumped" + (f" ({'; '.join(shown)})" if reasons else "")
        if absent:
            message += (f": {format_ranks(absent)} never arrived in {waiting.collective}"
                        + (f" #{waiting.seq}" if waiting.seq is not None else "") + _last_seen(absent, progress))
    if missing:
        message += f"; {format_ranks(missing)} not found"
    hint = self_launch_hint(processes)
    message += hint
    extra: dict[str, Any] = {"unknown_ranks": unknown, "missing_ranks": missing, "timeout": timeout}
    if absent:
        extra["absent_ranks"] = absent
    if hint:
        extra["self_launch"] = True
    return HangDiagnosis(message, odd, waiting, locations, groups, all_ranks, primary, extra, list(processes))


def _passed(p: RankProgress | None, waiting: Location) -> bool:
    """Whether the rank's trace shows it completed the collective the others wait in (or one after it)."""
    last = p.last_completed if p is not None else None
    return (last is not None and waiting.seq is not None and last.seq is not None and last.seq >= waiting.seq
            and _group_id(last) == _group_id(waiting))


def _group_id(c: Any) -> Any:
    """A collective's group, cheap to compare: its name when known (process_group's key), else its ranks. A
    100,000-rank world's list, made a tuple or compared once per rank, cost seconds per rank."""
    name = getattr(c, "group", None)
    return name if name else tuple(getattr(c, "pg", None) or ())


def _last_seen(ranks: list[int], progress: dict[int, RankProgress]) -> str:
    """``, after all_gather_single #27 (model.py:26)``: where the trace of the first of ``ranks`` last completed a
    collective, the last that is known of it when its stack is not."""
    last = progress.get(ranks[0]).last_completed if progress.get(ranks[0]) else None
    if last is None:
        return ""
    seq = f" #{last.seq}" if last.seq is not None else ""
    site = f" ({_site(last.file, last.line)})" if last.file else ""
    return f" (rank {ranks[0]}'s trace ends after {last.op}{seq}{site})"


MESSAGE_PARTS = 8  # the places the message names; a big job's many odd groups are all in the detail and stacks.txt


def _clauses(locations: list[Location], world: int) -> list[str]:
    parts = [loc.clause(world) for loc in locations[:MESSAGE_PARTS]]
    rest = locations[MESSAGE_PARTS:]
    if rest:
        ranks = [r for loc in rest for r in loc.ranks]
        parts.append(f"{format_ranks(ranks)} {'are' if len(ranks) > 1 else 'is'} in {len(rest)} other "
                     f"place{'s' if len(rest) > 1 else ''} (see stacks.txt)")
    return parts


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
