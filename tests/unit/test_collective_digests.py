"""Collectives compared across nodes by digests (analysis/collective_digests.py): pure, nothing launched."""
from __future__ import annotations

from distcheck.analysis.collective_digests import (WINDOW, RankDigests, WindowAsk, cross_node_divergence,
                                                   event_from_json, events_json, first_windows, rank_digests)
from distcheck.analysis.rank_trace import _event

AR64 = {"op": "all_reduce", "pg": "0,1,2,3", "shapes": [[64]], "dtypes": ["float32"], "reduce_op": "SUM",
        "site": "train.py:16", "file": "/job/train.py", "line": 16}
AR48 = {**AR64, "shapes": [[48]]}
BC = {"op": "broadcast", "pg": "0,1,2,3", "shapes": [[8]], "dtypes": ["int64"], "root": 0, "site": "train.py:9",
      "file": "/job/train.py", "line": 9}
SEND = {"op": "send", "pg": "0,1,2,3", "shapes": [[4]], "dtypes": ["float32"], "peer": 1, "site": "train.py:30",
        "file": "/job/train.py", "line": 30}


def node_of(rank: int) -> int:
    return rank // 2  # 2 ranks per node


def digests(calls: list[dict], rank: int) -> dict[str, RankDigests]:
    sigs = {i + 1: d for i, d in enumerate({id(c): c for c in calls}.values())}
    number = {id(d): n for n, d in sigs.items()}
    return rank_digests(sigs, [number[id(c)] for c in calls], rank)


def test_the_same_collectives_give_the_same_digests_on_every_rank_and_no_window_to_ask():
    calls = [BC] + [AR64] * 600 + [SEND]
    d = {r: digests(calls, r) for r in range(4)}
    assert set(d[0]) == {"0,1,2,3"}  # point-to-point ops are paired per peer, not by position
    assert d[0]["0,1,2,3"].count == 601 and len(d[0]["0,1,2,3"].windows) == -(-601 // WINDOW)
    assert d[0] == d[3]
    assert first_windows(d, node_of) == []


def test_a_node_that_issued_another_shape_is_asked_for_that_window_only():
    calls = [BC] + [AR64] * 600
    odd = [BC] + [AR64] * 300 + [AR48] + [AR64] * 299
    d = {0: digests(calls, 0), 1: digests(calls, 1), 2: digests(odd, 2), 3: digests(odd, 3)}
    (ask,) = first_windows(d, node_of)
    assert (ask.group, ask.lo, ask.hi) == ("0,1,2,3", WINDOW, 2 * WINDOW)
    assert ask.ranks == [0, 2] and ask.stands_for == {0: [0, 1], 2: [2, 3]}  # one rank per distinct digest


def test_ranks_of_one_node_are_that_nodes_to_compare():
    calls, odd = [AR64] * 10, [AR48] * 10
    assert first_windows({0: digests(calls, 0), 1: digests(odd, 1)}, node_of) == []


def test_ranks_that_stopped_a_few_collectives_apart_agree_without_asking():
    """A rank that failed at its second step and one that lost it: the same as far as both went."""
    d = {0: digests([AR64] * 2, 0), 2: digests([AR64] * 1, 2)}
    assert first_windows(d, node_of) == []
    assert first_windows({0: digests([AR64] * 2, 0), 2: digests([AR48], 2)}, node_of)[0].lo == 0


def test_a_rank_far_ahead_of_a_stopped_one_is_asked_where_the_hashes_do_not_reach():
    d = {0: digests([AR64] * (4 * WINDOW), 0), 2: digests([AR64] * 10, 2)}
    d[0]["0,1,2,3"].tail_from, d[0]["0,1,2,3"].tail = 2 * WINDOW, ""  # as a summary past the bound would hold
    (ask,) = first_windows(d, node_of)
    assert (ask.group, ask.lo, ask.hi, ask.ranks) == ("0,1,2,3", 0, WINDOW, [0, 2])


def test_the_divergence_names_each_sides_ranks_nodes_signatures_and_lines():
    ask = WindowAsk("0,1,2,3", 0, WINDOW, [0, 2])
    sent = {0: events_json([(0, _event(0, BC, 0, 1, 0.0)), (1, _event(0, AR64, 0, 2, 0.0))]),
            2: events_json([(0, _event(2, BC, 0, 1, 0.0)), (1, _event(2, AR48, 0, 2, 0.0))])}
    events = {r: {int(p): event_from_json(r, e) for p, e in s.items()} for r, s in sent.items()}
    f = cross_node_divergence(ask, events, lambda r: "node-a" if r < 2 else "node-b")
    assert f.kind == "collective_mismatch" and f.ranks == [0, 2]
    assert f.message == ("collective #2 on group [0,1,2,3] differs in shapes across nodes: rank 0 (node-a) issued "
                         "all_reduce [64] float32 SUM at train.py:16; rank 2 (node-b) issued all_reduce [48] float32 "
                         "SUM at train.py:16")
    assert (f.detail["file"], f.detail["line"], f.detail["position"]) == ("/job/train.py", 16, 2)
    assert f.detail["issued"]["2"]["host"] == "node-b"


def test_no_divergence_where_the_signatures_agree_as_far_as_each_rank_went():
    ask = WindowAsk("0,1,2,3", 0, WINDOW, [0, 2])
    events = {0: {0: _event(0, AR64, 0, 1, 0.0), 1: _event(0, AR64, 0, 2, 0.0)}, 2: {0: _event(2, AR64, 0, 1, 0.0)}}
    assert cross_node_divergence(ask, events, str) is None


def test_digests_travel_as_json():
    d = digests([AR64] * 3, 0)["0,1,2,3"]
    assert RankDigests.from_json(d.to_json()) == d and d.hash_at(2) and d.hash_at(3) is None
