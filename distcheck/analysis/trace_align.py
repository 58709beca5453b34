"""Aligning per-rank collective traces: the first diverging collective, rank failures and hang positions.

    from distcheck.analysis.trace_align import analyze_run
    findings = analyze_run(load_traces("report"), outcomes, world_size=2)

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

A trace cut short by a full report file system (:attr:`RankTrace.incomplete`) is compared as far as it goes: a
position it does not reach says nothing about that rank, so it is never a count mismatch nor a sign of being stuck.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from distcheck.analysis.call_signature import differing_fields, signature
from distcheck.analysis.split_matrix import FIX as SPLIT_FIX, LIST_FIX as SPLIT_LIST_FIX, PairMismatch, blamed
from distcheck.analysis.split_matrix import describe as describe_pairs, mismatched_pairs, split_of
from distcheck.analysis.hang import hang_finding
from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.progress import (FAILED, ISSUED, ISSUED_NOTE, CollectiveRef, RankProgress, group_counts,
                                         process_group, progress_by_rank)
from distcheck.analysis.torch_errors import brief, first_line, lost_peer, translate, worker_error
from distcheck.analysis.trace_events import P2P_OPS, RankError, RankTrace, TraceEvent
from distcheck.contract.findings import SMALL_WORLD, Finding, format_ranks, rank_ranges, ranks_keyed

STATE_OK = "ok"  # the script returned
STATE_ERROR = "error"  # the script raised
STATE_DIED = "died"  # ended without its exit record (signal, os._exit, segfault)
STATE_HUNG = "hung"  # still running at the no-progress timeout; killed by distcheck
STATE_STOPPED = "stopped"  # killed by distcheck: waited in a collective that provably could not complete
STATE_UNKNOWN = "unknown"


@dataclass
class RankOutcome:
    rank: int
    state: str
    exit_code: int | None = None
    signal: str | None = None
    error: RankError | None = None


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


WINDOW = 4  # positions read back at once from a summarized trace (trace_summary.TraceSummary.events_at)


class _RankSeq:
    """One rank's collectives in one sequence, by position (0-based): a list of every event, or a summarized
    trace's count with the events it kept and reads back on demand."""

    def __init__(self, key: str, events: list[TraceEvent], trace: RankTrace | None = None) -> None:
        self.key = key
        self.trace = trace
        self.summary = trace.summary if trace is not None and not key.startswith("untraced:") else None
        seq = self.summary.sequences.get(key) if self.summary is not None else None
        if self.summary is None or seq is None:
            self.summary = None
            self.events = {i: e for i, e in enumerate(events)}
            self.count = len(events)
            self.start = 0  # nothing known: compare from the first position
        else:
            self.events = {e.seq - 1: e for e in events}
            self.count = seq.count
            self.start = seq.count if seq.first_difference is None else seq.first_difference

    def __len__(self) -> int:
        return self.count

    def at(self, i: int) -> TraceEvent:
        e = self.events.get(i)
        if e is None:
            if self.summary is None or not 0 <= i < self.count:
                raise IndexError(i)
            self.events.update(self.summary.events_at(self.key, i, i + WINDOW))
            e = self.events[i]
        return e

    def last(self) -> TraceEvent | None:
        return self.at(self.count - 1) if self.count else None


@dataclass
class _Sequence:
    """One sequence of positions: a process group's traced collectives, or its untraced ones (TraceEvent.group_key
    keeps those apart: they are numbered by torch, the traced ones by the tracer)."""

    members: tuple[int, ...]
    group: str  # the process group (analysis/progress.process_group), traced and untraced alike
    per_rank: dict[int, _RankSeq]

    def start(self, members: Sequence[int]) -> int:
        """The first position where members may disagree or one has ended: before it every member issued the same
        (summarized traces say so, trace_summary.Aligner); 0 when a member's trace is not summarized."""
        empty = _RankSeq(self.group, [])
        return min((min(s.start, s.count) for s in (self.per_rank.get(r, empty) for r in members)), default=0)


def _collectives_by_group(traces: dict[int, RankTrace]) -> dict[str, _Sequence]:
    lists: dict[str, dict[int, list[TraceEvent]]] = {}
    groups: dict[str, _Sequence] = {}
    for rank, trace in traces.items():
        for e in trace.events:
            if e.op in PEER_OPS:
                continue
            seq = groups.get(e.group_key)
            if seq is None:
                seq = groups[e.group_key] = _Sequence(e.pg, process_group(e), {})
            lists.setdefault(e.group_key, {}).setdefault(rank, []).append(e)
    for key, per_rank in lists.items():
        for rank, events in per_rank.items():
            events.sort(key=lambda e: (e.seq, e.id))
            groups[key].per_rank[rank] = _RankSeq(key, events, traces[rank])
    return groups


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
    for key, seq in _collectives_by_group(traces).items():
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
            if absent and any(_cut(traces.get(r)) for r in absent):
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


