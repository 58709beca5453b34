"""Compiled collectives whose size is a formula of a dynamic graph's size symbols (``2*s0``): the rank writes the
formula (rank/flight_recorder._shape), the analysis evaluates it with each run's symbol values
(analysis/flight_recorder.size_value), so a rank gloo aborted inside such a graph still has its sizes. The real
abort is tests/integration/test_compile_graph_runs.py's.

On a rank with a DDP model, whose bucket all-reduces only the ring names, each run line also holds the group's count
of collectives so far (rank/flight_recorder.group_counters): the run's collectives get the ring's numbers, and the
comparison (analysis/trace_align.find_divergences) meets an aborted rank's with the peer's ring entry of that number."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distcheck.analysis import flight_recorder as fr
from distcheck.analysis.rank_trace import GraphRun
from distcheck.analysis.rank_outcomes import STATE_DIED, STATE_ERROR, RankOutcome
from distcheck.analysis.trace_align import analyze_run, find_divergences
from distcheck.analysis.trace_events import RankTrace, TraceEvent
from distcheck.contract import files, trace_lines
from distcheck.rank import tracer as trace


def test_size_formulas_as_sympy_prints_them_are_evaluated_and_nothing_else_is():
    sizes = {"s0": 12, "s1": 5}
    assert [fr.size_value(f, sizes) for f in ("2*s0", "s0 + s1 - 1", "(s0//2)", "Max(1, s0 - 20)", "s1**2",
                                               "Mod(s0, s1)", "-s1 + 2*s0", "s0*s1")] == [24, 16, 6, 1, 25, 2, 19, 60]
    with pytest.raises(KeyError):
        fr.size_value("2*s9", sizes)
    for hostile in ("__import__('os')", "s0.real", "[s0]", "s0 if s1 else 0", "2**s0**s0", "s0 / 2"):
        with pytest.raises(ValueError):
            fr.size_value(hostile, sizes)
    assert fr._run_shape(["2*s0", 4, "s1"], sizes) == [24, 4, 5] and fr._run_shape(["2*s9"], sizes) is None


def test_a_rank_without_a_ring_gets_its_compiled_sizes_from_the_formula_and_the_runs_values():
    graph = {"graph": 1, "fn": "step", "file": "/p/train.py", "line": 20, "groups": {"0": [0, 1]}, "ddp": False,
             "collectives": [{"op": "all_reduce", "file": "/p/train.py", "line": 22, "group": "0",
                              "input_shape": ["2*s87"], "dtype": "torch.float32"}]}
    events, complete = fr.graph_run_events([], {1: graph}, [(1, 10.0, {"s87": 8}), (1, 11.0, {"s87": 12})], None,
                                           TraceEvent, 1)
    assert [(e.shapes, e.line, e.seq) for e in events] == [([[16]], 22, 1), ([[24]], 22, 2)] and complete


def test_a_compiled_collective_of_a_formulas_size_writes_the_formula_and_each_runs_symbol(fake_world, tmp_path):
    trace.install(tmp_path, 0)
    try:
        @torch.compile(fullgraph=True, backend="eager", dynamic=True)
        def step(x: torch.Tensor) -> torch.Tensor:
            both = torch.cat([x, x * 2])
            dist.all_reduce(both)
            return both

        for n in (6, 9):
            step(torch.ones(n))
    finally:
        trace.uninstall()
        torch._dynamo.reset()
    recs = list(trace_lines.read_records(files.rank_file(tmp_path, "trace", 0).read_text().splitlines()))
    (graph,) = [r for r in recs if r["ev"] == trace_lines.GRAPH]
    runs = [r for r in recs if r["ev"] == trace_lines.GRAPH_RUN]
    (coll,) = graph["collectives"]
    (formula,) = coll["input_shape"]
    (symbol,) = runs[0]["sizes"]
    assert formula == f"2*{symbol}" and [r["sizes"] for r in runs] == [{symbol: 6}, {symbol: 9}]
    assert [fr._run_shape(coll["input_shape"], r["sizes"]) for r in runs] == [[12], [18]]


# -- a rank with a DDP model: its graph runs carry each group's counter -----------------------------------------
DDP_GRAPH = {"graph": 1, "fn": "metric", "file": "/p/train.py", "line": 30, "groups": {"0": [0, 1]}, "ddp": True,
             "collectives": [{"op": "all_reduce", "file": "/p/train.py", "line": 33, "group": "0",
                              "input_shape": [4, 4], "dtype": "torch.float32"}]}


def ring_event(rank, seq, op, shape, origin, t, line):
    """An untraced event as analysis/flight_recorder.merge makes it of a dumped ring's entry."""
    return TraceEvent(rank=rank, id=seq, seq=seq, pg=(0, 1), op=op, shapes=[shape], dtypes=["float32"],
                      reduce_op=None, peer=None, site=f"train.py:{line}", file="/p/train.py", line=line, t_start=t,
                      t_end=t, pg_name="0", extra={"origin": origin, "untraced": True, "sequence": ("untraced", "0")})


