"""What Python never calls, seen and named: collectives inside torch.compile graphs and DDP's C++ Reducer (via
torch's Flight Recorder), compiled code that runs under every distcheck form exactly as under torchrun, DDP's
numerics unchanged, and the uneven-data and backward hangs named by DDP's all-reduce and the user's line."""
from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from launch_helpers import FIXTURES, distcheck, load_report, plain_ranks, run_pytest, torchrun

from distcheck.analysis.trace_events import load_traces


def run_fixture(tmp_path: Path, fixture: str, *args: str, nproc: str = "2", timeout: float = 60,
                limit: float = 240, command: str = "run"):
    out = tmp_path / "report"
    flag = ["--nproc", nproc]
    res = distcheck([command, *flag, "--timeout", str(timeout), "--report-dir", str(out), "--",
                     str(FIXTURES / fixture), *args], timeout=limit)
    return res, load_report(out), out


def compiled_events(out: Path, rank: int = 0) -> list:
    return [e for e in load_traces(out)[rank].events if e.extra.get("origin") == "compiled"]


def _have_cc() -> bool:
    return bool(shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
                or shutil.which("gcc"))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _have_cc(), reason="inductor's CPU code needs a C compiler"))])
def test_a_compiled_step_runs_and_its_collectives_are_in_the_trace(tmp_path, line_of, backend):
    res, report, out = run_fixture(tmp_path, "compile_step_ok.py", "--backend", backend)
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    funcol_line = line_of("compile_step_ok.py", "funcol.all_reduce(grad")
    c10d_line = line_of("compile_step_ok.py", "dist.all_reduce(scale)")
    events = compiled_events(out)
    # 3 steps, each the two collectives in the order the compiled function issues them, at their own lines
    assert [e.line for e in events] == [funcol_line, c10d_line] * 3, [(e.op, e.site) for e in events]
    assert {e.extra["via"].split(" (")[0] for e in events} == {"all_reduce inside compiled step"}


def test_compiled_code_runs_under_torchrun(tmp_path):
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "run", "--timeout", "60", "--report-dir", str(out), "--",
                    str(FIXTURES / "compile_step_ok.py"), "--backend", "aot_eager"], timeout=240)
    assert res.returncode == 0, res.output
    assert load_report(out)["ok"] and len(compiled_events(out)) == 6


def test_compiled_code_runs_under_compare(tmp_path):
    res, report, _ = run_fixture(tmp_path, "compile_step_ok.py", command="compare")
    assert res.returncode == 0 and report["ok"], res.output


def test_compiled_code_runs_under_consistency(tmp_path):
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "consistency", "--model", f"{FIXTURES / 'model_compiled.py'}:build",
                    "--timeout", "60", "--report-dir", str(out)], timeout=240)
    assert res.returncode == 0, res.output
    report = load_report(out)
    assert report["ok"] and report["findings"] == [] and {c["name"] for c in report["checks"]} >= {
        "model_consistency", "parallel_vs_reference"}


COMPILED_MARKER_TEST = '''
import torch, torch.distributed as dist, pytest
import torch.distributed._functional_collectives as funcol

@pytest.mark.distributed(nprocs=2, timeout=120)
def test_compiled_collective(dist_ctx):
    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD) + 1
    assert step(torch.ones(3)).tolist() == [3.0] * 3
'''


def test_compiled_code_runs_under_the_pytest_marker(pytester):
    pytester.makepyfile(test_compiled=COMPILED_MARKER_TEST)
    result = run_pytest(pytester, "-q", "-p", "no:cacheprovider")
    assert result.ret == 0, "\n".join(result.outlines + result.errlines)
    result.stdout.fnmatch_lines(["*1 passed*"])


def test_a_compiled_fsdp2_model_trains_and_its_collectives_are_in_the_trace(tmp_path):
    # Compiled DDP's bucket all-reduces: the corpus's ddp_compile.py (tests/integration/test_correct_corpus.py).
    res, report, out = run_fixture(tmp_path, "compile_models_ok.py", "--parallel", "fsdp2", "--backend", "aot_eager")
    assert res.returncode == 0 and report["ok"], res.output
    assert {e.op for e in load_traces(out)[0].events} >= {"all_gather_single", "reduce_scatter_single"}


def test_a_shape_mismatch_inside_a_compiled_step_names_the_compiled_line(tmp_path, line_of):
    res, report, _ = run_fixture(tmp_path, "compile_shape_mismatch.py", timeout=20)
    assert res.returncode == 1, res.output
    (f,) = [x for x in report["findings"] if x["kind"] == "collective_mismatch"]
    line = line_of("compile_shape_mismatch.py", "funcol.all_reduce(scaled")
    assert f["ranks"] == [0, 1] and "shapes" in f["detail"]["fields"]
    assert f"compile_shape_mismatch.py:{line}" in f["message"]
    assert "[4, 4]" in f["message"] and "[16]" in f["message"]
    assert [x["kind"] for x in report["findings"]] == ["collective_mismatch"]


