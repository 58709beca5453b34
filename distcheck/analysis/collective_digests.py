"""Collectives compared across nodes without sending them: digests of each rank's call signatures per window.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m distcheck run -- train.py   # every node's watcher sends its digests

Each node compares its own ranks collective by collective (analysis/trace_align.py). Across nodes, sending every
collective would cost a node 8 ranks x 20,000 records; instead each node's summary (contract/node_summary.py)
holds, per process group (TraceEvent.group_key) and per rank, how many collectives it issued there and one 8-byte
digest per WINDOW positions of their signatures (call_signature.signature: what must agree at a position). Node 0
compares the digests (:func:`first_windows`); only where two ranks of different nodes differ does it ask their
nodes for the signatures of that one window, and :func:`cross_node_divergence` names the first differing position
as the one-node alignment would.

Pure: the callers read the ranks' files (supervise/node_exchange.py) and move the digests through the store.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from distcheck.analysis.call_signature import differing_fields, signature
from distcheck.analysis.ops import PEER_OPS
from distcheck.analysis.rank_trace import TraceEvent, _event
from distcheck.contract.findings import Finding, format_ranks

WINDOW = 256  # positions per digest: 20,000 collectives are 79 digests (1.3 KB of hex) per rank and group


TAIL_WINDOWS = 2  # the windows at a rank's end whose signatures also travel one by one (16 hex digits each)


@dataclass
class RankDigests:
    """One rank's collectives on one group: how many, the digest of each WINDOW of their signatures, and each
    signature's hash in its last TAIL_WINDOWS windows (from position ``tail_from``): ranks that stopped a few
    collectives apart (one failed, the others lost it) compare there without asking their nodes."""

    count: int
    windows: list[str]
    tail_from: int = 0
    tail: str = ""  # 16 hex digits per position

    def to_json(self) -> list[Any]:
        return [self.count, self.windows, self.tail_from, self.tail]

    @classmethod
    def from_json(cls, data: Sequence[Any]) -> RankDigests:
        return cls(int(data[0]), [str(w) for w in data[1]], int(data[2]) if len(data) > 2 else 0,
                   str(data[3]) if len(data) > 3 else "")

    def hash_at(self, pos: int) -> str | None:
        i = pos - self.tail_from
        return self.tail[16 * i:16 * i + 16] if 0 <= i and 16 * (i + 1) <= len(self.tail) else None


def signature_hash(desc: Mapping[str, Any], rank: int) -> int:
    """A call's signature (its sig line) as 8 bytes, the same on every rank and node that issued the same call."""
    sig = signature(_event(rank, dict(desc), 0, 0, 0.0))
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little")


def group_of(desc: Mapping[str, Any]) -> str | None:
    """TraceEvent.group_key of a traced collective's sig line; None for point-to-point ops (paired per peer)."""
    if str(desc.get("op")) in PEER_OPS or desc.get("op") == "batch_isend_irecv":
        return None
    pg = desc.get("pg")
    return desc.get("pg_name") or (pg if isinstance(pg, str) else ",".join(map(str, pg or ())))


