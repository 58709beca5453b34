"""The one model of a rank's progress (analysis/progress.py), and every consumer naming the same collective from it:
the hang diagnosis, stacks.txt/stacks.json, the trace alignment and the torch-error translation."""
from __future__ import annotations

import json

from distcheck.analysis.hang import compose_hang_finding, diagnose
from distcheck.analysis.progress import (COMPLETED, FAILED, ISSUED, PENDING, RankProgress, progress_by_rank,
                                         rank_progress)
from distcheck.analysis.torch_errors import translate
from distcheck.analysis.rank_outcomes import (STATE_ERROR, STATE_HUNG, STATE_OK, RankOutcome, describe_position,
                                              position_of)
from distcheck.analysis.trace_align import analyze_run
from distcheck.analysis.trace_events import RankTrace, TraceEvent, parse_lines
from distcheck.contract import files
from distcheck.supervise.stacks import progress_line, render_stacks_text, stacks_document

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
               "[127.0.0.1]:24571")


class Trace:
    """JSON trace lines of one rank, as the tracer writes them (start lines, end lines that may carry an error
    or say the call was only issued)."""

    def __init__(self, rank: int, world: int = 2) -> None:
        self.rank, self.world = rank, world
        self.lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": rank})]
        self.n, self.seq = 0, {}

    def start(self, op: str, line: int, pg: tuple[int, ...] | None = None, t: float | None = None,
              **extra) -> int:
        self.n += 1
        pg = pg or tuple(range(self.world))
        key = ",".join(map(str, pg))
        self.seq[key] = self.seq.get(key, 0) + 1
        self.lines.append(json.dumps({"ev": "start", "id": self.n, "seq": self.seq[key], "pg": key, "op": op,
                                      "shapes": [[4]], "dtypes": ["float32"], "site": f"t.py:{line}",
                                      "file": "/w/t.py", "line": line, "t": 100.0 + self.n if t is None else t,
                                      **extra}))
        return self.n

    def end(self, eid: int, error: str | None = None, issued: bool = False) -> Trace:
        rec = {"ev": "end", "id": eid, "t": 100.5 + eid}
        if error:
            rec["error"] = error
        if issued:
            rec["issued"] = True
        self.lines.append(json.dumps(rec))
        return self

    def coll(self, op: str, line: int, **kw) -> Trace:
        return self.end(self.start(op, line, **kw))

    def exit(self, ok: bool = True) -> Trace:
        self.lines.append(json.dumps({"ev": "exit", "ok": ok}))
        return self

    def trace(self) -> RankTrace:
        return parse_lines(self.lines, self.rank)


def async_pending_behind_completed() -> dict[int, RankTrace]:
    """Rank 0 issued all_reduce #2 async (t.py:11), then a broadcast (t.py:12) that completed; #2 never did.
    Rank 1 completed all_reduce #1 and went elsewhere."""
    t0 = Trace(0).coll("all_reduce", 10)
    pending = t0.start("all_reduce", 11)
    t0.coll("broadcast", 12)
    assert pending == 2
    return {0: t0.trace(), 1: Trace(1).coll("all_reduce", 10).trace()}


def test_the_collective_a_rank_waits_on_is_the_first_not_completed_not_the_last():
    p = rank_progress(0, async_pending_behind_completed()[0].events)
    assert (p.started, p.completed, p.failed, len(p.open)) == (3, 2, 0, 1)
    assert (p.last_started.op, p.last_started.seq, p.last_started.state) == ("broadcast", 3, COMPLETED)
    assert (p.last_completed.op, p.last_completed.seq) == ("broadcast", 3)
    assert (p.pending.op, p.pending.seq, p.pending.line, p.pending.state) == ("all_reduce", 2, 11, PENDING)
    assert p.pending is p.first_open and p.pending != p.last_completed
    group = p.groups["0,1"]
    assert (group.issued, group.completed, group.first_open.seq, group.last.op) == (3, 2, 2, "broadcast")


def test_issue_order_is_the_record_id_not_the_clock():
    """Clocks of threads and the backend disagree; the id counter is taken when the call is made."""
    t = Trace(0)
    t.coll("all_reduce", 10, t=200.0)  # id 1, a later timestamp than the next call's
    t.start("barrier", 11, t=150.0)  # id 2: issued last, never ended
    events = list(reversed(t.trace().events))  # whatever the list order
    p = rank_progress(0, events)
    assert p.last_started.op == "barrier" and p.last_completed.op == "all_reduce" and p.pending.op == "barrier"


def test_every_consumer_names_the_same_collective_for_an_async_op_pending_behind_a_completed_one():
    traces = async_pending_behind_completed()
    progress = progress_by_rank(traces)
    # The hang diagnosis (rank 0 has no stack: it is placed by its trace alone).
    diag = diagnose([], progress, world_size=2, errors_by_rank={0: "permission denied", 1: "permission denied"})
    assert diag.message.startswith("rank 0 waits in all_reduce #2 (t.py:11)")
    finding = compose_hang_finding([], progress, world_size=2, timeout=5)
    assert finding.detail["last_collectives"]["0"]["first_open"]["seq"] == 2
    assert finding.detail["last_collectives"]["0"]["last_completed"]["op"] == "broadcast"
    # stacks.txt and stacks.json.
    line = progress_line(0, progress[0])
    assert line == ("rank 0: last started broadcast #3 (t.py:12); last completed broadcast #3 (t.py:12); "
                    "waits in all_reduce #2 (t.py:11) PENDING")
    assert line in render_stacks_text([], [], "", progress)
    doc = stacks_document([], [], False, progress)
    assert doc["last_collectives"]["0"]["first_open"]["line"] == 11
    again = RankProgress.from_json(0, doc["last_collectives"]["0"])
    assert again.pending.seq == 2 and progress_line(0, again) == line
    # The trace alignment: the trace-only hang finding, and the positions in its detail.
    outcomes = {r: RankOutcome(r, STATE_HUNG) for r in (0, 1)}
    (hang,) = analyze_run(traces, outcomes, 2, timeout=5)
    assert "rank 0 waits in all_reduce #2 on group [0,1] at t.py:11" in hang.message
    assert hang.detail["line"] == 11 and hang.detail["positions"][0]["waiting_in"]["seq"] == 2
    assert hang.detail["positions"][0]["last_completed"]["op"] == "broadcast"
    assert hang.detail["last_collectives"]["0"]["first_open"]["seq"] == 2