def _by_ring_number(per_rank: dict[int, _RankSeq], dumped: Sequence[int],
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


def _cut(trace: RankTrace | None) -> bool:
    """The trace stops before the rank's last collective (a full report file system)."""
    return trace is not None and trace.incomplete is not None and trace.incomplete.from_id is not None


def _cut_note(trace: RankTrace | None) -> str:
    """What a position taken from a cut trace needs said: it may be far behind where the rank really got."""
    if not _cut(trace):
        return ""
    return f" (its trace stops before its collective #{trace.incomplete.from_id}: {trace.incomplete.reason})"


def _when(d: Divergence) -> float:
    return min((e.t_start for e in d.events.values() if e is not None), default=0.0)


def _where(e: TraceEvent) -> str:
    return f" at {e.site}" if e.site else ""


def _group_label(group: Sequence[int] | None) -> str:
    """``[0,1]``; a big group as its rank ranges, ``[0-4095]`` (a 4096-rank list in every sentence otherwise)."""
    if group is not None and len(group) > SMALL_WORLD:
        return "[" + rank_ranges(group) + "]"
    return "[" + ",".join(map(str, group or ())) + "]"


# A rank that ended with neither its exit record nor a signal distcheck saw: it never got back from its script.
UNFINISHED = "ended without finishing its script: os._exit or a signal"
# Under torchrun the agent, not distcheck, reaps the ranks: a rank without its exit record has no exit code here.
UNKNOWN_EXIT = "SIGKILL, the OOM killer, a hard crash; only torchrun's agent saw its exit code"


def _unfinished(o: RankOutcome) -> str:
    return f"{UNFINISHED} ({f'exit code {o.exit_code}' if o.exit_code is not None else UNKNOWN_EXIT})"


def _state_phrase(o: RankOutcome | None) -> str:
    if o is None or o.state == STATE_UNKNOWN:
        return "never reported back"
    return {STATE_OK: "finished its script", STATE_ERROR: "raised", STATE_DIED: "died",
            STATE_HUNG: "was still running", STATE_STOPPED: "was stopped while waiting"}.get(o.state, o.state)


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
    return origin, text + _where(e)


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
        noun = f" collective{'s' if n != 1 else ''} on group {_group_label(group)}" if i == 0 else ""
        parts.append(f"{format_ranks(ranks)} issued {n}{noun}")
    return ", ".join(parts)


def divergence_finding(d: Divergence, outcomes: dict[int, RankOutcome],
                       backend_errors: dict[int, str]) -> Finding:
    shown = _shown_position(d)
    where = f"collective #{shown} on group {_group_label(d.group)}"
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
                   + ", ".join(sorted({_state_phrase(outcomes.get(r)) for r in fewer})) + ")")
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


def find_p2p_mismatches(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome]) -> list[Finding]:
    """The k-th send from a to b must match the k-th receive on b from a in shape and dtype."""
    sends: dict[tuple[int, int], list[tuple[TraceEvent, list[int], str]]] = {}
    recvs: dict[tuple[int, int], list[tuple[TraceEvent, list[int], str]]] = {}
    for rank, trace in traces.items():
        for e in trace.events:
            items: list[tuple[str, int | None, list[int], str]] = []
            if e.op in P2P_OPS and e.shapes:
                items.append((e.op, e.peer, e.shapes[0], e.dtypes[0] if e.dtypes else ""))
            elif e.op == "batch_isend_irecv":
                for item in e.extra.get("p2p") or []:
                    items.append((str(item.get("op")), item.get("peer"), item.get("shape") or [], item.get("dtype") or ""))
            for op, peer, shape, dtype in items:
                if peer is None or op.endswith("object_list"):
                    continue
                if "send" in op:
                    sends.setdefault((rank, int(peer)), []).append((e, list(shape), dtype))
                else:
                    recvs.setdefault((int(peer), rank), []).append((e, list(shape), dtype))
    out: list[Finding] = []
    for pair in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        src, dst = pair
        for k, (s, r) in enumerate(zip(s_list, r_list), start=1):
            if s[1] != r[1] or s[2] != r[2]:
                se, re_ = s[0], r[0]
                message = (f"send #{k} from rank {src} to rank {dst} does not match its receive: rank {src} sends "
                           f"{s[1]} {s[2]}{_where(se)}; rank {dst} receives {r[1]} {r[2]}{_where(re_)}")
                detail = {"pair": [src, dst], "position": k, "send": se.to_json(), "recv": re_.to_json()}
                if se.line is not None:
                    detail.update(file=se.file, line=se.line)
                out.append(Finding("collective_mismatch", [src, dst], message, detail))
                break
        else:
            both_ok = all(outcomes.get(r, RankOutcome(r, STATE_UNKNOWN)).state == STATE_OK for r in pair)
            if len(s_list) != len(r_list) and both_ok and not any(_cut(traces.get(r)) for r in pair):
                k = min(len(s_list), len(r_list)) + 1
                extra, side = (s_list[k - 1], "send") if len(s_list) > len(r_list) else (r_list[k - 1], "receive")
                e = extra[0]
                owner = src if side == "send" else dst
                message = (f"rank {owner} issued an unmatched {e.op} #{k} ({side} {src}->{dst}) {extra[1]} "
                           f"{extra[2]}{_where(e)}: rank {dst if side == 'send' else src} finished without the "
                           f"matching {'receive' if side == 'send' else 'send'}")
                detail = {"pair": [src, dst], "position": k, "divergence": "extra", side: e.to_json()}
                if e.line is not None:
                    detail.update(file=e.file, line=e.line)
                out.append(Finding("collective_mismatch", [owner], message, detail))
    return out


