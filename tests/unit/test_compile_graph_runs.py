"""Compiled collectives whose size is a formula of a dynamic graph's size symbols (``2*s0``): the rank writes the
formula (rank/flight_recorder._shape), the analysis evaluates it with each run's symbol values
(analysis/flight_recorder.size_value), so a rank gloo aborted inside such a graph still has its sizes. The real
abort is tests/integration/test_compile_graph_runs.py's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distcheck.analysis import flight_recorder as fr
from distcheck.analysis.trace_events import TraceEvent
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