def test_a_rank_whose_last_collective_failed():
    t0 = Trace(0).coll("all_reduce", 10)
    t0.end(t0.start("all_reduce", 19), error="RuntimeError: " + GLOO_CLOSED)
    trace = t0.trace()
    p = rank_progress(0, trace.events)
    assert (p.started, p.completed, p.failed) == (2, 1, 1) and p.pending is None
    assert p.last_started.state == FAILED and p.last_failed == p.last_started and p.last_failed.line == 19
    assert p.last_completed.seq == 1  # a failed collective did not complete
    # stacks.txt, the trace alignment and the translation of the rank's error name the same call.
    assert progress_line(0, p) == ("rank 0: last started all_reduce #2 (t.py:19) FAILED; last completed "
                                   "all_reduce #1 (t.py:10)")
    assert describe_position(0, p, RankOutcome(0, STATE_HUNG)).startswith(
        "rank 0 failed in all_reduce #2 on group [0,1] at t.py:19 (gloo lost its connection")
    out = translate("RuntimeError", GLOO_CLOSED, {"events": trace.events})
    assert (out["detail"]["seq"], out["detail"]["line"]) == (2, 19)
    assert out == translate("RuntimeError", GLOO_CLOSED, {"events": [], "progress": p})


def test_an_issued_only_functional_collective_is_said_to_be_only_known_issued():
    t = Trace(0).coll("all_reduce", 10)
    t.end(t.start("all_gather_into_tensor", 14, api="functional"), issued=True)
    p = rank_progress(0, t.trace().events)
    assert p.pending is None and (p.started, p.completed, p.issued_only) == (2, 2, 1)
    assert p.last_started.state == ISSUED and p.last_completed == p.last_started
    assert progress_line(0, p).endswith("last completed all_gather_into_tensor #2 (t.py:14) (functional: only "
                                        "known issued, its completion is not traced)")
    said = describe_position(0, p, RankOutcome(0, STATE_HUNG))
    assert said == ("rank 0 is outside traced collectives, last issued all_gather_into_tensor #2 on group [0,1] at "
                    "t.py:14 (functional: only known issued, its completion is not traced)")
    assert position_of(0, p, None)["last_completed"]["state"] == ISSUED


def test_per_group_counts_leave_point_to_point_ops_out():
    t = Trace(0, world=4)
    t.coll("all_reduce", 10, pg=(0, 1))
    t.coll("all_reduce", 11, pg=(0, 1))
    t.coll("all_gather", 12, pg=(0, 2))
    t.coll("send", 13, pg=(0, 1), peer=1)
    p = rank_progress(0, t.trace().events)
    assert p.started == 4 and {k: g.issued for k, g in p.groups.items()} == {"0,1": 2, "0,2": 1}
    assert p.issued_on("0,1") == 2 and p.issued_on("2,3") == 0


def test_untraced_collectives_count_on_their_process_group():
    """Collectives merged from the Flight Recorder align in a sequence of their own, but a rank's count on a group
    is everything it issued there."""
    t = Trace(0).coll("all_reduce", 10)
    events = t.trace().events
    events.append(TraceEvent(rank=0, id=2, seq=2, pg=(0, 1), op="all_reduce", shapes=[[8]], dtypes=["float32"],
                             reduce_op=None, peer=None, site="t.py:20", file="/w/t.py", line=20, t_start=103.0,
                             t_end=None, pg_name=None, extra={"origin": "ddp", "untraced": True}))
    p = rank_progress(0, events)
    assert p.groups["0,1"].issued == 2 and p.groups["0,1"].untraced == 1
    assert p.pending.op == "all_reduce" and p.pending.line == 20


def test_finished_ranks_agree_everywhere_with_no_collective_pending():
    traces = {r: Trace(r).coll("all_reduce", 10).coll("barrier", 11).exit().trace() for r in (0, 1)}
    progress = progress_by_rank(traces)
    assert all(p.pending is None and p.completed == 2 for p in progress.values())
    assert analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in (0, 1)}, 2, progress=progress) == []
    assert describe_position(1, progress[1], RankOutcome(1, STATE_ERROR)) == \
        "rank 1 is outside collectives, last completed barrier #2 at t.py:11"


def test_progress_round_trips_through_json_with_its_group_counts():
    p = progress_by_rank(async_pending_behind_completed())[0]
    again = RankProgress.from_json(0, json.loads(json.dumps(p.to_json())))
    assert (again.started, again.completed, again.pending, again.last_started, again.last_completed) == \
        (p.started, p.completed, p.pending, p.last_started, p.last_completed)
    assert again.issued_on("0,1") == 3 and again.groups["0,1"].completed == 2
    assert p.to_json()["groups"]["0,1"]["first_open_seq"] == 2
