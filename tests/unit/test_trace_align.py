"""Unit tests of the pure trace analysis (no process group): parsing, alignment rules, failures, hangs."""
from __future__ import annotations

import json

from distcheck.analysis.call_signature import signature
from distcheck.analysis.rank_outcomes import STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, RankOutcome
from distcheck.analysis.stop_rule import provably_stuck
from distcheck.analysis.trace_align import analyze_run, find_divergences
from distcheck.analysis.progress import rank_progress
from distcheck.analysis.trace_events import load_rank_trace, parse_lines
from distcheck.supervise.chrome_trace import chrome_events


class TraceBuilder:
    """Writes trace lines the way distcheck.rank.tracer does, for one rank."""

    def __init__(self, rank: int, world: int = 2):
        self.rank, self.lines, self.n, self.seq, self.t = rank, [], 0, {}, 100.0
        self.world = world

    def coll(self, op, shapes=((4,),), dtypes=None, pg=None, line=10, reduce_op=None, root=None, end=True,
             error=None, **extra):
        self.n += 1
        pg = pg or tuple(range(self.world))
        key = ",".join(map(str, pg))
        self.seq[key] = self.seq.get(key, 0) + 1
        self.t += 1
        rec = {"ev": "start", "id": self.n, "seq": self.seq[key], "pg": key, "pg_name": None, "op": op,
               "shapes": [list(s) for s in shapes], "dtypes": list(dtypes or ["float32"] * len(shapes)),
               "reduce_op": reduce_op, "peer": None, "root": root, "site": f"train.py:{line}",
               "file": "/w/train.py", "line": line, "t": self.t, **extra}
        self.lines.append(json.dumps(rec))
        if end or error:
            end_rec = {"ev": "end", "id": self.n, "t": self.t + 0.5}
            if error:
                end_rec["error"] = error
            self.lines.append(json.dumps(end_rec))
        return self

    def exit(self, ok=True):
        self.lines.append(json.dumps({"ev": "exit", "ok": ok}))
        return self

    def error(self, message="boom", line=50, exc_type="ValueError"):
        self.t += 1
        self.lines.append(json.dumps({"ev": "error", "exc_type": exc_type, "message": message, "traceback": "tb",
                                      "site": f"train.py:{line}", "file": "/w/train.py", "line": line,
                                      "t": self.t}))
        return self

    def trace(self):
        return parse_lines(self.lines, self.rank)


def ok(*ranks):
    return {r: RankOutcome(r, STATE_OK, 0) for r in ranks}


def test_load_rank_trace_tolerates_truncated_last_line(tmp_path):
    b = TraceBuilder(0).coll("all_reduce", line=11).coll("broadcast", line=12, end=False)
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text("\n".join(b.lines) + '\n{"ev":"end","id":2,"t":1')  # killed mid-write
    events = load_rank_trace(path)
    assert [e.op for e in events] == ["all_reduce", "broadcast"]
    assert events[0].rank == 0 and events[0].pg == (0, 1) and events[0].line == 11
    progress = rank_progress(0, events)
    assert progress.last_started.op == "broadcast" and not progress.last_started.completed
    assert progress.last_completed.op == "all_reduce" and progress.pending.op == "broadcast"


def test_identical_traces_have_no_divergence():
    traces = {r: TraceBuilder(r).coll("all_reduce").coll("broadcast", root=0).exit().trace() for r in (0, 1)}
    assert analyze_run(traces, ok(0, 1), 2) == []


def test_op_mismatch_names_position_ops_and_lines():
    t0 = TraceBuilder(0).coll("all_reduce", line=20).coll("all_reduce", line=21, end=False)
    t1 = TraceBuilder(1).coll("all_reduce", line=20).coll("broadcast", line=23, root=0, end=False)
    traces = {0: t0.trace(), 1: t1.trace()}
    findings = analyze_run(traces, {0: RankOutcome(0, "stopped"), 1: RankOutcome(1, "stopped")}, 2)
    assert len(findings) == 1
    f = findings[0]
    assert f.kind == "collective_mismatch" and f.ranks == [0, 1]
    assert "#2" in f.message and "train.py:21" in f.message and "train.py:23" in f.message
    assert f.detail["position"] == 2 and "op" in f.detail["fields"] and f.detail["line"] == 21
    assert provably_stuck(traces, set()) is not None