PLAIN_LOOP = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
pair = dist.new_group([0, 1])
x = torch.ones(64)
for step in range(200):
    dist.all_reduce(x)
    if step % 10 == 0:
        dist.broadcast(x, 0, group=pair)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_ring_of_traced_calls_only_is_dumped_as_counters(tmp_path):
    """Every rank dumps torch's ring at exit; a plain loop of Python collectives has nothing in it the trace lacks,
    so the dump holds the real ring's per-group counters and ``all_traced`` instead of 221 entries (and a big job's
    load stays summarized: analysis/trace_events.load_traces)."""
    script = tmp_path / "plain_loop.py"
    script.write_text(PLAIN_LOOP)
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), "--", str(script)],
                    timeout=240)
    assert res.returncode == 0 and load_report(out)["ok"], res.output
    for rank in (0, 1):
        path = out / f"flight-rank{rank}.json"
        doc = json.loads(path.read_text())
        assert doc["all_traced"] is True and doc["entries"] == [] and path.stat().st_size < 1000, doc
        # torch's own counters: 200 all-reduces and the barrier on the world, 20 broadcasts on the pair
        assert sorted(int(s["last_enqueued_collective"]) for s in doc["pg_status"].values()) == [20, 201], doc
    traces = load_traces(out)
    assert all(t.flight_dumped for t in traces.values())
    assert [len(t.events) for t in traces.values()] == [221, 221]
    assert not any(e.extra.get("untraced") for t in traces.values() for e in t.events)


def test_uneven_batches_under_ddp_are_a_count_mismatch_naming_ddps_all_reduce(tmp_path, line_of):
    res, report, out = run_fixture(tmp_path, "ddp_uneven_batches.py", timeout=30)
    assert res.returncode == 1, res.output
    for rank in (0, 1):  # DDP's Reducer issued what the trace lacks: the whole ring is dumped
        doc = json.loads((out / f"flight-rank{rank}.json").read_text())
        assert doc["all_traced"] is False and any(e["profiling_name"] == "gloo:all_reduce" for e in doc["entries"])
    (f,) = [x for x in report["findings"] if x["kind"] == "collective_mismatch"]
    backward = line_of("ddp_uneven_batches.py", "loss.backward()")
    assert f["ranks"] == [0, 1] and f["detail"]["fewer_ranks"] == [1], f  # rank 1 got one batch fewer
    assert f"ddp_uneven_batches.py:{backward}" in f["message"] and "DDP" in f["message"]
    assert "join()" in f["message"] and "drop_last" in f["message"]
    assert not any(x["kind"] == "rank_failure" for x in report["findings"])


def test_every_collective_ddp_issues_is_in_the_trace_at_the_users_line(tmp_path, line_of):
    """DDP's construction broadcast, its buffer broadcast in every forward and each gradient bucket's all-reduce,
    none called from Python: each in the trace with its size, at the DDP(...), model(x) and loss.backward() lines."""
    res, report, out = run_fixture(tmp_path, "ddp_buffers_ok.py", timeout=30)
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    lines = {tag: line_of("ddp_buffers_ok.py", f"# {tag}") for tag in ("CONSTRUCT", "FORWARD", "BACKWARD")}
    params, buffers = 16 * 32 + 32 + 2 * 32 + 32 * 4 + 4, 2 * 32  # BatchNorm's running mean and variance
    for rank, trace in load_traces(out).items():
        seen = [(e.op, e.shapes[0][0] if e.shapes and e.shapes[0] else None, e.line, e.extra.get("via"))
                for e in trace.events if e.extra.get("origin") == "ddp"]
        assert ("broadcast", params + buffers, lines["CONSTRUCT"], "DDP construction broadcast") in seen, seen
        forward = [s for s in seen if s[:3] == ("broadcast", buffers, lines["FORWARD"])]
        assert len(forward) == 3 and forward[0][3].startswith("DDP forward broadcast"), seen
        assert seen.count(("all_reduce", params, lines["BACKWARD"], "DDP gradient bucket all-reduce")) == 3, seen
        assert [e.seq for e in trace.events] == sorted(e.seq for e in trace.events), rank  # in issue order


