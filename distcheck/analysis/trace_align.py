"""Aligning per-rank collective traces: the first diverging collective, rank failures and hang positions.

    from distcheck.analysis.trace_align import analyze_run
    findings = analyze_run(load_traces("report"), outcomes, world_size=2)

Pure (no process group). Collectives are aligned per process group by their per-group sequence number: every
member of a group must issue the same collective at the same position. Point-to-point ops are paired per
(sender, receiver) instead. What "the same" means is per op (see ``signature``): an all_gather with a list of
differently sized outputs is legal as long as every rank passes the same list, all_to_all(_single) may move
different amounts per rank, and the *_object variants carry pickles of any size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from distcheck.analysis.hang import hang_finding as make_hang_finding, progress_from_events
from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.torch_errors import brief, first_line, lost_peer, translate
from distcheck.analysis.trace_events import (P2P_OPS, RankError, RankTrace, TraceEvent, last_completed,
                                             last_started, open_events)
from distcheck.contract.findings import Finding, format_ranks

# Ops that are the same backend collective under different API names (c10d vs functional, old vs new names).
_CANONICAL = {
    "all_gather_into_tensor": "all_gather_single", "all_gather_tensor": "all_gather_single",
    "all_gather_single_autograd": "all_gather_single", "all_gather_tensor_autograd": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single", "reduce_scatter_single_autograd": "reduce_scatter_single",
    "reduce_scatter_tensor_autograd": "reduce_scatter_single", "all_to_all_single_autograd": "all_to_all_single",
    "all_gather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "all_reduce_inplace": "all_reduce", "monitored_barrier": "barrier",
}
_OBJECT_OPS = frozenset({"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"})

STATE_OK = "ok"  # the script returned
STATE_ERROR = "error"  # the script raised
STATE_DIED = "died"  # exited without reporting (signal, os._exit, segfault)
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
    group_key: str
    position: int  # per-group sequence number (1 = the group's first collective)
    kind: str  # "different" | "extra" | "missing"
    events: dict[int, TraceEvent | None]  # what each member issued there (None: nothing)
    ranks: list[int]  # the odd ranks
    fields: list[str] = field(default_factory=list)  # what differs: op, shapes, dtypes, reduce_op, root, ...


def canonical_op(op: str) -> str:
    return _CANONICAL.get(op, op)


def signature(e: TraceEvent) -> tuple:
    """What must be identical on every rank of the group at one position, per op.

    Returns (op, shapes, dtypes, reduce_op, root, extra) with shapes reduced to what the op requires to agree.
    """
    op = canonical_op(e.op)
    shapes: Any = [tuple(s) for s in e.shapes]
    dtypes: Any = tuple(e.dtypes)
    if op in _OBJECT_OPS:
        # Pickled payloads differ in size by design; the op, root and list length must agree.
        return (op, None, None, None, e.root, e.extra.get("objects"))
    if op == "all_gather" and len(shapes) >= 2:
        shapes = shapes[:-1]  # the output list must agree; each rank's input fills its own slot (uneven is legal)
        dtypes = dtypes[:-1]
    elif op in ("gather", "scatter"):
        shapes, dtypes = shapes[:1], dtypes[:1]  # the list is only passed on the root
    elif op == "reduce_scatter" and len(shapes) >= 2:
        shapes, dtypes = shapes[1:], dtypes[1:]
    elif op == "all_to_all":
        shapes = len(shapes)  # per-peer sizes may differ; the number of peers may not
    elif op == "all_to_all_single" and e.extra.get("uneven"):
        shapes = [s[1:] for s in shapes]
    return (op, tuple(shapes) if isinstance(shapes, list) else shapes, dtypes, e.reduce_op, e.root, None)


_FIELDS = ("op", "shapes", "dtypes", "reduce_op", "root", "objects")


def differing_fields(events: list[TraceEvent]) -> list[str]:
    sigs = [signature(e) for e in events]
    return [name for i, name in enumerate(_FIELDS) if len({repr(s[i]) for s in sigs}) > 1]


def _collectives_by_group(traces: dict[int, RankTrace]) -> dict[str, tuple[tuple[int, ...], dict[int, list[TraceEvent]]]]:
    groups: dict[str, tuple[tuple[int, ...], dict[int, list[TraceEvent]]]] = {}
    for rank, trace in traces.items():
        for e in trace.events:
            if e.op in PEER_OPS:
                continue
            members, per_rank = groups.setdefault(e.group_key, (e.pg, {}))
            per_rank.setdefault(rank, []).append(e)
    for members, per_rank in groups.values():
        for events in per_rank.values():
            events.sort(key=lambda e: (e.seq, e.id))
    return groups


def _odd_ranks(present: dict[int, TraceEvent]) -> list[int]:
    buckets: dict[tuple, list[int]] = {}
    for r, e in sorted(present.items()):
        buckets.setdefault(signature(e), []).append(r)
    ordered = sorted(buckets.values(), key=lambda rs: (-len(rs), rs[0]))
    if len(ordered[0]) == 1:  # no majority (e.g. 2 ranks that disagree): every rank is involved
        return sorted(present)
    return sorted(r for rs in ordered[1:] for r in rs)


def find_divergences(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome]) -> list[Divergence]:
    """The first divergence of each process group, in order of time."""
    out: list[Divergence] = []
    for key, (members, per_rank) in _collectives_by_group(traces).items():
        members = tuple(members) or tuple(sorted(per_rank))
        longest = max((len(v) for v in per_rank.values()), default=0)
        for i in range(longest):
            present = {r: per_rank[r][i] for r in members if len(per_rank.get(r, [])) > i}
            absent = [r for r in members if r not in present]
            if len({signature(e) for e in present.values()}) > 1:
                events = {r: present.get(r) for r in members}
                out.append(Divergence(members, key, i + 1, "different", events, _odd_ranks(present),
                                      differing_fields(list(present.values()))))
                break
            if absent:
                # A rank that finished cleanly without this collective will never issue it: a real extra/missing
                # collective. A rank that raised, died or hung stopped early for its own reason (reported as such).
                if all(outcomes.get(r, RankOutcome(r, STATE_UNKNOWN)).state == STATE_OK for r in absent):
                    have = sorted(present)
                    kind, odd = ("extra", have) if len(have) <= len(absent) else ("missing", sorted(absent))
                    out.append(Divergence(members, key, i + 1, kind, {r: present.get(r) for r in members}, odd))
                break
    out.sort(key=lambda d: min((e.t_start for e in d.events.values() if e is not None), default=0.0))
    return out


def _where(e: TraceEvent) -> str:
    return f" at {e.site}" if e.site else ""


def _group_label(group: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, group)) + "]"


def _state_phrase(o: RankOutcome | None) -> str:
    if o is None or o.state == STATE_UNKNOWN:
        return "never reported back"
    return {STATE_OK: "finished its script", STATE_ERROR: "raised", STATE_DIED: "died",
            STATE_HUNG: "was still running", STATE_STOPPED: "was stopped while waiting"}.get(o.state, o.state)


def divergence_finding(d: Divergence, outcomes: dict[int, RankOutcome],
                       backend_errors: dict[int, str]) -> Finding:
    where = f"collective #{d.position} on group {_group_label(d.group)}"
    issued = {r: (e.to_json() if e is not None else None) for r, e in d.events.items()}
    primary: TraceEvent | None = None
    if d.kind == "different":
        buckets: dict[tuple, list[int]] = {}
        for r, e in d.events.items():
            if e is not None:
                buckets.setdefault((e.brief(), e.site), []).append(r)
        parts = [f"{format_ranks(rs)} issued {brief}" + (f" at {site}" if site else "")
                 for (brief, site), rs in sorted(buckets.items(), key=lambda kv: kv[1][0])]
        primary = next((d.events[r] for r in d.ranks if d.events.get(r) is not None), None)
        message = f"{where} differs in {', '.join(d.fields) or 'signature'}: " + "; ".join(parts)
    elif d.kind == "extra":
        e = d.events[d.ranks[0]]
        primary = e
        others = [r for r in d.group if r not in d.ranks]
        message = (f"{format_ranks(d.ranks)} issued an extra {e.brief()}{_where(e)} ({where}); "
                   f"{format_ranks(others)} issued no collective there ("
                   + ", ".join(sorted({_state_phrase(outcomes.get(r)) for r in others})) + ")")
    else:
        have = [r for r in d.group if d.events.get(r) is not None]
        e = d.events[have[0]]
        primary = e
        message = (f"{format_ranks(d.ranks)} never issued {where}: {format_ranks(have)} issued "
                   f"{e.brief()}{_where(e)}; {format_ranks(d.ranks)} "
                   + ", ".join(sorted({_state_phrase(outcomes.get(r)) for r in d.ranks})) + " without it")
    detail: dict[str, Any] = {"group": list(d.group), "group_name": d.group_key, "position": d.position,
                              "divergence": d.kind, "fields": d.fields, "issued": issued}
    if primary is not None and primary.line is not None:
        detail["file"] = primary.file
        detail["line"] = primary.line
    if backend_errors:
        detail["backend_errors"] = backend_errors
        first = next(iter(backend_errors.values()))
        message += " (backend error: " + (brief(first) or first_line(first)) + ")"
    return Finding("collective_mismatch", d.ranks, message, detail)


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
            if len(s_list) != len(r_list) and both_ok:
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


def position_of(rank: int, trace: RankTrace | None, outcome: RankOutcome | None) -> dict[str, Any]:
    """Where a rank is: its state, the collective it waits in (if any), its last started and completed ones."""
    events = trace.events if trace is not None else []
    waiting = open_events(events)
    started, completed = last_started(events), last_completed(events)
    return {
        "state": outcome.state if outcome is not None else STATE_UNKNOWN,
        "waiting_in": waiting[0].to_json() if waiting else None,
        "last_started": started.to_json() if started else None,
        "last_completed": completed.to_json() if completed else None,
    }


def describe_position(rank: int, trace: RankTrace | None, outcome: RankOutcome | None) -> str:
    events = trace.events if trace is not None else []
    waiting = open_events(events)
    if outcome is not None and outcome.state == STATE_OK:
        return f"rank {rank} finished its script"
    if waiting:
        e = waiting[0]  # the earliest op not completed: later async ops queue behind it
        return f"rank {rank} waits in {e.op} #{e.seq} on group {_group_label(e.pg)}{_where(e)}"
    last = last_started(events)
    if last is not None and last.error is not None:
        return (f"rank {rank} failed in {last.op} #{last.seq} on group {_group_label(last.pg)}{_where(last)} "
                f"({brief(last.error) or first_line(last.error, 80)})")
    done = last_completed(events)
    if done is not None:
        return f"rank {rank} is outside collectives, last completed {done.op} #{done.seq}{_where(done)}"
    return f"rank {rank} issued no collective"


def _translation(o: RankOutcome, traces: dict[int, RankTrace]) -> dict[str, Any] | None:
    """A rank's error in terms of its model and trace (analysis/torch_errors.py), or None for an unknown error."""
    if o.error is None:
        return None
    trace = traces.get(o.rank)
    return translate(o.error.exc_type, o.error.message,
                     {**(o.error.context or {}), "events": trace.events if trace is not None else []})