def test_majority_names_the_odd_rank_out():
    traces = {r: TraceBuilder(r, 4).coll("all_reduce", shapes=((8,),) if r != 3 else ((7,),), line=30 + r)
              .exit().trace() for r in range(4)}
    (d,) = find_divergences(traces, ok(0, 1, 2, 3))
    assert d.ranks == [3] and d.fields == ["shapes"]


def test_extra_collective_on_one_rank_with_backend_error_kept():
    t0 = TraceBuilder(0).coll("all_reduce").coll("all_reduce", line=19, error="RuntimeError: Connection closed")
    t0.error("Connection closed by peer", line=19, exc_type="RuntimeError").exit(False)
    t1 = TraceBuilder(1).coll("all_reduce").exit()
    outcomes = {0: RankOutcome(0, STATE_ERROR, 1, error=t0.trace().errors[0]), 1: RankOutcome(1, STATE_OK, 0)}
    findings = analyze_run({0: t0.trace(), 1: t1.trace()}, outcomes, 2)
    assert [f.kind for f in findings] == ["collective_mismatch"]  # the backend error is not a second finding
    f = findings[0]
    assert f.ranks == [0] and f.detail["divergence"] == "extra" and "train.py:19" in f.message
    assert "Connection closed" in f.detail["backend_errors"][0]


def test_missing_collective_names_the_rank_that_skipped_it():
    traces = {r: TraceBuilder(r, 3).coll("all_reduce").coll("barrier", shapes=(), line=40).exit().trace()
              for r in (0, 1)}
    traces[2] = TraceBuilder(2, 3).coll("all_reduce").exit().trace()
    (f,) = analyze_run(traces, ok(0, 1, 2), 3)
    assert f.detail["divergence"] == "missing" and f.ranks == [2] and "train.py:40" in f.message


def test_shorter_trace_of_a_crashed_rank_is_a_failure_not_a_mismatch():
    t0 = TraceBuilder(0).coll("all_reduce").coll("all_reduce", line=19, error="RuntimeError: Connection reset")
    t0.error("Connection reset by peer", line=19, exc_type="RuntimeError").exit(False)
    t1 = TraceBuilder(1).coll("all_reduce").error("bad sample", line=18).exit(False)
    tr = {0: t0.trace(), 1: t1.trace()}
    outcomes = {r: RankOutcome(r, STATE_ERROR, 1, error=tr[r].errors[0]) for r in (0, 1)}
    findings = analyze_run(tr, outcomes, 2)
    assert [(f.kind, f.ranks) for f in findings] == [("rank_failure", [1])]
    f = findings[0]
    assert f.detail["line"] == 18 and "bad sample" in f.message and "rank 0 failed in all_reduce #2" in f.message
    assert "Connection reset" in f.detail["consequences"][0]
    assert set(f.detail["positions"]) == {0, 1}


def test_signal_death_without_trace_error():
    tr = {0: TraceBuilder(0).coll("all_reduce", end=False).trace(), 1: TraceBuilder(1).coll("all_reduce").trace()}
    outcomes = {0: RankOutcome(0, "stopped"), 1: RankOutcome(1, STATE_DIED, -9, "SIGKILL")}
    (f,) = analyze_run(tr, outcomes, 2)
    assert f.kind == "rank_failure" and f.ranks == [1] and "SIGKILL" in f.message


def test_hang_reports_every_rank_position():
    tr = {0: TraceBuilder(0).coll("all_reduce").coll("all_reduce", line=20, end=False).trace(),
          1: TraceBuilder(1).coll("all_reduce").trace()}
    outcomes = {r: RankOutcome(r, STATE_HUNG) for r in (0, 1)}
    assert provably_stuck(tr, set()) is None  # rank 1 is alive and may still come
    (f,) = analyze_run(tr, outcomes, 2, timeout=4)
    assert f.kind == "hang" and f.ranks == [0, 1] and f.detail["line"] == 20
    assert "rank 0 waits in all_reduce #2" in f.message and "rank 1 is outside collectives" in f.message