def test_join_with_uneven_batches_is_silent(tmp_path):
    res, report, out = run_fixture(tmp_path, "ddp_uneven_batches.py", "--join", timeout=30)
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    # rank 1, out of data, shadows rank 0's fourth step: join()'s all-reduces, issued by DDP's C++ Reducer
    shadows = [e for e in load_traces(out)[1].events if "join() shadow" in (e.extra.get("via") or "")]
    assert shadows and {e.extra["origin"] for e in shadows} == {"ddp"}


def test_a_hang_in_ddps_backward_names_the_all_reduce_and_the_backward_line(tmp_path, line_of):
    res, report, _ = run_fixture(tmp_path, "ddp_hang_backward.py", timeout=8, limit=120)
    assert res.returncode == 1, res.output
    (f,) = [x for x in report["findings"] if x["kind"] == "hang"]
    backward = line_of("ddp_hang_backward.py", "loss.backward()  # rank 0 waits")
    stuck = line_of("ddp_hang_backward.py", "time.sleep(600)")
    assert f"ddp_hang_backward.py:{backward}" in f["message"] and "DDP" in f["message"], f["message"]
    assert f"load_batch (ddp_hang_backward.py:{stuck})" in f["message"], f["message"]
    assert f["ranks"] == [1], f  # the rank stuck outside every collective, not the one waiting in DDP's
    assert f["detail"]["line"] == stuck and f["detail"]["file"].endswith("ddp_hang_backward.py")
    assert "distcheck" not in f["message"] and "flight_recorder.py" not in f["message"]


def test_a_user_comm_hook_keeps_working_and_ddp_numerics_stay_bitwise(tmp_path, line_of):
    """The hook's all-reduce is the user's own traced call and DDP's buckets go through it; the parameters are
    bitwise those of plain ranks, without distcheck (DDP without a hook, traced, is the correct corpus's and
    ddp_buffers_ok's)."""
    hook_line = line_of("ddp_comm_hook.py", "the hook's own all-reduce")
    plain, ours = tmp_path / "plain.pt", tmp_path / "ours.pt"
    # The baseline is the parameters it saved: plain ranks now and then abort or stall in torch's gloo teardown
    # after the script ("terminate called without an active exception", docs/hangs-and-faults.md, "Crashes and
    # teardown"), which distcheck's ranks avoid (rank/group_keepalive.py): a stalled one is ended by the timeout,
    # and its saved parameters still count.
    try:
        said = plain_ranks([str(FIXTURES / "ddp_comm_hook.py"), "--hook", "--out", str(plain)], timeout=20).output
    except AssertionError as exc:  # plain_ranks' timeout
        said = str(exc)
    assert plain.exists(), said
    res, report, out = run_fixture(tmp_path / "r", "ddp_comm_hook.py", "--hook", "--out", str(ours))
    assert res.returncode == 0 and report["ok"], res.output
    a, b = torch.load(plain), torch.load(ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise, not allclose
    events = load_traces(out)[0].events
    assert {e.line for e in events if not e.extra.get("untraced") and e.op == "all_reduce"} == {hook_line}


def test_a_size_mismatch_that_aborts_a_rank_inside_a_compiled_step_names_the_compiled_line(tmp_path, line_of):
    """gloo aborts rank 1 inside the graph, so its Flight Recorder ring is never dumped: its graph run lines, written
    before the graph issued anything, stand for it, and the finding is the mismatch, the abort its evidence."""
    res, report, out = run_fixture(tmp_path, "compile_abort_size_mismatch.py", timeout=20)
    assert res.returncode == 1, res.output
    assert not (out / "flight-rank1.json").exists()  # the abort: no ring for rank 1
    (f,) = [x for x in report["findings"] if x["kind"] == "collective_mismatch"]
    line = line_of("compile_abort_size_mismatch.py", "funcol.all_reduce(scaled")
    assert f["ranks"] == [0, 1] and f["detail"]["fields"] == ["shapes"] and f["detail"]["line"] == line
    assert f"rank 1 issued all_reduce [12] float32 at compile_abort_size_mismatch.py:{line}" in f["message"]
    assert f"rank 0 issued all_reduce [4, 4] float32 at compile_abort_size_mismatch.py:{line}" in f["message"]
    assert "SIGABRT" in f["detail"]["backend_errors"]["1"]  # the abort is evidence, not the cause
    assert [x["kind"] for x in report["findings"]] == ["collective_mismatch"]
    # rank 1's compiled collectives come from its graph run lines, rank 0's from its ring only: none counted twice
    assert [e.extra.get("from") for e in compiled_events(out, 1)] == ["graph_run", "graph_run"]
    assert [e.extra.get("from") for e in compiled_events(out, 0)] == [None, None]
