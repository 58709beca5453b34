"""Who holds the job up: at each collective, the rank that arrived last and how long the others waited for it.

    python -m distcheck run --nproc 2 -- fixtures/straggler_data_loading.py   # report.txt's "stragglers" part

Every rank's trace holds each collective's start (the tracer's, or for what Python never called, DDP's buckets and
compiled graphs, the time the process group enqueued it: analysis/flight_recorder.py). At a position of a group's
sequence that every member reached, the member that started last held the others up: each waited from its own
start to the last one's. Added up per rank over the run (and per window of positions), that names the straggler:
"rank 1 arrived last at 15 of 16 collectives; the others waited 3.8 s for it in all (0.24 s a collective, 93% of
rank 0's time in the run's collectives span)". Where it spent that time comes from its samples (rank/sampler.py: its
main thread's line and what it was doing, 10 times a second) inside those gaps, less what the others' samples
show in their own gaps before the same collectives: what every rank does each step (a GPU job's forward and
backward) is not why one is late. "in load_batch (train.py:22, its own code) 95% of 40 samples beyond what the
others did in theirs"; without samples, from the trace: the collective it came from and the one it arrived late at.

A warning, not a finding: the program is correct. A balanced job names nobody: the rank that arrives last changes
from collective to collective, and the waits are small. Ranks on several hosts compare clocks that may disagree:
positions whose members are on different hosts are left out. Big jobs' summarized traces (analysis/trace_summary.py)
keep too few events for this and are skipped. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from distcheck.analysis.arrivals import counted, late_member, members_of, waits_by_start
from distcheck.contract.findings import Note

# A straggler arrives last at no fewer than MIN_LAST positions, and at least LAST_SHARE of those its groups reached
# (ties left out: TIE_WAIT), and the others' waits for it add up to MIN_WAIT_SHARE of the run's collective span and
# MIN_WAIT seconds: a busy machine (4 ranks on 2 cores) makes some rank late at a few collectives of a short job,
# never at most of them.
LAST_SHARE = 0.75
MIN_LAST = 6
MIN_WAIT_SHARE = 0.2
MIN_WAIT = 0.5
WINDOWS = 8
# Members that reach a collective within TIE_WAIT of each other arrived together: which of them the scheduler ran
# first is chance (a loaded 2-core machine). Such a position counts for no rank's share of last arrivals: 6 of a
# straggler's 21 positions were the start of the job, where rank 0 was "last" by 0.7 ms, and its 15 of 21 (0.71)
# fell under LAST_SHARE (the intermittent data-loading straggler test).
TIE_WAIT = 0.002
# Where the late rank's extra time went is told from its samples beyond the others' once there are this many (two
# seconds of extra time at the sampler's 10 a second): below, the difference of two sample counts is mostly noise
# (a 1-second compute straggler's backward went missing from it), and all its samples in the gaps say it instead
# (short jobs, where what every rank does each step is a small part).
MIN_BEYOND = 20.0


@dataclass
class RankLateness:
    rank: int
    positions: int = 0  # positions of its groups that every member reached
    last: int = 0  # of them, where it arrived last
    tied: int = 0  # of its positions, those whose members arrived within TIE_WAIT of each other
    tied_last: int = 0  # of those, where it was last all the same
    held: float = 0.0  # seconds the others waited for it (each position: the mean of their waits), in all
    waited: float = 0.0  # seconds it waited for the last one, in all
    gaps: dict[tuple, list] = field(default_factory=dict)  # (came from, arrived late at) -> [count, seconds]
    # Where its main thread was while the others waited (its samples in those gaps): place -> samples
    spent: dict[Any, float] = field(default_factory=dict)
    # Where the others' main threads were in their own gaps before the same collectives (mean over them): what
    # every rank does each step (the forward and backward of a GPU job) is not why this one is late
    usual: dict[Any, float] = field(default_factory=dict)

    def decided_last(self) -> int:
        """Its last arrivals where the others waited more than TIE_WAIT for it."""
        return self.last - self.tied_last

    def beyond(self) -> dict[Any, float]:
        """Its samples beyond the others' in the same gaps, by place: where its extra time went; empty when too
        few stand out to tell (no samples of the others, or fewer than MIN_BEYOND beyond theirs)."""
        extra = {p: n - self.usual.get(p, 0.0) for p, n in self.spent.items()}
        extra = {p: e for p, e in extra.items() if e > 0}
        return extra if self.usual and sum(extra.values()) >= MIN_BEYOND else {}

    def places(self) -> dict[Any, float]:
        """What says where it spent the others' wait: its samples beyond theirs, else all its samples."""
        return self.beyond() or self.spent

    def to_json(self) -> dict[str, Any]:
        return {"positions": self.positions, "last": self.last, "others_waited_s": round(self.held, 6),
                "waited_s": round(self.waited, 6)}


