"""Aligning per-rank collective traces: the first diverging collective of each process group, and a run's findings.

    from distcheck.analysis.trace_align import analyze_run
    findings = analyze_run(load_traces("report"), outcomes, world_size=2)
    python -m pytest -q tests/unit/test_trace_align.py tests/unit/test_count_mismatch.py

Pure (no process group). Collectives are aligned per process group by their per-group sequence number: every
member of a group must issue the same collective at the same position. Point-to-point ops are paired per
(sender, receiver) instead. What "the same" means is per op (see ``signature``): an all_gather with a list of
differently sized outputs is legal as long as every rank passes the same list, all_to_all(_single) may move
different amounts per rank, and the *_object variants carry pickles of any size.

Collectives the tracer did not see (DDP's buckets, compiled graphs: merged from torch's Flight Recorder, with
``extra["origin"]``) align in a sequence of their own per group (:attr:`TraceEvent.group_key`); a group reports its
earliest divergence in either. Ranks with a ring dump compare them by position; a rank without one only those whose
ring number is known (a DDP rank's graph runs), with the dumped ranks' entries of the same number. A rank that
finished its script having issued fewer collectives on a group than its peers is a count mismatch: the finding names both counts, the first collective it never issued (op, sizes,
who issued it and the user's line) and the fix. Where each rank is (last started, last completed, the collective
it waits on, counts per group) comes from analysis/progress.py, the one model of a rank's progress.

The rest of a run's analysis lives beside this: how each rank ended and where it was (analysis/rank_outcomes.py),
the sequences compared here (analysis/group_sequences.py), point-to-point pairs (analysis/p2p_pairs.py) and the
stop rule the watch asks while ranks run (analysis/stop_rule.py). :func:`analyze_run` puts them together.

A trace cut short by a full report file system (:attr:`RankTrace.incomplete`) is compared as far as it goes: a
position it does not reach says nothing about that rank, so it is never a count mismatch nor a sign of being stuck.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from distcheck.analysis.call_signature import differing_fields, signature
from distcheck.analysis.group_sequences import RankSequence, at_site, collectives_by_group, group_label, trace_cut
from distcheck.analysis.p2p_pairs import find_p2p_mismatches
from distcheck.analysis.progress import FAILED, CollectiveRef, RankProgress, group_counts, progress_by_rank
from distcheck.analysis.rank_outcomes import (STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, STATE_UNKNOWN,
                                              RankOutcome, failure_findings, failure_text, hang_from_traces,
                                              state_phrase)
from distcheck.analysis.split_matrix import FIX as SPLIT_FIX, LIST_FIX as SPLIT_LIST_FIX, PairMismatch, blamed
from distcheck.analysis.split_matrix import describe as describe_pairs, mismatched_pairs, split_of
from distcheck.analysis.torch_errors import brief, first_line, lost_peer
from distcheck.analysis.trace_events import RankTrace, TraceEvent
from distcheck.contract.findings import SMALL_WORLD, Finding, format_ranks, rank_ranges, ranks_keyed
# Not used here: testing/pytest_plugin.py still imports it from this module (issue 47; its new home is stop_rule).


@dataclass
class Divergence:
    """The first position of a process group where ranks disagree."""

    group: tuple[int, ...]
    group_key: str  # the process group (analysis/progress.process_group)
    position: int  # place in the sequence (1 = the group's first collective)
    kind: str  # "different" | "extra" | "missing"
    events: dict[int, TraceEvent | None]  # what each member issued there (None: nothing)
    ranks: list[int]  # the odd ranks
    fields: list[str] = field(default_factory=list)  # what differs: op, shapes, dtypes, reduce_op, root, ...
    counts: dict[int, int] = field(default_factory=dict)  # extra/missing: collectives each member issued on the group
    sequence: str = ""  # TraceEvent.group_key of the events: the group's traced or untraced sequence
    pairs: list[PairMismatch] = field(default_factory=list)  # "split": the per-peer sizes that do not pair up


def _odd_ranks(present: dict[int, TraceEvent]) -> list[int]:
    buckets: dict[tuple, list[int]] = {}
    for r, e in sorted(present.items()):
        buckets.setdefault(signature(e), []).append(r)
    ordered = sorted(buckets.values(), key=lambda rs: (-len(rs), rs[0]))
    if len(ordered[0]) == 1:  # no majority (e.g. 2 ranks that disagree): every rank is involved
        return sorted(present)
    return sorted(r for rs in ordered[1:] for r in rs)


def find_divergences(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                     progress: dict[int, RankProgress] | None = None) -> list[Divergence]:
    """The first divergence of each process group, in order of time."""
    progress = progress if progress is not None else progress_by_rank(traces)
    first: dict[str, Divergence] = {}  # process group -> its earliest divergence (traced or untraced sequence)
    for key, seq in collectives_by_group(traces).items():
        per_rank = seq.per_rank
        members = tuple(seq.members) or tuple(sorted(per_rank))
        numbered: dict[int, dict[int, TraceEvent]] = {}
        if key.startswith("untraced:"):
            # A rank whose ring was never dumped (killed, aborted, stuck holding the GIL) did not issue nothing:
            # what it issued is unknown. Only ranks with a dump are compared by position; of the others, only the
            # collectives whose ring number is known (a DDP rank's graph runs), by that number.
            dumped = tuple(r for r in members if traces.get(r) is not None and traces[r].flight_dumped)
            numbered = _by_ring_number(per_rank, dumped, [r for r in members if r not in dumped])
            members = dumped
        shown = tuple(sorted({*members, *(r for at in numbered.values() for r in at)}))
        longest = max((len(per_rank[r]) for r in members if r in per_rank), default=0)
        longest = max(longest, max(numbered, default=-1) + 1)
        found: Divergence | None = None
        for i in range(seq.start(members), longest):
            present = {r: per_rank[r].at(i) for r in members if len(per_rank.get(r, ())) > i}
            absent = [r for r in members if r not in present]
            compared = {**present, **numbered.get(i, {})}  # never absent: what else such a rank issued is unknown
            if len({signature(e) for e in compared.values()}) > 1:
                events = {r: compared.get(r) for r in shown}
                found = Divergence(shown, seq.group, i + 1, "different", events, _odd_ranks(compared),
                                   differing_fields(list(compared.values())), sequence=key)
                break
            pairs = mismatched_pairs(present, members) if not absent else []
            if pairs:  # the same exchange everywhere, but what one rank sends another does not expect
                found = Divergence(members, seq.group, i + 1, "different", dict(present), blamed(pairs, members),
                                   ["split"], sequence=key, pairs=pairs)
                break
            if absent and any(trace_cut(traces.get(r)) for r in absent):
                break  # a trace cut short by a full disk: what that rank issued from here on is unknown
            if absent:
                # A rank that finished cleanly without this collective will never issue it: it issued fewer
                # collectives than its peers. A rank that raised, died or hung stopped early for its own reason
                # (reported as such), so fewer collectives say nothing about it by themselves.
                if all(outcomes.get(r, RankOutcome(r, STATE_UNKNOWN)).state == STATE_OK for r in absent):
                    have = sorted(present)
                    kind, odd = ("extra", have) if len(have) <= len(absent) else ("missing", sorted(absent))
                    counts = group_counts(progress, seq.group, members)
                    if not all(counts[a] < counts[h] for a in absent for h in have):
                        # The group's totals hide it (another sequence of the group runs the other way): count
                        # in the sequence that diverged.
                        counts = {r: len(per_rank.get(r, ())) for r in members}
                    found = Divergence(members, seq.group, i + 1, kind, {r: present.get(r) for r in members},
                                       odd, counts=counts, sequence=key)
                break
        if found is not None and (seq.group not in first or _when(found) < _when(first[seq.group])):
            first[seq.group] = found
    return sorted(first.values(), key=_when)


def _by_ring_number(per_rank: dict[int, RankSequence], dumped: Sequence[int],
                    others: Sequence[int]) -> dict[int, dict[int, TraceEvent]]:
    """{position: {rank: event}} of the untraced collectives of ranks without a ring dump whose ring number
    (torch's collective_seq_id) is known (``extra["seq_exact"]``: a DDP rank's graph runs, whose counters count
    DDP's buckets too; analysis/flight_recorder.graph_run_events): each at the position where the dumped ranks' rings
    hold that number, or, with no dumped rank, in the order of the numbers. A number no dumped rank holds is left
    out: nothing to compare it with."""
    known = {r: [e for e in per_rank[r].events.values() if e.extra.get("seq_exact")] for r in others if r in per_rank}
    known = {r: evs for r, evs in known.items() if evs}
    if not known:
        return {}
    place: dict[int, int] = {}  # ring number -> position in the dumped ranks' sequence
    for r in dumped:
        s = per_rank.get(r)
        for i in range(len(s) if s is not None else 0):
            place.setdefault(s.at(i).seq, i)
    if not dumped:
        place = {n: i for i, n in enumerate(sorted({e.seq for evs in known.values() for e in evs}))}
    out: dict[int, dict[int, TraceEvent]] = {}
    for r, evs in known.items():
        for e in evs:
            if e.seq in place:
                out.setdefault(place[e.seq], {})[r] = e
    return out


def _when(d: Divergence) -> float:
    return min((e.t_start for e in d.events.values() if e is not None), default=0.0)


# Bytes per element of the dtypes the tracer names (str(torch.dtype) without "torch."); no torch import here.
_DTYPE_BYTES = {"float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "complex128": 16, "complex64": 8, "complex32": 4, "int64": 8, "long": 8, "int32": 4, "int": 4,
                "int16": 2, "short": 2, "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


# The usual cause of a rank issuing fewer collectives than its peers: it ran fewer steps.
UNEVEN_REMEDIES = "DDP's join(), drop_last=True in the DistributedSampler/DataLoader, or equal shards"
UNEVEN_FIX = f"uneven batches per rank: {UNEVEN_REMEDIES}, so that every rank runs the same number of steps"
_ISSUERS = {"ddp": "issued by DDP", "compiled": "issued by compiled code", "torch": "issued by torch itself"}


def payload_bytes(e: TraceEvent) -> int | None:
    """Bytes of the tensors the call passed (every shape with its dtype), or None when a dtype is unknown."""
    if not e.shapes or len(e.dtypes) != len(e.shapes):
        return None
    total = 0
    for shape, dtype in zip(e.shapes, e.dtypes):
        size = _DTYPE_BYTES.get(str(dtype).removeprefix("torch."))
        if size is None:
            return None
        numel = 1
        for dim in shape:
            numel *= int(dim)
        total += numel * size
    return total


def format_bytes(n: int) -> str:
    """``4 B``, ``8.0 KiB``, ``1.5 MiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    return f"{n} B"


def issuer(e: TraceEvent) -> tuple[str, str]:
    """Who issued a collective (``extra["origin"]``: ddp | compiled | torch; none: the user's own call) and how a
    message says it, with the user's line: ``DDP gradient bucket all-reduce at train.py:27``."""
    origin = str(e.extra.get("origin") or "user")
    via = e.extra.get("via")
    text = "your own call" if origin == "user" else str(via or _ISSUERS.get(origin, f"issued by {origin}"))
    return origin, text + at_site(e)


def _sized(e: TraceEvent, position: int | None) -> str:
    """``all_reduce #31 [2058] float32 SUM (8.0 KiB)``."""
    seq = f" #{position}" if position is not None else ""
    n = payload_bytes(e)
    return f"{e.op}{seq}{e.brief()[len(e.op):]}" + (f" ({format_bytes(n)})" if n is not None else "")


def _shown_position(d: Divergence) -> int:
    """The position a message names: an untraced collective's own number in its group (torch's
    collective_seq_id, which counts every collective of the group), else the place in the traced sequence."""
    e = next((e for e in d.events.values() if e is not None), None)
    return e.seq if e is not None and e.extra.get("untraced") and e.seq else d.position


def _count_phrase(counts: dict[int, int], group: tuple[int, ...]) -> str:
    """``rank 1 issued 30 collectives on group [0,1], rank 0 issued 34``: fewest first."""
    by_count: dict[int, list[int]] = {}
    for r, n in counts.items():
        by_count.setdefault(n, []).append(r)
    parts = []
    for i, (n, ranks) in enumerate(sorted(by_count.items())):
        noun = f" collective{'s' if n != 1 else ''} on group {group_label(group)}" if i == 0 else ""
        parts.append(f"{format_ranks(ranks)} issued {n}{noun}")
    return ", ".join(parts)


def divergence_finding(d: Divergence, outcomes: dict[int, RankOutcome],
                       backend_errors: dict[int, str]) -> Finding:
    shown = _shown_position(d)
    where = f"collective #{shown} on group {group_label(d.group)}"
    # A big group's ranks that issued the same share one entry, keyed by their rank ranges (contract/findings.py).
    issued = ranks_keyed(d.events, lambda e: e.to_json() if e is not None else None)
    primary: TraceEvent | None = None
    group: Any = list(d.group) if len(d.group) <= SMALL_WORLD else rank_ranges(d.group)
    detail: dict[str, Any] = {"group": group, "group_name": d.group_key, "position": shown,
                              "divergence": d.kind, "fields": d.fields, "issued": issued}
    fixes = ""
    ranks = d.ranks
    if d.kind == "different":
        buckets: dict[tuple, list[int]] = {}
        for r, e in d.events.items():
            if e is not None:
                buckets.setdefault((e.brief(), e.site), []).append(r)
        parts = [f"{format_ranks(rs)} issued {brief}" + (f" at {site}" if site else "")
                 for (brief, site), rs in sorted(buckets.items(), key=lambda kv: kv[1][0])]
        primary = next((d.events[r] for r in d.ranks if d.events.get(r) is not None), None)
        message = f"{where} differs in {', '.join(d.fields) or 'signature'}: " + "; ".join(parts)
        if d.pairs:
            op = primary.op if primary is not None else "exchange"
            message = (f"{where} ({op}): the per-peer sizes do not pair up: "
                       f"{describe_pairs(d.pairs, d.events, d.group)}")
            rows = (split_of(primary) or {}).get("unit") == "rows"
            fixes = SPLIT_FIX if rows else SPLIT_LIST_FIX
            detail["pairs"] = [p.to_json() for p in d.pairs]
            detail["splits"] = {str(r): split_of(e) for r, e in d.events.items() if e is not None}
    else:
        # A count mismatch ("extra" or "missing" at the first position some member never reached): the ranks that
        # finished short, both counts, and the first collective they never issued, with who issued it.
        fewer = [r for r in d.group if d.events.get(r) is None]
        have = [r for r in d.group if d.events.get(r) is not None]
        e = primary = d.events[have[0]]
        origin, by = issuer(e)
        n = payload_bytes(e)
        message = (f"{_count_phrase(d.counts, d.group)}; the first collective {format_ranks(fewer)} never issued: "
                   f"{_sized(e, shown)}, {by}; {format_ranks(fewer)} issued no collective there ("
                   + ", ".join(sorted({state_phrase(outcomes.get(r)) for r in fewer})) + ")")
        # torch's own collectives (DDP's buckets, a compiled step) run once per step: fewer means fewer steps.
        # The user's own call may also sit under a rank-dependent condition.
        fixes = UNEVEN_FIX if origin != "user" else (
            f"call {e.op} on every rank of the group or on none (no rank-dependent condition around it); or, if "
            f"the ranks ran different numbers of steps (uneven batches per rank): {UNEVEN_REMEDIES}")
        if origin != "user" and len(fewer) == len(have):
            # No majority, and no call of the user's to blame (torch issues these once per step): the ranks that
            # ran more steps are as much in it as those that ran fewer.
            ranks = sorted(fewer + have)
        detail.update(counts=dict(d.counts), fewer_ranks=fewer,
                      first_missing={**e.to_json(), "position": shown, "bytes": n, "origin": origin,
                                     "via": e.extra.get("via")},
                      origin=origin, fixes=fixes)
    if primary is not None and primary.line is not None:
        detail["file"] = primary.file
        detail["line"] = primary.line
    if backend_errors:
        detail["backend_errors"] = backend_errors
        first = next(iter(backend_errors.values()))
        said = brief(first) or first_line(first)
        if d.kind == "different":
            message += f" (backend error: {said})"
        else:  # the peer left: what the ranks that went on met is the consequence, not a second finding
            message += f"; then {format_ranks(sorted(backend_errors))} failed: {said}"
    if fixes:
        message += f". Fix: {fixes}"
    return Finding("collective_mismatch", ranks, message, detail)


def _explained_by(o: RankOutcome, divergences: list[Divergence], progress: RankProgress | None) -> Divergence | None:
    """The divergence a rank's failure came from: it raised or died in or after its collective at that position."""
    last = progress.last_started if progress is not None else None
    for d in divergences:
        e = d.events.get(o.rank)
        if e is None:
            continue
        if o.error is not None and (e.error is not None or e.t_end is None or o.error.t >= e.t_start):
            return d
        if o.error is None and last is not None and last.id is not None and last.id >= e.id:
            return d  # died (e.g. SIGABRT inside gloo) at or after the diverging collective
    return None


def _failed_in_collective(o: RankOutcome, progress: RankProgress | None) -> CollectiveRef | None:
    """The collective a rank's exception came out of (a backend error), or None for an error in user code."""
    if o.error is None or progress is None:
        return None
    last = progress.last_started
    return last if last is not None and last.state == FAILED else None


def analyze_run(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome], world_size: int,
                timeout: float | None = None, hang_findings: list[Finding] | None = None,
                progress: dict[int, RankProgress] | None = None) -> list[Finding]:
    """All findings of a traced run: collective mismatches first, then failures and the hang. ``progress``: each
    rank's (analysis/progress.py), when the caller has it already."""
    progress = progress if progress is not None else progress_by_rank(traces)
    divergences = find_divergences(traces, outcomes, progress)
    errors_by_div: dict[int, dict[int, str]] = {}
    failed: list[RankOutcome] = []
    for r in sorted(outcomes):
        o = outcomes[r]
        if o.state not in (STATE_ERROR, STATE_DIED, STATE_UNKNOWN):
            continue
        d = _explained_by(o, divergences, progress.get(r))
        if d is not None:
            # A cryptic backend error ("Connection closed by peer", SIGABRT in gloo) caused by the mismatch:
            # the mismatch is the diagnosis, the error is kept as evidence.
            errors_by_div.setdefault(id(d), {})[r] = failure_text(o)
            continue
        failed.append(o)
    # A backend error raised inside a collective after another rank failed in its own code is a consequence of
    # that failure ("Connection reset by peer"): keep it in the root failure's detail, not as a second finding.
    roots = [o for o in failed if _failed_in_collective(o, progress.get(o.rank)) is None]
    if not roots:  # all failed inside collectives: those that only lost a peer failed because that peer did
        roots = [o for o in failed if o.error is None or not lost_peer(o.error.message)]
    failures = failure_findings([o for o in failed if not roots or o in roots], traces, outcomes, progress)
    consequences = {c.rank: failure_text(c) for c in failed if c not in roots}
    if consequences and roots:
        for f in failures:
            f.detail["consequences"] = consequences
    findings = [divergence_finding(d, outcomes, errors_by_div.get(id(d), {})) for d in divergences]
    findings += find_p2p_mismatches(traces, outcomes)
    findings += failures
    if any(o.state == STATE_HUNG for o in outcomes.values()):
        findings += hang_findings if hang_findings else [hang_from_traces(traces, outcomes, timeout or 0.0, progress)]
    return findings