def _ref_json(ref: CollectiveRef | None) -> dict[str, Any] | None:
    if ref is None:
        return None
    return {**(ref.event.to_json() if ref.event is not None else ref.to_json()), "state": ref.state}


def _ref_where(ref: CollectiveRef) -> str:
    return f" at {ref.site}" if ref.site else ""


def position_of(rank: int, progress: RankProgress | None, outcome: RankOutcome | None) -> dict[str, Any]:
    """Where a rank is: its state, the collective it waits in (if any), its last started and completed ones."""
    p = progress if progress is not None else RankProgress(rank)
    return {
        "state": outcome.state if outcome is not None else STATE_UNKNOWN,
        "waiting_in": _ref_json(p.pending),
        "last_started": _ref_json(p.last_started),
        "last_completed": _ref_json(p.last_completed),
        "started": p.started,
        "completed": p.completed,
    }


def describe_position(rank: int, progress: RankProgress | None, outcome: RankOutcome | None,
                      trace: RankTrace | None = None) -> str:
    p = progress if progress is not None else RankProgress(rank)
    if outcome is not None and outcome.state == STATE_OK:
        return f"rank {rank} finished its script"
    pending = p.pending  # the first op not completed: later async ops queue behind it
    if pending is not None:
        return (f"rank {rank} waits in {pending.op} #{pending.seq} on group {_group_label(pending.pg)}"
                f"{_ref_where(pending)}")
    last = p.last_started
    if last is not None and last.state == FAILED:
        return (f"rank {rank} failed in {last.op} #{last.seq} on group {_group_label(last.pg)}{_ref_where(last)} "
                f"({brief(last.error or '') or first_line(last.error or '', 80)})")
    if last is not None and last.state == ISSUED:
        return (f"rank {rank} is outside traced collectives, last issued {last.op} #{last.seq} on group "
                f"{_group_label(last.pg)}{_ref_where(last)} ({ISSUED_NOTE})")
    done = p.last_completed
    if done is not None:
        return f"rank {rank} is outside collectives, last completed {done.op} #{done.seq}{_ref_where(done)}"
    if trace is not None and not trace.flight_dumped:
        # What DDP's Reducer or a compiled graph issued reaches the report through the ring's dump only (an
        # os._exit or a SIGKILL skips it): not seen is not "none".
        return (f"rank {rank} issued no traced collective (what torch issued for it, DDP's or compiled code's, "
                "is unknown: its Flight Recorder ring was never dumped)")
    return f"rank {rank} issued no collective"


def _translation(o: RankOutcome, traces: dict[int, RankTrace],
                 progress: dict[int, RankProgress]) -> dict[str, Any] | None:
    """A rank's error in terms of its model and trace (analysis/torch_errors.py), or None for an unknown error."""
    if o.error is None:
        return None
    trace = traces.get(o.rank)
    return translate(o.error.exc_type, o.error.message,
                     {**(o.error.context or {}), "events": trace.events if trace is not None else [],
                      "progress": progress.get(o.rank)})


def _same_error_key(o: RankOutcome, translated: dict[str, Any] | None) -> tuple | None:
    """Ranks whose failures have this key failed with one cause (the same error at the same line); None: its own."""
    err = o.error
    if err is None or o.signal:
        return None
    text = (translated or {}).get("message") or re.sub(r"\brank \d+", "rank N", first_line(err.message),
                                                         flags=re.IGNORECASE)
    return (err.exc_type, err.file, err.line, text)