@dataclass
class Stragglers:
    ranks: dict[int, RankLateness]
    span: float  # seconds from the first collective's start to the last's end (on the ranks compared)
    named: list[int]
    windows: list[dict[str, Any]]
    skipped: str = ""  # why nothing was compared (summarized traces, no shared positions)

    def to_json(self) -> dict[str, Any]:
        return {"named": self.named, "span_s": round(self.span, 6), "skipped": self.skipped or None,
                "ranks": {str(r): v.to_json() for r, v in sorted(self.ranks.items())}, "windows": self.windows}

    def notes(self) -> list[Note]:
        return [Note("straggler", [r], straggler_text(self.ranks[r], self.span), {"rank": r,
                     **self.ranks[r].to_json(), "where": where_json(self.ranks[r])}) for r in self.named]

    def section(self) -> str:
        """report.txt's "stragglers" part: the named ones, then every rank's lateness."""
        if self.skipped:
            return f"not measured: {self.skipped}"
        lines = [straggler_text(self.ranks[r], self.span) for r in self.named] or [
            "none: the rank that arrives last changes from collective to collective, or the waits are small"]
        for r, v in sorted(self.ranks.items()):
            lines.append(f"  rank {r}: last at {v.last} of {v.positions} collectives; the others waited "
                         f"{v.held:.3f} s for it, it waited {v.waited:.3f} s for them")
        return "\n".join(lines)


def straggler_text(v: RankLateness, span: float) -> str:
    share = f" ({100 * v.held / span:.0f}% of the run's collective span, {span:.2f} s)" if span > 0 else ""
    per = v.held / v.last if v.last else 0.0
    text = (f"rank {v.rank} arrived last at {v.last} of {v.positions} collectives; the others waited {v.held:.2f} s "
            f"for it in all, {per:.3f} s a time{share}")
    spent = v.places()
    if spent:
        total = sum(spent.values())
        what, count = activity(spent)
        parts = [f"{p.func} ({p.site}, {p.kind}) {100 * n / total:.0f}%" for p, n in top_places(spent)]
        whose = " beyond what the others did in theirs" if spent is not v.spent else ""
        text += (f"; in those gaps it was mostly {what} ({100 * count / total:.0f}%): its main thread was in "
                 f"{', '.join(parts)} of {total:.0f} samples{whose}")
        return text
    top = _top_gap(v)
    if top is not None:
        (came_from, late_at), (count, seconds) = top
        text += (f"; it spends that time between {came_from} and {late_at} ({count} times, {seconds:.2f} s "
                 f"there)")
    return text


# What a late rank was doing, by the sampler's kinds (rank/sampler.py): the three causes users tell apart first.
ACTIVITIES = {"data loading": "loading data", "forward": "computing (forward, backward, optimizer step)",
              "backward": "computing (forward, backward, optimizer step)",
              "optimizer step": "computing (forward, backward, optimizer step)",
              "host sync": "in host syncs (.item(), .tolist(), .cpu(), synchronize, printing a tensor)",
              "a collective": "in other collectives"}


def activity(spent: dict[Any, float]) -> tuple[str, float]:
    """The activity most of these samples (RankLateness.places) were in, and how many samples that is."""
    counts: dict[str, float] = {}
    for place, n in spent.items():
        what = ACTIVITIES.get(place.kind, "in its own code")
        counts[what] = counts.get(what, 0) + n
    return max(counts.items(), key=lambda kv: kv[1])


def top_places(spent: dict[Any, float], n: int = 3) -> list[tuple[Any, float]]:
    return sorted(spent.items(), key=lambda kv: -kv[1])[:n]


def _top_gap(v: RankLateness) -> tuple | None:
    return max(v.gaps.items(), key=lambda kv: kv[1][1], default=None)


