"""The Perfetto trace's wait slices (supervise/chrome_trace.py on analysis/arrivals.py): inside each collective's
slice, the ranks that arrived before the last one show "waiting for rank <R>" up to its start."""
from __future__ import annotations

import json

from distcheck.analysis.trace_events import parse_lines
from distcheck.contract.files import FORMAT, FORMAT_KEY
from distcheck.supervise.chrome_trace import chrome_events


def trace(rank: int, starts: list[float], ends: list[float | None] | None = None, host: str = "h",
          ops: list[str] | None = None, issued: bool = False):
    """A rank's trace of all_reduces on group [0,1] as the tracer writes it: an end of None never completed;
    ``issued``: the ends are issue times (functional collectives), not completions."""
    lines = [json.dumps({"ev": "meta", FORMAT_KEY: FORMAT, "rank": rank, "host": host})]
    for i, t in enumerate(starts, start=1):
        op = ops[i - 1] if ops else "all_reduce"
        lines.append(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0,1", "op": op, "shapes": [[4]],
                                 "dtypes": ["float32"], "peer": 1 - rank if op in ("send", "recv") else None,
                                 "site": "train.py:30", "file": "/w/train.py", "line": 30, "t": t}))
        end = t + 0.5 if ends is None else ends[i - 1]
        if end is not None:
            lines.append(json.dumps({"ev": "end", "id": i, "t": end, **({"issued": True} if issued else {})}))
    return parse_lines(lines, rank)


def slices(events, rank, cat):
    return [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == cat]


def nested(child, parents):
    """The slice of ``parents`` that holds ``child`` on its row (same start, ends no later)."""
    (parent,) = [p for p in parents if p["tid"] == child["tid"] and p["ts"] == child["ts"]]
    assert child["dur"] <= parent["dur"]
    return parent


def test_the_early_rank_waits_inside_each_collective_and_the_late_rank_has_no_wait():
    steps = [1000.0, 1001.0, 1002.0]
    late = [t + 0.1 for t in steps]
    leave = [t + 0.15 for t in steps]  # both leave together, 0.05 s after rank 1 arrived
    events = chrome_events({0: trace(0, steps, leave), 1: trace(1, late, leave)})
    waits = slices(events, 0, "wait")
    assert [w["name"] for w in waits] == ["waiting for rank 1"] * 3
    assert [round(w["ts"]) for w in waits] == [0, 1_000_000, 2_000_000]
    assert all(abs(w["dur"] - 100_000) < 1 and w["args"]["late_rank"] == 1 for w in waits)
    assert all(abs(w["args"]["waited_s"] - 0.1) < 1e-6 and "clipped" not in w["args"] for w in waits)
    parents = slices(events, 0, "collective")
    assert [nested(w, parents)["args"]["seq"] for w in waits] == [1, 2, 3]
    assert not any(p["args"].get("arrived_last") for p in parents)
    assert slices(events, 1, "wait") == []
    assert [p["args"].get("arrived_last") for p in slices(events, 1, "collective")] == [True] * 3
    # a parent comes before its child in the file: chrome://tracing nests same-start slices in file order
    assert events.index(waits[0]) == events.index(nested(waits[0], parents)) + 1


def test_a_balanced_job_draws_waits_only_where_the_starts_differ():
    starts = [1000.0, 1001.0, 1002.0, 1003.0]
    other = [1000.0, 1001.02, 1002.0, 1002.97]  # rank 1 late at #2, early at #4, together at #1 and #3
    events = chrome_events({0: trace(0, starts), 1: trace(1, other)})
    (w0,) = slices(events, 0, "wait")
    (w1,) = slices(events, 1, "wait")
    assert w0["args"]["late_rank"] == 1 and nested(w0, slices(events, 0, "collective"))["args"]["seq"] == 2
    assert w1["args"]["late_rank"] == 0 and nested(w1, slices(events, 1, "collective"))["args"]["seq"] == 4
    assert abs(w0["dur"] - 20_000) < 1 and abs(w1["dur"] - 30_000) < 1
    # a tie: nobody waited, so no slice; the higher rank counts as the last one, as in the stragglers report
    assert [p["args"].get("arrived_last") for p in slices(events, 1, "collective")] == [True, True, True, None]