def ddp_then_compiled(rank, compiled_shapes):
    """A dumped rank's ring: DDP's construction broadcast and two steps' bucket all-reduces, then a compiled
    all-reduce per shape."""
    events = [ring_event(rank, 1, "broadcast", [161], "ddp", 1.0, 25),
              ring_event(rank, 2, "all_reduce", [161], "ddp", 2.0, 29),
              ring_event(rank, 3, "all_reduce", [161], "ddp", 3.0, 29)]
    events += [ring_event(rank, 4 + i, "all_reduce", s, "compiled", 10.0 + i, 33)
               for i, s in enumerate(compiled_shapes)]
    return RankTrace(rank, events, [], {}, None, flight_dumped=True)


def aborted(rank, second, counters=True):
    """A rank gloo aborted inside its second graph run (its all-reduce's input ``second``): no dump, its compiled
    collectives from its run lines, each with the group's counter when ``counters`` (DDP's three came first)."""
    graphs = {1: DDP_GRAPH, 2: {**DDP_GRAPH, "collectives": [{**DDP_GRAPH["collectives"][0], "input_shape": second}]}}
    runs = [GraphRun(1, 10.0, {}, {"0": 3} if counters else {}), GraphRun(2, 11.0, {}, {"0": 4} if counters else {})]
    events, complete = fr.graph_run_events([], graphs, runs, None, TraceEvent, rank)
    assert not complete  # DDP's buckets are in no run line: the rank's untraced sequence is not whole
    return RankTrace(rank, events, [], {}, None, flight_dumped=False)


def test_a_ddp_ranks_graph_runs_are_numbered_by_the_groups_counter_as_its_ring_would():
    runs = [GraphRun(1, 10.0, {}, {"0": 3}), GraphRun(1, 11.0, {}, {"0": 7})]
    events, _ = fr.graph_run_events([], {1: DDP_GRAPH}, runs, None, TraceEvent, 1)
    assert [(e.seq, e.extra.get("seq_exact")) for e in events] == [(4, True), (8, True)]
    # gloo's counter also counts point-to-point ops, its ring's numbers do not: after one, the number is unknown
    send = TraceEvent(rank=1, id=1, seq=1, pg=(0, 1), op="send", shapes=[[2]], dtypes=["float32"], reduce_op=None,
                      peer=0, site=None, file=None, line=None, t_start=10.5, t_end=10.6, pg_name="0")
    events, _ = fr.graph_run_events([send], {1: DDP_GRAPH},
                                    [GraphRun(1, 10.0, {}, {"0": 3}), GraphRun(1, 11.0, {}, {"0": 8})], None,
                                    TraceEvent, 1)
    assert [(e.seq, e.extra.get("seq_exact")) for e in events] == [(4, True), (2, None)]