def test_provably_stuck_when_a_finished_peer_never_issued_it():
    tr = {0: TraceBuilder(0).coll("all_reduce").coll("all_reduce", end=False).trace(),
          1: TraceBuilder(1).coll("all_reduce").exit().trace()}
    assert "rank 1 finished without issuing" in provably_stuck(tr, {1})


def test_signature_rules_for_legal_uneven_ops():
    def ev(rank, op, shapes, **extra):
        return TraceBuilder(rank).coll(op, shapes=shapes, **extra).trace().events[0]

    # all_gather: same output list, inputs of each rank's own size (legal on NCCL).
    assert signature(ev(0, "all_gather", ((1,), (2,), (1,)))) == signature(ev(1, "all_gather", ((1,), (2,), (2,))))
    assert signature(ev(0, "all_gather", ((1,), (2,), (1,)))) != signature(ev(1, "all_gather", ((2,), (2,), (2,))))
    # all_to_all_single with split sizes moves different amounts per rank.
    assert (signature(ev(0, "all_to_all_single", ((3, 5), (2, 5)), uneven=True))
            == signature(ev(1, "all_to_all_single", ((4, 5), (6, 5)), uneven=True)))
    assert signature(ev(0, "all_to_all_single", ((3, 5),))) != signature(ev(1, "all_to_all_single", ((4, 5),)))
    # c10d and functional spellings of one backend op agree; object collectives ignore payload sizes.
    assert signature(ev(0, "all_gather_into_tensor", ((8,), (4,)))) == signature(ev(1, "all_gather_tensor", ((8,), (4,))))
    assert signature(ev(0, "all_gather_object", ())) == signature(ev(1, "all_gather_object", ()))
    # gather/scatter: only the root passes the list.
    assert signature(ev(0, "gather", ((4,), (4,), (4,)), root=0)) == signature(ev(1, "gather", ((4,),), root=0))


def test_subgroups_align_independently():
    low = (0, 1)
    high = (2, 3)
    tr = {}
    for r in range(4):
        b = TraceBuilder(r, 4)
        grp = low if r < 2 else high
        b.coll("all_reduce", pg=grp)
        b.coll("all_reduce" if r != 3 else "all_gather_into_tensor", pg=grp, line=25 + (r == 3))
        tr[r] = b.exit().trace()
    (f,) = analyze_run(tr, ok(0, 1, 2, 3), 4)
    assert f.ranks == [2, 3] and f.detail["group"] == [2, 3] and f.detail["position"] == 2


def test_p2p_shape_mismatch_and_unmatched_send():
    def p2p(rank, op, peer, shape, line):
        rec = {"ev": "start", "id": 1, "seq": 1, "pg": "0,1", "op": op, "shapes": [list(shape)],
               "dtypes": ["float32"], "peer": peer, "site": f"p.py:{line}", "file": "/p.py", "line": line, "t": 1}
        return parse_lines([json.dumps(rec), '{"ev":"end","id":1,"t":2}', '{"ev":"exit","ok":true}'], rank)

    (f,) = analyze_run({0: p2p(0, "send", 1, (4,), 7), 1: p2p(1, "recv", 0, (5,), 9)}, ok(0, 1), 2)
    assert f.kind == "collective_mismatch" and f.ranks == [0, 1] and "p.py:7" in f.message and "p.py:9" in f.message
    (g,) = analyze_run({0: p2p(0, "send", 1, (4,), 7), 1: parse_lines(['{"ev":"exit","ok":true}'], 1)}, ok(0, 1), 2)
    assert g.ranks == [0] and "unmatched send" in g.message


