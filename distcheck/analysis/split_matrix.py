"""The per-peer sizes of an exchange must pair up: what rank i sends to rank j is what j expects from i.

    python -m distcheck run --nproc 2 -- fixtures/a2a_split_mismatch.py     # an MoE dispatch whose splits disagree

At one position of a group's sequence, every member issued the same all_to_all_single (or all_to_all, or the list
forms of all_gather and reduce_scatter): their signatures agree, since per-peer sizes may legally differ. The
tracer records each rank's ``split`` with the call's start ({"send": [shape per peer], "recv": [shape per peer]},
rank/tracer._peer_split), before the backend sees it, so it is there even when gloo aborts the process on sizes
that do not pair up. This module finds the pairs that do not, and says it in the user's terms: rows (tokens, for an
MoE dispatch) each rank sends to each peer, and what each peer expects. Pure.

Flight Recorder's analyzer compares only an all_to_all's totals, and cannot tell which rank is the source
(torch/distributed/flight_recorder/components/utils.py); the pair names both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


SHOWN_PAIRS = 4  # pairs the message names; every one is in the finding's detail
SHOWN_ROWS = 8  # ranks whose row of the matrix the message shows


@dataclass
class PairMismatch:
    src: int  # the sending rank
    dst: int  # the receiving rank
    sent: Any  # what src sends to dst (a shape)
    expected: Any  # what dst expects from src (a shape)

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "sent": self.sent, "expected": self.expected}


def split_of(event: Any) -> dict[str, Any] | None:
    split = event.extra.get("split") if event is not None else None
    return split if isinstance(split, dict) and "send" in split and "recv" in split else None


def mismatched_pairs(events: Mapping[int, Any], members: Sequence[int]) -> list[PairMismatch]:
    """Every (i, j) where i's send to j differs from j's receive from i, by global rank; none when a member has
    no recorded split (an older trace, a group past the tracer's limit) or the lists do not span the group."""
    splits = {r: split_of(events.get(r)) for r in members}
    n = len(members)
    if any(s is None or len(s["send"]) != n or len(s["recv"]) != n for s in splits.values()):
        return []
    out = []
    for a, i in enumerate(members):
        for b, j in enumerate(members):
            sent, expected = splits[i]["send"][b], splits[j]["recv"][a]
            if sent != expected:
                out.append(PairMismatch(i, j, sent, expected))
    return out


def blamed(pairs: Sequence[PairMismatch], members: Sequence[int]) -> list[int]:
    """The ranks in every mismatched pair (one rank computed its sizes wrong: it is on one side of each), else every
    rank in one."""
    involved = [{p.src, p.dst} for p in pairs]
    common = set.intersection(*involved) if involved else set()
    if common and len(common) < len(members):
        return sorted(common)
    return sorted(set().union(*involved))


def _amount(shape: Any, unit: str | None) -> str:
    if shape is None:
        return "nothing"
    if unit == "rows" and isinstance(shape, list) and shape:
        return f"{shape[0]} row{'s' if shape[0] != 1 else ''}"
    return f"a tensor of shape {shape}"


def _at(event: Any) -> str:
    return f" ({event.site})" if event is not None and event.site else ""


def _matrix_rows(events: Mapping[int, Any], members: Sequence[int], side: str) -> str:
    rows = []
    for r in list(members)[:SHOWN_ROWS]:
        split = split_of(events.get(r)) or {}
        rows.append(f"rank {r} {[s[0] if isinstance(s, list) and s else s for s in split.get(side) or []]}")
    more = f"; +{len(members) - SHOWN_ROWS} more ranks" if len(members) > SHOWN_ROWS else ""
    return "; ".join(rows) + more


def describe(pairs: Sequence[PairMismatch], events: Mapping[int, Any], members: Sequence[int]) -> str:
    """``rank 0 sends 5 rows to rank 1 (moe.py:25), rank 1 expects 3 rows from rank 0 (moe.py:31)``, for the first
    pairs, then for row splits the whole matrix: the rows (tokens) each rank sends to each peer, and what each
    expects."""
    unit = (split_of(events.get(members[0])) or {}).get("unit")
    parts = [f"rank {p.src} sends {_amount(p.sent, unit)} to rank {p.dst}{_at(events.get(p.src))}, rank {p.dst} "
             f"expects {_amount(p.expected, unit)} from rank {p.src}{_at(events.get(p.dst))}"
             for p in pairs[:SHOWN_PAIRS]]
    if len(pairs) > SHOWN_PAIRS:
        parts.append(f"+{len(pairs) - SHOWN_PAIRS} more pairs")
    text = "; ".join(parts)
    if unit == "rows":
        text += (f". Rows (tokens) each rank sends to ranks {', '.join(map(str, members[:SHOWN_ROWS]))}"
                 f"{', ...' if len(members) > SHOWN_ROWS else ''} in order "
                 f"(input_split_sizes): {_matrix_rows(events, members, 'send')}; rows each expects from them "
                 f"(output_split_sizes): {_matrix_rows(events, members, 'recv')}")
    return text


FIX = ("each rank's output_split_sizes must be what its peers' input_split_sizes send it: exchange the counts "
       "first (an all_to_all_single of each rank's per-peer counts) and use what arrives as output_split_sizes")
LIST_FIX = "each tensor a rank expects from a peer must have the shape of the one that peer sends it"