def where_json(v: RankLateness) -> dict[str, Any]:
    """``samples``: its samples in the gaps by place; ``beyond``: how many of them the others' gaps did not have
    (the places are sorted by that)."""
    spent = v.places()
    return {"activity": activity(spent)[0] if spent else None,
            "gaps": [{"from": a, "to": b, "count": n, "seconds": round(s, 6)}
                     for (a, b), (n, s) in sorted(v.gaps.items(), key=lambda kv: -kv[1][1])[:5]],
            "samples": [{"file": p.file, "line": p.line, "func": p.func, "kind": p.kind,
                         "samples": round(v.spent.get(p, 0)),
                         "beyond": round(v.spent.get(p, 0) - v.usual.get(p, 0.0), 1)}
                        for p, n in top_places(spent, 5)]}


def _label(e: Any) -> str:
    via = e.extra.get("via")
    what = f"{e.op}" + (f" ({via})" if via else "")
    return f"{what} at {e.site}" if e.site else what


# A node's summary carries the durations of its ranks' last this many positions (supervise/node_exchange.py).
DURATION_POSITIONS = 4096


def position_key(e: Any) -> str:
    """A collective's position, the same string on every rank of its group: its group's key and sequence number."""
    return f"{e.group_key}#{e.seq}"


def _completed(e: Any) -> bool:
    """The event's end is when it completed on this rank: a traced, synchronous, completed call. Not an untraced
    one (gloo's ring has no completion time: its end is a guess) nor a functional one (its end is the issue)."""
    return counted(e) and e.t_end is not None and not e.issued_only and not e.extra.get("untraced")


def durations(traces: Mapping[int, Any], limit: int = DURATION_POSITIONS) -> dict[str, dict[str, float]]:
    """Per position, each rank's time inside the collective (end minus start), for the last ``limit`` positions:
    what a node sends node 0 so that ranks on several hosts can be compared. Clock-free: the members of a collective
    leave it together, so the one that spent the least time inside arrived last, and each other waited about the
    difference, whatever each host's clock says."""
    out: dict[str, dict[str, float]] = {}
    order: dict[str, float] = {}
    for r, t in traces.items():
        for e in t.events:
            if _completed(e):
                key = position_key(e)
                out.setdefault(key, {})[str(r)] = round(e.t_end - e.t_start, 6)
                order[key] = max(order.get(key, 0.0), e.t_start)
    if len(out) > limit:
        keep = set(sorted(order, key=order.get)[-limit:])
        out = {k: v for k, v in out.items() if k in keep}
    return out


def analyze(traces: Mapping[int, Any], samples: Mapping[int, list] | None = None,
            remote: Mapping[str, Mapping[str, float]] | None = None) -> Stragglers:
    """Each rank's lateness over the run, the stragglers among them and the per-window counts. ``samples``: each
    rank's (time, place) samples (contract/samples_file.py), to say where a late rank spent the others' wait.
    ``remote``: the other nodes' ranks' :func:`durations` (node 0 of a multi-node job): a position whose members
    are on several hosts is compared by time inside the collective instead of by start."""
    if any(getattr(t, "summary", None) is not None for t in traces.values()):
        return Stragglers({}, 0.0, [], [], "a big job's traces are summarized")
    hosts = {r: t.meta.get("host") for r, t in traces.items()}
    positions: dict[tuple, dict[int, Any]] = {}
    # (rank, the event object's id) -> the rank's collective before it: what the process group ran that Python did
    # not call (analysis/flight_recorder.py) all has trace id 0
    previous: dict[tuple[int, int], Any] = {}
    first = last = None
    for r, t in traces.items():
        prev = None
        for e in sorted(t.events, key=lambda e: e.t_start):
            if not counted(e):
                continue
            positions.setdefault((e.group_key, e.seq), {})[r] = e
            previous[(r, id(e))] = prev
            prev = e
            first = e.t_start if first is None else min(first, e.t_start)
            end = e.t_end if e.t_end is not None else e.t_start
            last = end if last is None else max(last, end)
    ranks = {r: RankLateness(r) for r in traces}
    for times in (remote or {}).values():
        for r in times:
            ranks.setdefault(int(r), RankLateness(int(r)))
    reached = []
    for (key, seq), events in positions.items():
        members = members_of(events)
        if len(members) < 2:
            continue
        waits_of = waits_by_start(members, events, hosts) or _waits_by_time_inside(members, events, remote)
        if waits_of is None:
            continue  # a member's record is missing, or clocks of several hosts without the time inside
        late = late_member(members, waits_of)
        waits = [waits_of[m] for m in members if m != late]
        held = sum(waits) / len(waits)
        local = next(events[m] for m in members if m in events)
        reached.append((local.t_start, late, held))
        tie = held < TIE_WAIT
        for m in members:
            ranks[m].positions += 1
            ranks[m].waited += waits_of[m]
            ranks[m].tied += tie
        ranks[late].last += 1
        ranks[late].tied_last += tie
        ranks[late].held += held
        if late not in events:  # a rank of another node: its samples and trace stay there
            gap = ("its previous collective (its trace and samples are on its node)", _label(local))
            entry = ranks[late].gaps.setdefault(gap, [0, 0.0])
            entry[0] += 1
            entry[1] += held
            continue
        starts = {m: events[m].t_start for m in members if m in events}
        before = previous.get((late, id(events[late])))

        peers = [(m, previous.get((m, id(events[m])))) for m in members
                 if m != late and m in events and samples and samples.get(m)]
        # The first collective has no stretch before it to set against the others': counted only without theirs
        if samples and samples.get(late) and (before is not None or not peers):
            peers = [(m, b) for m, b in peers if b is not None]
            since = _ended(positions, hosts, late, before) if before is not None else starts[late] - held
            _count_samples(ranks[late].spent, samples[late], since, starts[late])
            for m, b in peers:  # the same stretch on each other member: its previous collective to this one
                _count_samples(ranks[late].usual, samples[m], _ended(positions, hosts, m, b), starts[m],
                               1 / len(peers))
        gap = (_label(before) if before is not None else "the start", _label(events[late]))
        entry = ranks[late].gaps.setdefault(gap, [0, 0.0])
        entry[0] += 1
        entry[1] += held
    span = (last - first) if first is not None and last is not None else 0.0
    if not reached:
        return Stragglers({r: v for r, v in ranks.items() if v.positions}, span, [], [],
                          "no collective was reached by every member of its group")
    named = [r for r, v in sorted(ranks.items())
             if v.decided_last() >= MIN_LAST and v.decided_last() >= LAST_SHARE * (v.positions - v.tied)
             and v.held >= max(MIN_WAIT, MIN_WAIT_SHARE * span)]
    return Stragglers({r: v for r, v in ranks.items() if v.positions}, span, named, _windows(reached))