def test_chrome_trace_has_one_row_per_rank_and_open_slices():
    tr = {0: TraceBuilder(0).coll("all_reduce").coll("broadcast", end=False).trace(),
          1: TraceBuilder(1).coll("all_reduce").trace()}
    events = chrome_events(tr, end_time=110.0)
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert any(e["name"] == "broadcast (never completed)" and e["dur"] > 0 for e in slices)
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"} == {"rank 0", "rank 1"}


# --- the per-peer sizes of an exchange (analysis/split_matrix.py) ---------------------------------------------------


def a2a(b, send, recv, line=25, row=4):
    """An all_to_all_single as the tracer writes it: per-peer blocks as shapes, recorded with the start."""
    shapes = ((sum(recv), row), (sum(send), row))
    return b.coll("all_to_all_single", shapes=shapes, uneven=True, line=line,
                  split={"send": [[n, row] for n in send], "recv": [[n, row] for n in recv], "unit": "rows"})


def test_all_to_all_splits_that_pair_up_are_silent_and_a_pair_that_does_not_is_named():
    good = {0: a2a(TraceBuilder(0), [3, 5], [3, 4]).exit().trace(),
            1: a2a(TraceBuilder(1), [4, 4], [5, 4]).exit().trace()}
    assert analyze_run(good, ok(0, 1), 2) == []
    # Rank 1 sized its receive by its own routing: it expects 4 rows from rank 0, which sends 5. gloo aborts rank 1.
    bad = {0: a2a(TraceBuilder(0), [3, 5], [3, 4]).exit(ok=False).trace(),
           1: a2a(TraceBuilder(1), [4, 4], [4, 4], line=31, ).trace()}
    outcomes = {0: RankOutcome(0, STATE_ERROR, 1), 1: RankOutcome(1, STATE_DIED, -6, signal="SIGABRT")}
    (f,) = analyze_run(bad, outcomes, 2)
    assert f.kind == "collective_mismatch" and f.ranks == [0, 1] and f.detail["line"] == 25
    assert f.detail["pairs"] == [{"src": 0, "dst": 1, "sent": [5, 4], "expected": [4, 4]}]
    assert f.message.startswith("collective #1 on group [0,1] (all_to_all_single): the per-peer sizes do not pair "
                                "up: rank 0 sends 5 rows to rank 1 (train.py:25), rank 1 expects 4 rows from rank 0 "
                                "(train.py:31). Rows (tokens) each rank sends to ranks 0, 1 in order "
                                "(input_split_sizes): rank 0 [3, 5]; rank 1 [4, 4]; rows each expects from them "
                                "(output_split_sizes): rank 0 [3, 4]; rank 1 [4, 4]")
    assert "exchange the counts first" in f.message
    assert set(f.detail["backend_errors"]) == {0, 1}  # the SIGABRT is evidence of the mismatch, not a finding


def test_one_rank_wrong_with_every_peer_is_the_one_blamed():
    # 4 ranks, each sends 1 row to every peer; rank 2 expects 2 rows from each: every mismatched pair has rank 2.
    traces = {r: a2a(TraceBuilder(r, 4), [1] * 4, [2] * 4 if r == 2 else [1] * 4).exit().trace() for r in range(4)}
    (f,) = analyze_run(traces, ok(0, 1, 2, 3), 4)
    assert f.ranks == [2] and len(f.detail["pairs"]) == 4 and "+0 more" not in f.message


def test_list_forms_pair_by_shape():
    from distcheck.analysis.split_matrix import mismatched_pairs

    def gather(b, mine, expected):  # all_gather(tensor_list, tensor): what it sends everyone, what it expects
        return b.coll("all_gather", shapes=[*expected, mine], split={"send": [mine] * 2, "recv": expected})

    t0 = gather(TraceBuilder(0), [3], [[3], [2]]).trace()
    t1 = gather(TraceBuilder(1), [4], [[3], [4]]).trace()  # rank 0 expects [2] from rank 1, which sends [4]
    pairs = mismatched_pairs({0: t0.events[0], 1: t1.events[0]}, [0, 1])
    assert [p.to_json() for p in pairs] == [{"src": 1, "dst": 0, "sent": [4], "expected": [2]}]