def failure_findings(failed: list[RankOutcome], traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                     progress: dict[int, RankProgress] | None = None) -> list[Finding]:
    """One ``rank_failure`` per cause: ranks that raised the same error at the same line are one finding."""
    progress = progress if progress is not None else progress_by_rank(traces)
    groups: dict[Any, list[tuple[RankOutcome, dict[str, Any] | None]]] = {}
    for o in failed:
        translated = _translation(o, traces, progress)
        key = _same_error_key(o, translated)
        groups.setdefault(key if key is not None else ("rank", o.rank), []).append((o, translated))
    return [failure_finding(members[0][0], traces, outcomes, [o.rank for o, _ in members], members[0][1], progress)
            for members in groups.values()]


def failure_finding(o: RankOutcome, traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                    ranks: list[int] | None = None, translated: dict[str, Any] | None = None,
                    progress: dict[int, RankProgress] | None = None) -> Finding:
    """The failure of rank ``o`` (and of ``ranks``, which failed the same way), with where every other rank was;
    ``translated``: its error in the user's terms (analysis/torch_errors.py), torch's text kept in detail."""
    progress = progress if progress is not None else progress_by_rank(traces)
    ranks = sorted(ranks or [o.rank])
    everyone = sorted(set(traces) | set(outcomes))
    others = [r for r in everyone if r not in ranks]
    detail: dict[str, Any] = {"exit_code": o.exit_code, "signal": o.signal,
                              "positions": {r: position_of(r, progress.get(r), outcomes.get(r)) for r in everyone}}
    whose = ""  # "'s DataLoader worker 0": the process of the rank that raised, when not the rank itself
    if o.error is not None:
        err = o.error
        detail.update(exception=err.exc_type, error=err.message, traceback=err.traceback)
        where = f" at {err.site}" if err.site else ""
        what = f"raised {err.exc_type}: {first_line(err.message)}{where}"
        worker = worker_error(err.message)
        file, line = err.file, err.line
        if translated and translated.get("message"):  # torch's text stays in detail["error"]
            what = f"raised {err.exc_type}{where}: {translated['message']}"
            detail.update(translated.get("detail") or {})
        elif worker is not None and worker.site:  # the worker's own line, not the main process's `for x in loader`
            whose = f"'s DataLoader worker {worker.worker}"
            what = (f"raised {worker.exc_type}: {worker.text} at {worker.site} (in {worker.func}), re-raised in the "
                    f"rank{where}")
            detail.update(worker=worker.worker, loader_file=err.file, loader_line=err.line)
            file, line = worker.file, worker.line
        if line is not None:
            detail.update(file=file, line=line)
    elif o.signal:
        what = f"died from {o.signal}" + (f" (exit code {o.exit_code})" if o.exit_code is not None else "")
    elif o.state == STATE_ERROR:  # its exit record says it raised, but the error line was lost (a full disk)
        what = (f"raised an exception (exit code {o.exit_code}) whose traceback could not be written to the report "
                "directory (see the rank's console output)")
    else:  # no exit record and no signal: os._exit(), or a signal handler that exited
        what = _unfinished(o)
    p = progress.get(o.rank)
    last = p.last_started if p is not None else None
    if o.error is None and last is not None:
        what += f" after {last.op} #{last.seq}{_ref_where(last)}"
        if last.line and "line" not in detail:
            detail.update(file=last.file, line=last.line)
    if len(ranks) == 1 and o.error is None:
        what += _cut_note(traces.get(o.rank))
    positions = "; ".join(describe_position(r, progress.get(r), outcomes.get(r), traces.get(r))
                          + _cut_note(traces.get(r)) for r in others)
    message = f"{format_ranks(ranks)}{whose} {what}" + (f"; {positions}" if positions else "")
    if len(ranks) > 1:
        detail["errors"] = {r: outcomes[r].error.message for r in ranks
                            if r in outcomes and outcomes[r].error is not None}
    return Finding("rank_failure", ranks, message, detail)


