"""Ranks that issued different numbers of collectives on a group (analysis/trace_align.py): a finished rank with
fewer collectives than its peers is one ``collective_mismatch`` naming both counts, the first collective it never
issued, who issued it, the user's line and the fix; the peer's lost connection is its consequence."""
from __future__ import annotations

from distcheck.analysis.rank_outcomes import STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, STATE_STOPPED, RankOutcome
from distcheck.analysis.trace_align import analyze_run, find_divergences
from distcheck.analysis.trace_events import RankError, RankTrace, TraceEvent

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
               "[127.0.0.1]:24571")
DDP_VIA = "DDP gradient bucket all-reduce"


def event(rank: int, eid: int, seq: int, *, op: str = "all_reduce", shape=(2058,), line: int = 27,
          done: bool = True, origin: str | None = None, t: float | None = None) -> TraceEvent:
    """One collective on the default group of 2 ranks; ``origin``: merged from the Flight Recorder (untraced)."""
    extra = {"origin": origin, "via": DDP_VIA, "untraced": True} if origin else {}
    start = 100.0 + eid if t is None else t
    return TraceEvent(rank=rank, id=eid, seq=seq, pg=(0, 1), op=op, shapes=[list(shape)], dtypes=["float32"],
                      reduce_op="SUM", peer=None, site=f"train.py:{line}", file="/w/train.py", line=line,
                      t_start=start, t_end=start + 0.1 if done else None, pg_name="0", extra=extra)


def ddp_steps(rank: int, steps: int, *, last_done: bool = True) -> list[TraceEvent]:
    """A traced barrier (collective #1 of the group), then one DDP bucket all-reduce per step, numbered by torch
    (collective_seq_id: #2, #3, ...) as the Flight Recorder does."""
    events = [event(rank, 1, 1, op="barrier", shape=(), line=9)]
    for step in range(steps):
        done = last_done or step < steps - 1
        events.append(event(rank, 2 + step, 2 + step, origin="ddp", done=done))
    return events


def finished(rank: int, events: list[TraceEvent]) -> RankTrace:
    return RankTrace(rank, events, [], {}, {"ev": "exit", "ok": True}, flight_dumped=True)


def failed_with_lost_peer(rank: int, events: list[TraceEvent]) -> tuple[RankTrace, RankOutcome]:
    err = RankError(rank, "RuntimeError", GLOO_CLOSED, "Traceback ...", "train.py:27", "/w/train.py", 27, 200.0)
    trace = RankTrace(rank, events, [err], {}, {"ev": "exit", "ok": False, "code": 1}, flight_dumped=True)
    return trace, RankOutcome(rank, STATE_ERROR, 1, error=err)


def test_uneven_ddp_steps_are_a_count_mismatch_naming_the_first_bucket_all_reduce_the_short_rank_never_issued():
    # Rank 0 got 4 batches, rank 1 only 3: rank 1 finished, rank 0's 4th backward lost its peer.
    t0, o0 = failed_with_lost_peer(0, ddp_steps(0, 4, last_done=False))
    traces = {0: t0, 1: finished(1, ddp_steps(1, 3))}
    findings = analyze_run(traces, {0: o0, 1: RankOutcome(1, STATE_OK, 0)}, 2)
    assert [f.kind for f in findings] == ["collective_mismatch"]  # the lost connection is no second finding
    (f,) = findings
    # One rank each way and torch's own collectives: both ranks are in it (a user's extra call names its caller)
    assert f.ranks == [0, 1] and f.detail["divergence"] == "extra" and f.detail["fewer_ranks"] == [1]
    assert f.detail["counts"] == {0: 5, 1: 4}
    assert f.message.startswith(
        "rank 1 issued 4 collectives on group [0,1], rank 0 issued 5; the first collective rank 1 never issued: "
        "all_reduce #5 [2058] float32 SUM (8.0 KiB), DDP gradient bucket all-reduce at train.py:27; "
        "rank 1 issued no collective there (finished its script); then rank 0 failed: gloo lost its connection")
    assert f.message.endswith("Fix: uneven batches per rank: DDP's join(), drop_last=True in the "
                              "DistributedSampler/DataLoader, or equal shards, so that every rank runs the same "
                              "number of steps")
    missing = f.detail["first_missing"]
    assert (missing["op"], missing["shapes"], missing["dtypes"], missing["bytes"]) == \
        ("all_reduce", [[2058]], ["float32"], 8232)
    assert (missing["origin"], missing["via"], missing["position"]) == ("ddp", DDP_VIA, 5)
    assert (f.detail["file"], f.detail["line"], f.detail["origin"]) == ("/w/train.py", 27, "ddp")
    assert "drop_last=True" in f.detail["fixes"] and "Connection closed" in f.detail["backend_errors"][0]