def _same_error_key(o: RankOutcome, translated: dict[str, Any] | None) -> tuple | None:
    """Ranks whose failures have this key failed with one cause (the same error at the same line); None: its own."""
    err = o.error
    if err is None or o.signal:
        return None
    text = (translated or {}).get("message") or re.sub(r"\brank \d+", "rank N", first_line(err.message),
                                                         flags=re.IGNORECASE)
    return (err.exc_type, err.file, err.line, text)


def failure_findings(failed: list[RankOutcome], traces: dict[int, RankTrace],
                     outcomes: dict[int, RankOutcome]) -> list[Finding]:
    """One ``rank_failure`` per cause: ranks that raised the same error at the same line are one finding."""
    groups: dict[Any, list[tuple[RankOutcome, dict[str, Any] | None]]] = {}
    for o in failed:
        translated = _translation(o, traces)
        key = _same_error_key(o, translated)
        groups.setdefault(key if key is not None else ("rank", o.rank), []).append((o, translated))
    return [failure_finding(members[0][0], traces, outcomes, [o.rank for o, _ in members], members[0][1])
            for members in groups.values()]


def failure_finding(o: RankOutcome, traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome],
                    ranks: list[int] | None = None, translated: dict[str, Any] | None = None) -> Finding:
    """The failure of rank ``o`` (and of ``ranks``, which failed the same way), with where every other rank was;
    ``translated``: its error in the user's terms (analysis/torch_errors.py), torch's text kept in detail."""
    ranks = sorted(ranks or [o.rank])
    trace = traces.get(o.rank)
    others = [r for r in sorted(set(traces) | set(outcomes)) if r not in ranks]
    detail: dict[str, Any] = {"exit_code": o.exit_code, "signal": o.signal,
                              "positions": {r: position_of(r, traces.get(r), outcomes.get(r))
                                            for r in sorted(set(traces) | set(outcomes))}}
    if o.error is not None:
        err = o.error
        detail.update(exception=err.exc_type, error=err.message, traceback=err.traceback)
        where = f" at {err.site}" if err.site else ""
        what = f"raised {err.exc_type}: {first_line(err.message)}{where}"
        if translated and translated.get("message"):  # torch's text stays in detail["error"]
            what = f"raised {err.exc_type}{where}: {translated['message']}"
            detail.update(translated.get("detail") or {})
        if err.line is not None:
            detail.update(file=err.file, line=err.line)
    elif o.signal:
        what = f"died from {o.signal}" + (f" (exit code {o.exit_code})" if o.exit_code is not None else "")
    else:
        what = f"exited with code {o.exit_code} without reporting an exception"
    events = trace.events if trace is not None else []
    last = last_started(events)
    if o.error is None and last is not None:
        what += f" after {last.op} #{last.seq}{_where(last)}"
        if last.line is not None and "line" not in detail:
            detail.update(file=last.file, line=last.line)
    positions = "; ".join(describe_position(r, traces.get(r), outcomes.get(r)) for r in others)
    message = f"{format_ranks(ranks)} {what}" + (f"; {positions}" if positions else "")
    if len(ranks) > 1:
        detail["errors"] = {r: outcomes[r].error.message for r in ranks
                            if r in outcomes and outcomes[r].error is not None}
    return Finding("rank_failure", ranks, message, detail)