def hang_from_traces(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome], timeout: float,
                 progress: dict[int, RankProgress] | None = None) -> Finding:
    """No progress for ``timeout`` seconds: every rank's position, from the traces alone."""
    progress = progress if progress is not None else progress_by_rank(traces)
    ranks = sorted(set(traces) | set(outcomes))
    hung = [r for r in ranks if outcomes.get(r) is not None and outcomes[r].state == STATE_HUNG] or ranks
    positions = {r: position_of(r, progress.get(r), outcomes.get(r)) for r in ranks}
    site = None
    for r in hung:
        pending = progress[r].pending if r in progress else None
        if pending is not None and pending.line:
            site = (pending.file, pending.line)
            break
    message = (f"no progress for {timeout:g}s: "
               + "; ".join(describe_position(r, progress.get(r), outcomes.get(r), traces.get(r))
                           + _cut_note(traces.get(r)) for r in ranks))
    return hang_finding(hung, message, timeout=timeout, progress=progress, site=site, positions=positions)


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


def _failure_text(o: RankOutcome) -> str:
    if o.error is not None:
        return f"{o.error.exc_type}: {o.error.message}"
    if o.signal:
        return f"died from {o.signal} (exit code {o.exit_code})"
    if o.state == STATE_ERROR:
        return f"raised (exit code {o.exit_code})"
    return _unfinished(o)


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
            errors_by_div.setdefault(id(d), {})[r] = _failure_text(o)
            continue
        failed.append(o)
    # A backend error raised inside a collective after another rank failed in its own code is a consequence of
    # that failure ("Connection reset by peer"): keep it in the root failure's detail, not as a second finding.
    roots = [o for o in failed if _failed_in_collective(o, progress.get(o.rank)) is None]
    if not roots:  # all failed inside collectives: those that only lost a peer failed because that peer did
        roots = [o for o in failed if o.error is None or not lost_peer(o.error.message)]
    failures = failure_findings([o for o in failed if not roots or o in roots], traces, outcomes, progress)
    consequences = {c.rank: _failure_text(c) for c in failed if c not in roots}
    if consequences and roots:
        for f in failures:
            f.detail["consequences"] = consequences
    findings = [divergence_finding(d, outcomes, errors_by_div.get(id(d), {})) for d in divergences]
    findings += find_p2p_mismatches(traces, outcomes)
    findings += failures
    if any(o.state == STATE_HUNG for o in outcomes.values()):
        findings += hang_findings if hang_findings else [hang_from_traces(traces, outcomes, timeout or 0.0, progress)]
    return findings


def provably_stuck(traces: dict[int, RankTrace], finished: set[int]) -> str | None:
    """Why the run can no longer progress, or None: a running rank waits in a collective at a group position
    that a finished member never issued, or every member of a group has issued a different collective at the
    same position and none of them completed."""
    groups = _collectives_by_group(traces)
    # A trace cut short by a full disk neither shows where its rank waits nor how far a finished rank got.
    cut = {r for r, t in traces.items() if _cut(t)}
    progress = progress_by_rank({r: t for r, t in traces.items() if r not in finished and r not in cut})
    # Per sequence, its finished members' last positions (an untraced collective's number counts every collective
    # of the group, so compare numbers, not how many a member has), and the least of them: once per sequence, not
    # once per waiting rank and member (4096 ranks waiting on a 4096-rank group made 16 million look-ups).
    reached: dict[str, tuple[int, list[tuple[int, int]]]] = {}

    def finished_members(key: str, seq: _Sequence) -> tuple[int, list[tuple[int, int]]]:
        if key not in reached:
            lasts = []
            for m in seq.members:
                if m in finished and m not in cut:
                    issued = seq.per_rank.get(m)
                    last = issued.last() if issued is not None else None
                    lasts.append((m, last.seq if last is not None else 0))
            reached[key] = (min((n for _, n in lasts), default=-1), lasts)
        return reached[key]

    for rank, p in sorted(progress.items()):
        for ref in p.open:
            e = ref.event
            if e is None or e.op in PEER_OPS or e.extra.get("api") == "functional":
                continue
            seq = groups.get(e.group_key)
            if seq is None:
                continue
            least, lasts = finished_members(e.group_key, seq)
            if not lasts or least >= e.seq:
                continue
            m = next(m for m, n in lasts if n < e.seq)
            return (f"rank {rank} waits in {e.op} #{e.seq} on group {_group_label(e.pg)}{_where(e)}, "
                    f"which rank {m} finished without issuing")
    for seq in groups.values():
        members, per_rank = seq.members, seq.per_rank
        for i in range(seq.start(members), max((len(v) for v in per_rank.values()), default=0)):
            present = {r: per_rank[r].at(i) for r in members if len(per_rank.get(r, ())) > i}
            if len(present) < len(members):
                break
            if len({signature(e) for e in present.values()}) > 1:
                if all(not e.completed for e in present.values()) and not cut & set(present):
                    return f"ranks {','.join(map(str, members))} issued different collectives #{i + 1} and wait"
                break
    return None