def _ended(positions: Mapping[tuple, Mapping[int, Any]], hosts: Mapping[int, Any], rank: int, e: Any) -> float:
    """When ``rank``'s collective ``e`` ended, no earlier than its last member (on the same host) began it: gloo's
    ring says "completed" without a time (a DDP bucket's end is its creation), and the stretch from there was the
    others' wait inside it, not their own work (their backward's samples then hid the late rank's backward)."""
    began = [x.t_start for m, x in positions.get((e.group_key, e.seq), {}).items() if hosts.get(m) == hosts.get(rank)]
    return max([e.t_end or e.t_start, *began])


def _waits_by_time_inside(members: tuple, events: Mapping[int, Any],
                          remote: Mapping[str, Mapping[str, float]] | None) -> dict[int, float] | None:
    """Each member's wait for the last one, from the time each spent inside the collective (local records and the
    other nodes' durations): the one with the least time inside arrived last, the others waited the difference."""
    if not remote:
        return None
    local = next((events[m] for m in members if m in events), None)
    if local is None:
        return None
    sent = remote.get(position_key(local)) or {}
    inside: dict[int, float] = {}
    for m in members:
        if m in events:
            if not _completed(events[m]):
                return None
            inside[m] = events[m].t_end - events[m].t_start
        elif str(m) in sent:
            inside[m] = float(sent[str(m)])
        else:
            return None
    least = min(inside.values())
    return {m: t - least for m, t in inside.items()}


def _count_samples(spent: dict, samples: list, since: float, until: float, weight: float = 1.0) -> None:
    import bisect

    i = bisect.bisect_left(samples, (since,))  # (since,) sorts before every sample taken at or after since
    while i < len(samples) and samples[i][0] <= until:
        place = samples[i][1]
        spent[place] = spent.get(place, 0) + weight
        i += 1


def _windows(reached: list[tuple[float, int, float]]) -> list[dict[str, Any]]:
    """The positions in time order, cut into WINDOWS windows: who was last how often, and the waits for each."""
    reached.sort()
    size = max(1, -(-len(reached) // WINDOWS))
    out = []
    for i in range(0, len(reached), size):
        part = reached[i:i + size]
        last: dict[str, int] = {}
        held: dict[str, float] = {}
        for _, rank, wait in part:
            last[str(rank)] = last.get(str(rank), 0) + 1
            held[str(rank)] = round(held.get(str(rank), 0.0) + wait, 6)
        out.append({"positions": [i + 1, i + len(part)], "last": last, "others_waited_s": held})
    return out
