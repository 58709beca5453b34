"""Who held the others up (analysis/stragglers.py), on traces written the way the tracer writes them."""
from __future__ import annotations

import json
import random

from distcheck.analysis.stragglers import analyze
from distcheck.analysis.trace_events import parse_lines
from distcheck.contract.files import FORMAT, FORMAT_KEY


def trace(rank: int, starts: list[float], host: str = "h", line: int = 30, ends: list[float] | None = None):
    lines = [json.dumps({"ev": "meta", FORMAT_KEY: FORMAT, "rank": rank, "host": host})]
    for i, t in enumerate(starts, start=1):
        lines.append(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0,1", "op": "all_reduce", "shapes": [[4]],
                                 "dtypes": ["float32"], "site": f"train.py:{line}", "file": "/w/train.py",
                                 "line": line, "t": t}))
        lines.append(json.dumps({"ev": "end", "id": i, "t": t + 0.05 if ends is None else ends[i - 1]}))
    return parse_lines(lines, rank)


def test_ranks_on_another_node_are_compared_by_their_time_inside_each_collective():
    """Node 0 has rank 0's trace; node 1 sent rank 1's durations. Rank 1's host clock is 1000 s ahead: starts
    cannot be compared, the time each spent inside can (the members of an all-reduce leave it together)."""
    from distcheck.analysis.stragglers import durations

    steps = [1000.0 + i for i in range(12)]
    leave = [t + 0.3 for t in steps]  # rank 1 arrives 0.25 s after rank 0; both leave 0.05 s after that
    rank0 = trace(0, steps, host="a", ends=leave)
    rank1 = trace(1, [t + 0.25 + 1000 for t in steps], host="b", ends=[t + 1000 for t in leave])
    sent = durations({1: rank1})
    assert sent["0,1#1"] == {"1": 0.05} and len(sent) == 12
    s = analyze({0: rank0}, remote=sent)
    assert s.named == [1] and s.ranks[1].last == 12 and abs(s.ranks[1].held - 12 * 0.25) < 1e-6
    (note,) = s.notes()
    assert note.message.startswith("rank 1 arrived last at 12 of 12 collectives; the others waited 3.00 s")
    assert ("between its previous collective (its trace and samples are on its node) and all_reduce at "
            "train.py:30") in note.message
    # without the other node's durations, nothing is compared; a bounded summary keeps the last positions
    assert analyze({0: rank0}).named == [] and list(durations({1: rank1}, limit=3)) == ["0,1#10", "0,1#11", "0,1#12"]


def test_the_rank_that_arrives_last_at_almost_every_collective_is_named_with_the_waits():
    steps = [1000.0 + i for i in range(16)]
    late = [t + 0.25 for t in steps]
    late[3] = steps[3] - 0.01  # once, rank 0 is the late one
    s = analyze({0: trace(0, steps), 1: trace(1, late)})
    assert s.named == [1] and s.ranks[1].last == 15 and s.ranks[1].positions == 16
    assert abs(s.ranks[1].held - 15 * 0.25) < 1e-6 and abs(s.ranks[0].waited - 15 * 0.25) < 1e-6
    (note,) = s.notes()
    assert note.kind == "straggler" and note.ranks == [1]
    assert note.message.startswith("rank 1 arrived last at 15 of 16 collectives; the others waited 3.75 s for it")
    assert "between all_reduce at train.py:30 and all_reduce at train.py:30" in note.message
    assert sum(sum(w["last"].values()) for w in s.windows) == 16 and len(s.windows) == 8
    assert "rank 1: last at 15 of 16" in s.section()


def test_a_balanced_job_names_nobody():
    rng = random.Random(0)
    base = [1000.0 + i for i in range(40)]
    s = analyze({r: trace(r, [t + rng.uniform(0, 0.002) for t in base]) for r in (0, 1)})
    assert s.named == [] and s.notes() == [] and s.section().startswith("none:")