def hang_finding(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome], timeout: float) -> Finding:
    """No progress for ``timeout`` seconds: every rank's position, from the traces alone."""
    ranks = sorted(set(traces) | set(outcomes))
    hung = [r for r in ranks if outcomes.get(r) is not None and outcomes[r].state == STATE_HUNG] or ranks
    positions = {r: position_of(r, traces.get(r), outcomes.get(r)) for r in ranks}
    site = None
    for r in hung:
        waiting = open_events(traces[r].events) if r in traces else []
        if waiting and waiting[0].line is not None:
            site = (waiting[0].file, waiting[0].line)
            break
    message = (f"no progress for {timeout:g}s: "
               + "; ".join(describe_position(r, traces.get(r), outcomes.get(r)) for r in ranks))
    progress = {r: progress_from_events(r, t.events) for r, t in traces.items()}
    return make_hang_finding(hung, message, timeout=timeout, progress=progress, site=site, positions=positions)


def _explained_by(o: RankOutcome, divergences: list[Divergence], trace: RankTrace | None) -> Divergence | None:
    """The divergence a rank's failure came from: it raised or died in or after its collective at that position."""
    last = last_started(trace.events) if trace is not None else None
    for d in divergences:
        e = d.events.get(o.rank)
        if e is None:
            continue
        if o.error is not None and (e.error is not None or e.t_end is None or o.error.t >= e.t_start):
            return d
        if o.error is None and last is not None and last.t_start >= e.t_start:
            return d  # died (e.g. SIGABRT inside gloo) at or after the diverging collective
    return None