def test_an_aborted_ddp_ranks_compiled_collective_meets_the_peers_ring_entry_of_its_number():
    traces = {0: ddp_then_compiled(0, [[4, 4], [4, 4]]), 1: aborted(1, [12])}
    outcomes = {0: RankOutcome(0, STATE_ERROR), 1: RankOutcome(1, STATE_DIED, signal="SIGABRT")}
    (d,) = find_divergences(traces, outcomes)
    assert (d.kind, d.ranks, d.fields, d.group) == ("different", [0, 1], ["shapes"], (0, 1))
    assert {r: (e.seq, e.shapes, e.line) for r, e in d.events.items()} == {0: (5, [[4, 4]], 33), 1: (5, [[12]], 33)}
    (f,) = [x for x in analyze_run(traces, outcomes, 2) if x.kind == "collective_mismatch"]
    assert f.ranks == [0, 1] and f.detail["line"] == 33
    assert f.message.startswith("collective #5 on group [0,1] differs in shapes: rank 0 issued all_reduce [4, 4]")
    # the same sizes: DDP's buckets, which only rank 0's ring holds, are no finding either
    assert find_divergences({0: traces[0], 1: aborted(1, [4, 4])}, outcomes) == []
    # the other way round (rank 0 aborted, rank 1 dumped)
    (d,) = find_divergences({0: aborted(0, [12]), 1: ddp_then_compiled(1, [[4, 4], [4, 4]])}, outcomes)
    assert d.ranks == [0, 1] and d.events[0].shapes == [[12]] and d.events[1].shapes == [[4, 4]]


def test_without_counters_or_any_dump_the_numbers_decide_what_is_compared():
    outcomes = {0: RankOutcome(0, STATE_ERROR), 1: RankOutcome(1, STATE_DIED, signal="SIGABRT")}
    # run lines without counters (a trace of before): an aborted DDP rank's compiled collectives are not compared
    assert find_divergences({0: ddp_then_compiled(0, [[4, 4], [4, 4]]), 1: aborted(1, [12], False)},
                            outcomes) == []
    # both aborted: their run lines alone, compared by number
    (d,) = find_divergences({0: aborted(0, [4, 4]), 1: aborted(1, [12])}, outcomes)
    assert d.ranks == [0, 1] and {r: e.seq for r, e in d.events.items()} == {0: 5, 1: 5}
    # a number the peer's ring does not hold has nothing to be compared with
    assert find_divergences({0: ddp_then_compiled(0, [[4, 4]]), 1: aborted(1, [12])}, outcomes) == []


def test_a_ddp_ranks_graph_run_lines_hold_the_groups_counter_the_ring_numbers_by(tmp_path, monkeypatch):
    """A real gloo group (one rank): the counter each run line holds, plus one, is the ring's collective_seq_id of
    the run's all-reduce, with DDP's construction and eager collectives in between."""
    import json

    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trace.install(tmp_path, 0)
    try:
        DDP(torch.nn.Linear(2, 2))

        @torch.compile(fullgraph=True, backend="aot_eager")
        def metric(x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)

        metric(torch.ones(3))
        dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1))
        metric(torch.ones(3))
        ring = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))["entries"]
    finally:
        trace.uninstall()
        torch._dynamo.reset()
        dist.destroy_process_group()
    recs = list(trace_lines.read_records(files.rank_file(tmp_path, "trace", 0).read_text().splitlines()))
    runs = [r for r in recs if r["ev"] == trace_lines.GRAPH_RUN]
    (graph,) = [r for r in recs if r["ev"] == trace_lines.GRAPH]
    group = graph["collectives"][0]["group"]
    compiled = [e["collective_seq_id"] for e in ring if e["profiling_name"] == "gloo:all_reduce"
                and e["input_sizes"] == [[3]]]
    assert len(runs) == 2 and [r["seq"][group] + 1 for r in runs] == compiled, (runs, compiled)
    assert compiled[1] - compiled[0] == 3