def test_ranks_on_other_hosts_are_not_compared_and_summarized_traces_are_skipped():
    steps = [1000.0 + i for i in range(8)]
    s = analyze({0: trace(0, steps, host="a"), 1: trace(1, [t + 1 for t in steps], host="b")})
    assert s.named == [] and s.skipped
    t = trace(0, steps)
    t.summary = object()
    assert analyze({0: t}).skipped == "a big job's traces are summarized"


def test_samples_inside_the_gaps_say_where_the_late_rank_was():
    from distcheck.contract.samples_file import Place

    steps = [1000.0 + i for i in range(8)]
    load = Place("/w/train.py", 22, "load_batch", "its own code")
    fwd = Place("/w/train.py", 34, "main", "forward")
    # Rank 1 samples itself: mostly in load_batch inside each gap before its late start, once in forward.
    samples = sorted([(t + 0.1, load) for t in steps] + [(t + 0.2, load) for t in steps] + [(steps[2] + 0.22, fwd)])
    traces = {0: trace(0, steps), 1: trace(1, [t + 0.25 for t in steps])}
    for t in traces.values():  # as DDP's bucket all-reduces come from the process group's record: trace id 0
        for e in t.events:
            e.id = 0
    s = analyze(traces, {1: samples})
    (note,) = s.notes()
    assert "mostly in its own code (94%): its main thread was in load_batch (train.py:22, its own code) 94%, "\
           "main (train.py:34, forward) 6% " \
           "of 17 samples" in note.message
    assert note.detail["where"]["samples"][0] == {"file": "/w/train.py", "line": 22, "func": "load_batch",
                                                  "kind": "its own code", "samples": 16, "beyond": 16.0}


def test_what_every_rank_does_each_step_is_not_why_the_late_one_is_late():
    """A GPU job: each rank spends most of each step in forward and backward, and rank 1 also 0.1 s in load_batch.
    Its samples in its gaps are mostly forward/backward, as are rank 0's in its own: what it did beyond them is
    load_batch (measured on an H200, the whole gap said "mostly computing, load_batch 23%")."""
    from distcheck.contract.samples_file import Place

    steps = [1000.0 + i for i in range(10)]
    load = Place("/w/train.py", 22, "load_batch", "its own code")
    fwd = Place("/w/train.py", 34, "main", "forward")
    bwd = Place("/w/train.py", 35, "main", "backward")
    late = [t + 0.5 + 0.2 for t in steps]  # both compute from the previous collective's end for 0.5 s; 1 also loads
    mine = [(t + 0.05 + 0.04 * k, fwd if k < 6 else bwd) for t in steps for k in range(12)]  # rank 0: 12 a step
    theirs = [(t + 0.05 + 0.04 * k, load) for t in steps for k in range(5)]
    theirs += [(t + 0.25 + 0.04 * k, fwd if k < 6 else bwd) for t in steps for k in range(12)]
    traces = {0: trace(0, [t + 0.5 for t in steps]), 1: trace(1, late)}
    s = analyze(traces, {0: sorted(mine), 1: sorted(theirs)})
    (note,) = s.notes()
    assert note.ranks == [1]
    assert ("in those gaps it was mostly in its own code (100%): its main thread was in load_batch (train.py:22, "
            "its own code) 100% of 45 samples beyond what the others did in theirs") in note.message, note.message
    top = note.detail["where"]["samples"][0]
    assert (top["func"], top["samples"], top["beyond"]) == ("load_batch", 45, 45.0)
    assert s.ranks[1].spent[fwd] > s.ranks[1].spent[load]  # what the whole gap alone would have named