def test_a_never_completed_collective_is_still_drawn_and_holds_its_wait():
    """Rank 1 reaches #2 2 s late and both hang there; rank 0 alone goes on to #3, which never completes."""
    t0 = trace(0, [1000.0, 1001.0, 1002.0], [1000.5, None, None], ops=["all_reduce", "all_reduce", "broadcast"])
    t1 = trace(1, [1000.0, 1003.0], [1000.5, None])
    events = chrome_events({0: t0, 1: t1}, end_time=1010.0)
    parents = slices(events, 0, "collective")
    assert [p["name"] for p in parents] == ["all_reduce", "all_reduce (never completed)",
                                            "broadcast (never completed)"]
    (w,) = slices(events, 0, "wait")
    parent = nested(w, parents)
    assert parent["args"]["seq"] == 2 and abs(parent["dur"] - 9_000_000) < 1 and abs(w["dur"] - 2_000_000) < 1
    assert slices(events, 1, "wait") == []
    assert [p["name"] for p in slices(events, 1, "collective")] == ["all_reduce", "all_reduce (never completed)"]


def test_a_wait_longer_than_its_slice_is_clipped_and_other_hosts_and_p2p_draw_none():
    """Rank 0's all_reduce completed 0.2 s after its start, by its clock before rank 1 came (0.7 s later)."""
    events = chrome_events({0: trace(0, [1000.0], [1000.2]), 1: trace(1, [1000.7])})
    (w,) = slices(events, 0, "wait")
    (parent,) = slices(events, 0, "collective")
    assert w["ts"] == parent["ts"] and w["dur"] == parent["dur"] and abs(w["dur"] - 200_000) < 1
    assert w["args"] == {"late_rank": 1, "waited_s": 0.7, "clipped": True}
    # several hosts: the clocks may disagree, nothing is compared
    apart = chrome_events({0: trace(0, [1000.0], host="a"), 1: trace(1, [1000.7], host="b")})
    assert [e for e in apart if e.get("cat") == "wait"] == []
    assert not any(e.get("args", {}).get("arrived_last") for e in apart)
    # a send and its recv are not a position every member of a group reaches
    p2p = chrome_events({0: trace(0, [1000.0], ops=["send"]), 1: trace(1, [1000.7], ops=["recv"])})
    assert [e for e in p2p if e.get("cat") == "wait"] == []


def test_an_end_that_is_only_the_issue_is_drawn_up_to_the_late_start_but_not_into_the_next_slice():
    """Functional collectives (and DDP's buckets on gloo, whose ring has no completion times) record their issue as
    their end: a zero-length slice has no room for a wait. It completed no earlier than the late rank's start."""
    issue = [1000.0, 1001.0, 1001.05]
    events = chrome_events({0: trace(0, issue, issue, issued=True),
                            1: trace(1, [1000.1, 1001.2, 1001.2], [1000.1, 1001.2, 1001.2], issued=True)})
    parents = slices(events, 0, "collective")
    waits = slices(events, 0, "wait")
    assert [nested(w, parents)["args"]["seq"] for w in waits] == [1, 2, 3]
    # #1: up to rank 1's start; #2: cut at rank 0's #3 (a row's slices must nest); #3: up to rank 1's start
    assert [p["dur"] for p in parents] == [100_000, 50_000, 150_000]
    assert [w["dur"] for w in waits] == [100_000, 50_000, 150_000]
    assert [w["args"].get("clipped") for w in waits] == [None, True, None]
    assert all("earliest it could complete" in p["args"]["end"] for p in parents)
    assert [p["dur"] for p in slices(events, 1, "collective")] == [0, 0, 0]  # the last to arrive waited for nobody
    assert slices(events, 1, "wait") == []