def test_a_group_reports_its_earliest_count_mismatch_once():
    """Rank 0's extra DDP all-reduce comes first; its extra traced all_reduce after it is the same story."""
    events = ddp_steps(0, 4) + [event(0, 6, 2, line=40, t=110.0)]
    traces = {0: finished(0, events), 1: finished(1, ddp_steps(1, 3))}
    (f,) = analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in (0, 1)}, 2)
    assert f.kind == "collective_mismatch" and f.detail["counts"] == {0: 6, 1: 4}
    assert f.detail["first_missing"]["origin"] == "ddp" and f.detail["line"] == 27


def test_an_extra_call_of_the_users_own_is_a_count_mismatch_with_both_fixes():
    traces = {r: finished(r, [event(r, i, i, shape=(1,), line=17) for i in (1, 2)]) for r in (0, 1)}
    traces[0].events.append(event(0, 3, 3, shape=(1,), line=19))
    (f,) = analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in (0, 1)}, 2)
    assert f.kind == "collective_mismatch" and f.ranks == [0] and f.detail["counts"] == {0: 3, 1: 2}
    assert f.message.startswith(
        "rank 1 issued 2 collectives on group [0,1], rank 0 issued 3; the first collective rank 1 never issued: "
        "all_reduce #3 [1] float32 SUM (4 B), your own call at train.py:19; rank 1 issued no collective there "
        "(finished its script). Fix: call all_reduce on every rank of the group or on none")
    assert "uneven batches per rank" in f.message and "DDP's join()" in f.message
    assert f.detail["origin"] == "user" and f.detail["first_missing"]["via"] is None and f.detail["line"] == 19


def test_equal_counts_are_silent():
    traces = {r: finished(r, ddp_steps(r, 3)) for r in (0, 1)}
    assert analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in (0, 1)}, 2) == []


def test_a_rank_that_did_not_finish_is_not_short_by_itself():
    """Died or still running: it stopped early for its own reason, which its own finding says."""
    traces = {0: RankTrace(0, ddp_steps(0, 4, last_done=False), [], {}, None, flight_dumped=True), 1: RankTrace(1, ddp_steps(1, 3), [],
                                                                                          {}, None)}
    died = analyze_run(traces, {0: RankOutcome(0, STATE_STOPPED), 1: RankOutcome(1, STATE_DIED, -9, "SIGKILL")}, 2)
    assert [f.kind for f in died] == ["rank_failure"] and died[0].ranks == [1]
    hung = analyze_run(traces, {r: RankOutcome(r, STATE_HUNG) for r in (0, 1)}, 2, timeout=5)
    assert [f.kind for f in hung] == ["hang"]


def test_a_rank_without_a_ring_dump_is_not_counted_as_having_issued_nothing():
    """A rank killed or stuck holding the GIL never dumped its ring: its untraced collectives are unknown, not
    absent (it must not be blamed for 0 DDP all-reduces)."""
    traces = {0: finished(0, ddp_steps(0, 3)), 1: RankTrace(1, [e for e in ddp_steps(1, 3) if not e.extra.get("untraced")],
                                                          [], {}, {"ev": "exit", "ok": True}, flight_dumped=False)}
    outcomes = {r: RankOutcome(r, STATE_OK, 0) for r in traces}
    assert find_divergences(traces, outcomes) == []


def test_a_rank_whose_ring_was_never_dumped_is_not_said_to_have_issued_no_collective():
    """DDP ranks that end with os._exit: nothing traced, and the ring that holds their bucket all-reduces was never
    dumped. What they issued is unknown, not none; with a dump, none is none."""
    def unfinished(rank: int, dumped: bool) -> RankTrace:
        return RankTrace(rank, [], [], {}, None, flight_dumped=dumped)

    outcomes = {r: RankOutcome(r, STATE_DIED, 0) for r in (0, 1)}
    findings = analyze_run({0: unfinished(0, False), 1: unfinished(1, False)}, outcomes, 2)
    assert [f.kind for f in findings] == ["rank_failure", "rank_failure"]
    assert findings[0].ranks == [0] and findings[0].message == (
        "rank 0 ended without finishing its script: os._exit or a signal (exit code 0); rank 1 issued no traced "
        "collective (what torch issued for it, DDP's or compiled code's, is unknown: its Flight Recorder ring was "
        "never dumped)")
    dumped = analyze_run({0: unfinished(0, True), 1: unfinished(1, True)}, outcomes, 2)
    assert dumped[0].message.endswith("; rank 1 issued no collective")