def test_a_collective_whose_ring_gives_no_end_ends_no_earlier_than_its_last_member_began_it():
    """gloo's ring says a DDP bucket all-reduce completed but not when: its end is its creation. Rank 0 then sat
    inside it (its main thread in loss.backward(), waiting for the bucket) until rank 1 arrived; those samples are
    its wait, not what it did each step, and must not cancel rank 1's backward (the compute-straggler fixture lost
    its backward line on a loaded machine this way)."""
    from distcheck.contract.samples_file import Place

    steps = [1000.0 + i for i in range(24)]
    fwd = Place("/w/train.py", 25, "forward", "forward")
    bwd = Place("/w/train.py", 41, "main", "backward")
    late = [t + 0.6 for t in steps]  # rank 1: forward 0.3 s then backward 0.3 s after the previous collective
    traces = {0: trace(0, steps, ends=steps), 1: trace(1, late, ends=late)}
    rank0 = [(t + 0.6 * k / 6, bwd) for t in steps for k in range(1, 6)]  # waiting inside its backward
    rank1 = [(t + 0.6 + 0.1 * k, fwd if k <= 3 else bwd) for t in steps for k in range(1, 6)]
    s = analyze(traces, {0: sorted(rank0), 1: sorted(rank1)})
    (note,) = s.notes()
    assert note.ranks == [1] and "main (train.py:41, backward) 40%" in note.message, note.message
    assert "forward (train.py:25, forward) 60%" in note.message


def test_the_sampler_names_what_the_stack_is_doing():
    import sys

    import torch

    from distcheck.rank.sampler import _kind

    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen["forward"] = _kind(sys._getframe())
            return x

    Probe()(torch.zeros(1))
    assert seen["forward"] == "forward" and _kind(sys._getframe()) == "its own code"


def test_the_sampler_tells_host_syncs_apart_from_the_users_own_code():
    """A line that calls .item()/.tolist()/synchronize, and a tensor being printed (torch/_tensor_str.py), are host
    syncs; the loop around them is the user's own code."""
    import io
    import sys
    import threading

    import torch

    from distcheck.rank import sampler

    main = threading.main_thread().ident
    seen: dict[str, int] = {}
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            kind = sampler._kind(sys._current_frames()[main])
            seen[kind] = seen.get(kind, 0) + 1
            stop.wait(0.002)

    def user_code() -> None:  # the sampler takes frames of files outside torch and distcheck as the user's
        total = 0.0
        for x in torch.randn(20000):
            total += x.item()
        with torch._tensor_str.printoptions(threshold=100_000):
            print(torch.randn(40, 100), file=io.StringIO())

    user_code.__code__ = user_code.__code__.replace(co_filename="/w/train.py")
    thread = threading.Thread(target=probe)
    thread.start()
    try:
        for _ in range(3):
            user_code()
    finally:
        stop.set()
        thread.join()
    assert seen.get("host sync", 0) >= 3, seen
    assert sampler._on_a_sync_line(sys._getframe()) is False  # this line calls no sync


def test_collectives_reached_together_leave_the_share_of_last_arrivals_to_the_real_straggler():
    """The intermittent data-loading straggler run: rank 1 late by 0.1 s at 15 of 21 collectives, rank 0 "last" by
    under a millisecond at the other 6 (the job's start, a loaded machine): 15 of 21 is under LAST_SHARE, but those
    6 are ties, and rank 1 was last at every collective where anyone waited. Ties alone name nobody."""
    from distcheck.analysis.stragglers import LAST_SHARE, TIE_WAIT

    starts = [1000.0 + 0.2 * i for i in range(21)]
    rank1 = [t + (0.0007 if i < 6 else 0.1) for i, t in enumerate(starts)]
    rank0 = [t + (0.0014 if i < 6 else 0.0) for i, t in enumerate(starts)]  # later than rank 1 at the first 6
    s = analyze({0: trace(0, rank0), 1: trace(1, rank1)})
    assert 15 / 21 < LAST_SHARE and s.ranks[1].last == 15 and s.ranks[0].last == 6 and s.ranks[0].held < TIE_WAIT * 6
    assert s.named == [1], s.section()
    assert s.notes()[0].message.startswith("rank 1 arrived last at 15 of 21 collectives")
    tied = analyze({r: trace(r, [t + 0.001 * ((i + r) % 2) for i, t in enumerate(starts)]) for r in (0, 1)})
    assert tied.named == []