def rank_digests(sigs: Mapping[int, Mapping[str, Any]], sig_numbers: Sequence[int], rank: int,
                 window: int = WINDOW) -> dict[str, RankDigests]:
    """``{group: RankDigests}`` of one rank, from its sig lines (``{sig id: desc}``) and the sig id of each of its
    collectives in order (its record slots). Linear in the collectives; numpy when given an array."""
    hashes: dict[int, tuple[str | None, int]] = {}
    for number, desc in sigs.items():
        group = group_of(desc)
        hashes[int(number)] = (group, signature_hash(desc, rank) if group is not None else 0)
    per_group: dict[str, list[int]] = {}
    try:
        import numpy as np

        numbers = np.asarray(sig_numbers, dtype=np.uint32)
        ids = np.unique(numbers)
        known = [int(i) for i in ids if int(i) in hashes and hashes[int(i)][0] is not None]
        groups: dict[str, list[int]] = {}
        for i in known:
            groups.setdefault(hashes[i][0], []).append(i)  # type: ignore[arg-type]
        lookup = np.zeros(int(numbers.max(initial=0)) + 1, dtype=np.uint64)
        for i in known:
            lookup[i] = hashes[i][1]
        out: dict[str, RankDigests] = {}
        for group, members in groups.items():
            seq = lookup[numbers[np.isin(numbers, np.array(members, dtype=np.uint32))]]
            tail_from = max(0, (-(-len(seq) // window) - TAIL_WINDOWS) * window)
            out[group] = RankDigests(len(seq), [_digest(seq[i:i + window].tobytes())
                                                for i in range(0, len(seq), window)],
                                     tail_from, "".join(f"{int(h):016x}" for h in seq[tail_from:].tolist()))
        return out
    except ImportError:  # the watcher runs without numpy too: the same digests, in Python
        for number in sig_numbers:
            group, value = hashes.get(int(number), (None, 0))
            if group is not None:
                per_group.setdefault(group, []).append(value)
        out = {}
        for g, v in per_group.items():
            tail_from = max(0, (-(-len(v) // window) - TAIL_WINDOWS) * window)
            out[g] = RankDigests(len(v), [_digest(b"".join(x.to_bytes(8, "little") for x in v[i:i + window]))
                                          for i in range(0, len(v), window)],
                                 tail_from, "".join(f"{x:016x}" for x in v[tail_from:]))
        return out


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass
class WindowAsk:
    """Node 0 asks the ranks of one group for their signatures at positions ``lo`` to ``hi - 1`` (0-based)."""

    group: str
    lo: int
    hi: int
    ranks: list[int]
    stands_for: dict[int, list[int]] = field(default_factory=dict)  # rank -> the ranks that sent its digests

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "lo": self.lo, "hi": self.hi, "ranks": self.ranks}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WindowAsk:
        return cls(str(d["group"]), int(d["lo"]), int(d["hi"]), [int(r) for r in d.get("ranks") or []])


def first_windows(digests: Mapping[int, Mapping[str, RankDigests]], node_of: Callable[[int], int],
                  window: int = WINDOW) -> list[WindowAsk]:
    """Per group, the first window where ranks of different nodes may differ: their digests differ there (a rank
    that issued fewer collectives is compared as far as it went). Ranks of one node are that node's to compare.
    ``digests``: ``{rank: {group: RankDigests}}`` of every rank that sent some."""
    by_group: dict[str, dict[int, RankDigests]] = {}
    for rank, groups in digests.items():
        for group, d in groups.items():
            by_group.setdefault(group, {})[rank] = d
    asks = []
    for group, all_ranks in sorted(by_group.items()):
        if len({node_of(r) for r in all_ranks}) < 2:
            continue
        # Ranks that sent the same count and digests are one: one of them stands for all (100,000 ranks of a
        # correct job are a single representative, compared against nothing).
        alike: dict[tuple, int] = {}
        members: dict[int, list[int]] = {}
        keys: dict[int, tuple] = {}  # id(d) -> its key: ranks that share one decoded entry are keyed once
        for r in sorted(all_ranks):
            d = all_ranks[r]
            key = keys.get(id(d))
            if key is None:
                key = keys[id(d)] = (d.count, tuple(d.windows), d.tail_from, d.tail)
            members.setdefault(alike.setdefault(key, r), []).append(r)
        if len(alike) < 2:
            continue
        ranks = {r: all_ranks[r] for r in alike.values()}
        longest = max(len(d.windows) for d in ranks.values())
        for w in range(longest):
            lo, hi = w * window, (w + 1) * window
            # Ranks that reach into this window; one that stopped inside it is compared up to where it stopped.
            reach = {r: d for r, d in ranks.items() if d.count > lo}
            if len(reach) < 2:
                break
            full = {r: d.windows[w] for r, d in reach.items() if d.count >= hi}
            partial = {r: d for r, d in reach.items() if d.count < hi}
            differs = len(set(full.values())) > 1
            if not differs and partial and (full or len({d.windows[w] for d in partial.values()}) > 1
                                            or len({d.count for d in partial.values()}) > 1):
                # Ranks that ended inside this window: compared position by position as far as each went, from
                # the signatures' hashes their summaries carry; asked of their nodes where those do not reach.
                differs = _tails_differ(reach, lo, hi)
            if differs:
                # Only one rank per distinct digest needs to say what it issued (its node is asked, no other).
                chosen: dict[str, int] = {}
                stands: dict[int, list[int]] = {}
                for r in sorted(reach):
                    stands.setdefault(chosen.setdefault(reach[r].windows[w], r), []).extend(members[r])
                asks.append(WindowAsk(group, lo, hi, sorted(chosen.values()), stands))
                break
    return asks


def _tails_differ(reach: Mapping[int, RankDigests], lo: int, hi: int) -> bool:
    """Whether ranks that reach into window [lo, hi) may differ there: True where their hashes differ at a position
    both reached, or where a rank's hashes do not cover what it reached (then its node is asked)."""
    for pos in range(lo, hi):
        seen = set()
        for d in reach.values():
            if pos >= d.count:
                continue
            h = d.hash_at(pos)
            if h is None:
                return True
            seen.add(h)
        if len(seen) > 1:
            return True
        if not seen:
            return False
    return False


def cross_node_divergence(ask: WindowAsk, events: Mapping[int, Mapping[int, TraceEvent]],
                          host_of: Callable[[int], str], members: Sequence[int] | None = None) -> Finding | None:
    """The first position of ``ask``'s window where the ranks' signatures differ (``events``: ``{rank: {position
    (0-based): event}}``, as their nodes sent them), as a ``collective_mismatch`` naming each side's ranks, nodes,
    signatures and lines; None when they agree as far as each rank went (the digests differed past an end)."""
    for pos in range(ask.lo, ask.hi):
        present = {r: ev[pos] for r, ev in events.items() if pos in ev}
        if len(present) < 2:
            return None
        if len({signature(e) for e in present.values()}) == 1:
            continue
        fields = differing_fields(list(present.values()))
        buckets: dict[tuple, list[int]] = {}
        for r, e in sorted(present.items()):
            # a representative stands for every rank that sent its digests
            buckets.setdefault((signature(e), e.brief(), e.site), []).extend(ask.stands_for.get(r, [r]))
        parts = []
        for (_, brief, site), ranks in sorted(buckets.items(), key=lambda kv: min(kv[1])):
            ranks.sort()
            hosts = sorted({host_of(r) for r in ranks})
            shown = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more nodes" if len(hosts) > 4 else "")
            parts.append(f"{format_ranks(ranks)} ({shown}) issued {brief}" + (f" at {site}" if site else ""))
        first = next(iter(present.values()))
        size = int(first.extra.get("pg_size") or 0)
        group = list(members) if members else list(first.pg) or sorted(present)
        label = ("[" + ",".join(map(str, group)) + "]" if len(group) <= 16 and not size
                 else f"{ask.group} ({size or len(group)} ranks)")
        largest = max(buckets.values(), key=len)
        total = sum(len(rs) for rs in buckets.values())
        odd = sorted(r for rs in buckets.values() for r in rs) if len(largest) * 2 <= total else sorted(
            r for rs in buckets.values() if rs is not largest for r in rs)
        message = (f"collective #{pos + 1} on group {label} differs in {', '.join(fields) or 'signature'} across "
                   f"nodes: " + "; ".join(parts))
        detail: dict[str, Any] = {
            "group": group if len(group) <= 64 else None, "group_size": size or len(group), "group_name": ask.group, "position": pos + 1, "divergence": "different",
            "fields": fields, "across_nodes": True,
            "issued": {str(r): {**e.to_json(), "host": host_of(r)} for r, e in sorted(present.items())}}
        if first.line is not None:
            detail["file"], detail["line"] = first.file, first.line
        return Finding("collective_mismatch", odd, message, detail)
    return None


def event_from_json(rank: int, d: Mapping[str, Any]) -> TraceEvent:
    """A collective as a node sent it (TraceEvent.to_json), back into a TraceEvent for the comparison."""
    desc = dict(d)
    if desc.get("pg") is None:
        desc["pg"] = ()
    e = _event(rank, desc, 0, int(d.get("seq") or 0), 0.0)
    e.extra = {k: v for k, v in (d.get("extra") or {}).items()}
    return e


def events_json(events: Iterable[tuple[int, TraceEvent]]) -> dict[str, dict[str, Any]]:
    """``{position: event JSON}`` of one rank's window, what a node sends back for a WindowAsk."""
    return {str(pos): {**e.to_json(), "extra": {**{k: v for k, v in e.extra.items() if k in ("uneven", "objects")},
                                                **({"pg_size": len(e.pg)} if len(e.pg) > 16 else {})}}
            for pos, e in events}