def _failed_in_collective(o: RankOutcome, trace: RankTrace | None) -> TraceEvent | None:
    """The collective a rank's exception came out of (a backend error), or None for an error in user code."""
    if o.error is None or trace is None:
        return None
    last = last_started(trace.events)
    if last is not None and last.error is not None:
        return last
    return None


def _failure_text(o: RankOutcome) -> str:
    if o.error is not None:
        return f"{o.error.exc_type}: {o.error.message}"
    if o.signal:
        return f"died from {o.signal} (exit code {o.exit_code})"
    return f"exited with code {o.exit_code}"


def analyze_run(traces: dict[int, RankTrace], outcomes: dict[int, RankOutcome], world_size: int,
                timeout: float | None = None, hang_findings: list[Finding] | None = None) -> list[Finding]:
    """All findings of a traced run: collective mismatches first, then failures and the hang."""
    divergences = find_divergences(traces, outcomes)
    errors_by_div: dict[int, dict[int, str]] = {}
    failed: list[RankOutcome] = []
    for r in sorted(outcomes):
        o = outcomes[r]
        if o.state not in (STATE_ERROR, STATE_DIED, STATE_UNKNOWN):
            continue
        d = _explained_by(o, divergences, traces.get(r))
        if d is not None:
            # A cryptic backend error ("Connection closed by peer", SIGABRT in gloo) caused by the mismatch:
            # the mismatch is the diagnosis, the error is kept as evidence.
            errors_by_div.setdefault(id(d), {})[r] = _failure_text(o)
            continue
        failed.append(o)
    # A backend error raised inside a collective after another rank failed in its own code is a consequence of
    # that failure ("Connection reset by peer"): keep it in the root failure's detail, not as a second finding.
    roots = [o for o in failed if _failed_in_collective(o, traces.get(o.rank)) is None]
    if not roots:  # all failed inside collectives: those that only lost a peer failed because that peer did
        roots = [o for o in failed if o.error is None or not lost_peer(o.error.message)]
    failures = failure_findings([o for o in failed if not roots or o in roots], traces, outcomes)
    consequences = {c.rank: _failure_text(c) for c in failed if c not in roots}
    if consequences and roots:
        for f in failures:
            f.detail["consequences"] = consequences
    findings = [divergence_finding(d, outcomes, errors_by_div.get(id(d), {})) for d in divergences]
    findings += find_p2p_mismatches(traces, outcomes)
    findings += failures
    if any(o.state == STATE_HUNG for o in outcomes.values()):
        findings += hang_findings if hang_findings else [hang_finding(traces, outcomes, timeout or 0.0)]
    return findings


