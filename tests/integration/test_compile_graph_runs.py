"""Compiled collectives of a rank gloo aborted inside the graph (rank/flight_recorder.GraphLines,
analysis/flight_recorder.graph_run_events) when the collective's size is a formula of the graph's size symbols
(``2*s0``), and on a rank with a DDP model, whose bucket all-reduces only the ring names (run lines with the group's
counter). The correct twins (fixtures/ok/compile_dynamic_sizes.py, ok/ddp_compiled_metric.py) are silent in
test_correct_corpus.py."""
from __future__ import annotations

from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.analysis.trace_events import load_traces


def test_a_formula_sized_collective_that_aborts_a_rank_names_both_sizes_and_the_compiled_line(line_of, tmp_path):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "20", "--report-dir", str(out), "--",
                     str(FIXTURES / "compile_abort_formula_size.py")], timeout=150)
    report = load_report(out)
    assert res.returncode == 1, res.output
    (f,) = [x for x in report["findings"] if x["kind"] == "collective_mismatch"]
    line = line_of("compile_abort_formula_size.py", "funcol.all_reduce(both")
    assert f["ranks"] == [0, 1] and f["detail"]["fields"] == ["shapes"] and f["detail"]["line"] == line
    # the first run agreed ([16] on both): the second is the mismatch, with the sizes 2*s0 took on each rank
    assert "collective #2 on group [0,1] differs in shapes" in f["message"], f["message"]
    assert f"rank 0 issued all_reduce [16] float32 at compile_abort_formula_size.py:{line}" in f["message"]
    assert f"rank 1 issued all_reduce [24] float32 at compile_abort_formula_size.py:{line}" in f["message"]
    assert [x["kind"] for x in report["findings"]] == ["collective_mismatch"]  # the abort is its evidence
    # gloo aborts one of the two (either): its compiled collectives come from its graph run lines
    aborted = [r for r in (0, 1) if not (out / f"flight-rank{r}.json").exists()]
    assert len(aborted) == 1, aborted
    traces = load_traces(out)
    compiled = [e for e in traces[aborted[0]].events if e.extra.get("origin") == "compiled"]
    assert [(e.extra.get("from"), e.shapes) for e in compiled] == [
        ("graph_run", [[16]]), ("graph_run", [[16] if aborted[0] == 0 else [24]])]


def test_a_ddp_ranks_compiled_collective_that_aborts_a_rank_meets_the_peers_ring_entry_of_its_number(line_of, tmp_path):
    """DDP's bucket all-reduces, which only the ring names, came first on the group: the aborted rank's run lines
    hold the group's counter, so its compiled all-reduce is compared with the peer's of the same number."""
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "20", "--report-dir", str(out), "--",
                     str(FIXTURES / "compile_abort_ddp.py")], timeout=150)
    report = load_report(out)
    assert res.returncode == 1, res.output
    assert [x["kind"] for x in report["findings"]] == ["collective_mismatch"], res.output  # none on DDP's buckets
    (f,) = report["findings"]
    line = line_of("compile_abort_ddp.py", "funcol.all_reduce(scaled")
    assert f["ranks"] == [0, 1] and f["detail"]["fields"] == ["shapes"] and f["detail"]["line"] == line
    # DDP's construction (4 collectives) and two steps' buckets and buffer broadcasts (3 each), then the two runs
    assert "collective #9 on group [0,1] differs in shapes" in f["message"], f["message"]
    assert f"rank 0 issued all_reduce [4, 4] float32 at compile_abort_ddp.py:{line}" in f["message"]
    assert f"rank 1 issued all_reduce [12] float32 at compile_abort_ddp.py:{line}" in f["message"]
    aborted = [r for r in (0, 1) if not (out / f"flight-rank{r}.json").exists()]
    assert len(aborted) == 1, aborted
    traces = load_traces(out)
    compiled = [e for e in traces[aborted[0]].events if e.extra.get("origin") == "compiled"]
    assert [(e.extra.get("from"), e.extra.get("seq_exact"), e.seq) for e in compiled] == [
        ("graph_run", True, 8), ("graph_run", True, 9)]
    assert not traces[aborted[0]].flight_dumped  # what DDP issued on it stays unknown, never "none"