def provably_stuck(traces: dict[int, RankTrace], finished: set[int]) -> str | None:
    """Why the run can no longer progress, or None: a running rank waits in a collective at a group position
    that a finished member never issued, or every member of a group has issued a different collective at the
    same position and none of them completed."""
    groups = _collectives_by_group(traces)
    for rank, trace in sorted(traces.items()):
        if rank in finished:
            continue
        for e in open_events(trace.events):
            if e.op in PEER_OPS or e.extra.get("api") == "functional":
                continue
            members, per_rank = groups.get(e.group_key, ((), {}))
            for m in members:
                if m in finished and len(per_rank.get(m, [])) < e.seq:
                    return (f"rank {rank} waits in {e.op} #{e.seq} on group {_group_label(e.pg)}{_where(e)}, "
                            f"which rank {m} finished without issuing")
    for key, (members, per_rank) in groups.items():
        for i in range(max((len(v) for v in per_rank.values()), default=0)):
            present = {r: per_rank[r][i] for r in members if len(per_rank.get(r, [])) > i}
            if len(present) < len(members):
                break
            if len({signature(e) for e in present.values()}) > 1:
                if all(not e.completed for e in present.values()):
                    return f"ranks {','.join(map(str, members))} issued different collectives #{i + 1} and wait"
                break
    return None
