"""What the process group ran that Python did not call (torch's Flight Recorder ring), joined with the trace:
DDP's buckets and compiled graphs become events named by who issued them and the user's line. No process launched:
the dumps are written here as a rank writes them (rank/flight_recorder.py's format)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.distributed as dist

from distcheck.analysis import flight_recorder as fr
from distcheck.analysis.trace_events import TraceEvent, load_traces
from distcheck.contract import files, trace_lines
from distcheck.rank import flight_recorder as rank_fr
from distcheck.rank import tracer as trace
from distcheck.rank.cuda_completions import CudaCompletions


@pytest.fixture(autouse=True)
def _no_tracer_left():
    yield
    trace.uninstall()


def traced(eid: int, op: str, t: float, line: int = 10) -> TraceEvent:
    return TraceEvent(rank=0, id=eid, seq=eid, pg=(0, 1), op=op, shapes=[[4]], dtypes=["float32"], reduce_op="SUM",
                      peer=None, site=f"train.py:{line}", file="/p/train.py", line=line, t_start=t, t_end=t + 0.001,
                      pg_name="0")


def entry(rid: int, seq: int, name: str, t: float, size: int = 4, group: str = "0") -> dict:
    return {"record_id": rid, "pg_id": int(group), "process_group": [group, "default_pg"], "collective_seq_id": seq,
            "is_p2p": False, "profiling_name": name, "input_sizes": [[size]], "input_dtypes": ["Float"],
            "time_created_ns": int(t * 1e9), "time_discovered_completed_ns": 0, "state": "scheduled"}


def dump(entries, phases=(), graphs=None, seen=("ddp_init",), done=1000, rank=0) -> fr.FlightDump:
    doc = {"format": files.FORMAT, "entries": list(entries), "phases": list(phases), "graphs": graphs or {},
           "groups": {"0": [0, 1]}, "pg_status": {"0": {"last_completed_collective": str(done)}}, "seen": list(seen)}
    return _load(doc, rank)


def _load(doc: dict, rank: int) -> fr.FlightDump:
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    files.rank_file(d, "flight", rank).write_text(json.dumps(doc))
    return fr.load_dump(d, rank)


def test_ddp_bucket_all_reduces_are_named_at_the_backward_line():
    events = [traced(1, "all_reduce", 100.0)]
    ring = [entry(0, 1, "gloo:all_reduce", 100.0005),  # the traced call's own entry
            entry(1, 2, "gloo:all_reduce", 101.0, size=676), entry(2, 3, "gloo:all_reduce", 101.1, size=676)]
    phases = [{"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 100.9, "t1": 101.2}]
    merged = fr.merge(events, dump(ring, phases), TraceEvent)
    assert [(e.op, e.extra.get("origin"), e.line, e.seq) for e in merged] == [
        ("all_reduce", None, 10, 1), ("all_reduce", "ddp", 31, 2), ("all_reduce", "ddp", 31, 3)]
    assert merged[1].extra["via"] == "DDP gradient bucket all-reduce" and merged[1].shapes == [[676]]
    assert merged[1].group_key == "untraced:0" and merged[0].group_key == "0"  # a sequence of their own
    assert [e.id for e in merged] == [1, 2, 3] and merged[1].completed  # the group's counter passed them


def test_without_a_ddp_model_backward_collectives_are_torchs():
    ring = [entry(0, 1, "gloo:all_reduce", 101.0)]
    phases = [{"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 100.9, "t1": 101.2}]
    (ev,) = fr.merge([], dump(ring, phases, seen=()), TraceEvent)
    assert ev.extra["origin"] == "torch" and "during backward()" in ev.extra["via"]


def test_a_backend_running_one_op_as_another_is_still_the_traced_call():
    """gloo runs reduce_scatter as an all-reduce: the ring names what ran, the trace what the caller asked for."""
    events = [traced(1, "reduce_scatter_single", 100.0), traced(2, "all_gather_single", 100.01)]
    ring = [entry(0, 1, "gloo:all_reduce", 100.001), entry(1, 2, "gloo:all_gather", 100.011)]
    assert fr.merge(events, dump(ring), TraceEvent) == events


def test_an_entry_after_the_traced_call_owns_its_one_is_untraced():
    """A traced single-entry call claims one entry; DDP's all-reduce right after it is not its second."""
    events = [traced(1, "all_reduce", 100.0)]
    ring = [entry(0, 1, "gloo:all_reduce", 100.001), entry(1, 2, "gloo:all_reduce", 100.002)]
    merged = fr.merge(events, dump(ring), TraceEvent)
    assert [e.extra.get("untraced", False) for e in merged] == [False, True]
    assert merged[1].extra["origin"] == "torch"  # no phase around it: torch itself


def test_object_collectives_own_their_helper_entries():
    events = [traced(1, "all_gather_object", 100.0)]
    ring = [entry(0, 1, "gloo:all_gather", 100.001, size=1), entry(1, 2, "gloo:all_gather", 100.002, size=9)]
    assert fr.merge(events, dump(ring), TraceEvent) == events


def test_compiled_graph_collectives_get_the_line_inside_the_compiled_function():
    graphs = {"1": {"fn": "step", "file": "/p/train.py", "line": 20, "collectives": [
        {"op": "all_reduce", "file": "/p/train.py", "line": 22}, {"op": "all_reduce", "file": "/p/train.py",
                                                                   "line": 23}]}}
    phases = [{"kind": "compiled", "file": "/p/train.py", "line": 20, "t0": 100.0, "t1": 100.5, "graph": 1,
               "fn": "step"},
              {"kind": "compiled", "file": "/p/train.py", "line": 20, "t0": 101.0, "t1": 101.5, "graph": 1,
               "fn": "step"}]
    ring = [entry(0, 1, "gloo:all_reduce", 100.1), entry(1, 2, "gloo:all_reduce", 100.2),
            entry(2, 3, "gloo:all_reduce", 101.1), entry(3, 4, "gloo:all_reduce", 101.2)]
    merged = fr.merge([], dump(ring, phases, graphs), TraceEvent)
    assert [e.line for e in merged] == [22, 23, 22, 23]  # each run of the graph restarts its order
    assert {e.extra["via"] for e in merged} == {"all_reduce inside compiled step (train.py:20)"}
    assert {e.extra["origin"] for e in merged} == {"compiled"}


def test_entries_before_the_trace_began_belong_to_an_earlier_test():
    """A pytest pool's process keeps one ring across tests: only what came after this trace's start counts."""
    ring = [entry(0, 1, "gloo:all_reduce", 50.0), entry(1, 2, "gloo:all_reduce", 101.0)]
    assert [e.seq for e in fr.merge([], dump(ring), TraceEvent, since=100.0)] == [2]


def test_positions_below_what_every_ring_still_holds_are_dropped(tmp_path):
    """Rank 1's ring overflowed past seq 3: comparing seq 1-2 would call rank 0's extra."""
    for rank, first in ((0, 1), (1, 3)):
        (tmp_path / f"trace-rank{rank}.jsonl").write_text(json.dumps({"ev": "meta", "format": files.FORMAT,
                                                                      "t": 0.0}) + "\n")
        ring = [entry(i, i + 1, "gloo:all_reduce", 100.0 + i) for i in range(first - 1, 5)]
        files.rank_file(tmp_path, "flight", rank).write_text(json.dumps(
            {"format": files.FORMAT, "entries": ring, "phases": [], "graphs": {}, "groups": {"0": [0, 1]},
             "pg_status": {}, "seen": []}))
    traces = load_traces(tmp_path)
    assert [e.seq for e in traces[0].events] == [3, 4, 5] == [e.seq for e in traces[1].events]


def test_a_dump_of_another_format_is_named(tmp_path):
    files.rank_file(tmp_path, "flight", 0).write_text(json.dumps({"format": files.FORMAT + 1, "entries": []}))
    with pytest.raises(files.FormatError, match="Flight Recorder dump of rank 0"):
        fr.load_dump(tmp_path, 0)


def test_families_of_backend_names():
    assert fr.family("gloo:all_reduce") == fr.family("nccl:allreduce") == fr.family("all_reduce") == "all_reduce"
    assert fr.family("nccl:_allgather_base") == fr.family("all_gather_into_tensor") == "all_gather"
    assert fr.family("nccl:_reduce_scatter_base") == "reduce_scatter"


def test_graph_collectives_read_the_user_line_from_the_fx_stack_trace():
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(node):
        call = gm.graph.call_function(torch.ops._c10d_functional.all_reduce.default, (node, "sum", "0"))
        gm.graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (call,))
    call.meta["stack_trace"] = textwrap.dedent('''\
          File "/home/me/train.py", line 22, in step
            return funcol.all_reduce(x, "sum", group)
          File "/venv/lib/python3.11/site-packages/torch/distributed/_functional_collectives.py", line 179, in all_reduce
            tensor = torch.ops._c10d_functional.all_reduce(
        ''')
    assert rank_fr.graph_collectives(gm) == [{"op": "all_reduce", "file": "/home/me/train.py", "line": 22,
                                               "shape": None, "group": "0", "input_shape": None, "dtype": None}]


def test_a_compiled_collective_compiles_under_the_tracer(fake_world, tmp_path):
    """Dynamo inlines the tracer's wrapper; with fullgraph=True it must see torch's own function (no graph break)."""
    trace.install(tmp_path, 0)

    @torch.compile(fullgraph=True, backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x * 2

    assert torch.equal(step(torch.ones(4)), torch.full((4,), 2.0))  # fake group: the all-reduce leaves x as it is
    torch._dynamo.reset()


def test_a_compile_session_or_an_export_runs_torchs_own_function_untraced(fake_world, tmp_path, monkeypatch):
    """What torch.compiler.is_compiling() says True to beyond Dynamo (a compile session, torch.export's non-strict
    tracing, which runs the wrapper as plain Python): the wrapper steps aside there too, and says so by recording
    nothing."""
    trace.install(tmp_path, 0)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    dist.all_reduce(torch.ones(4))
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
    dist.all_reduce(torch.ones(4))  # eager again: traced
    trace.uninstall()
    assert len(load_traces(tmp_path)[0].events) == 1


def test_a_torch_without_the_compile_flag_takes_is_compiling_as_the_test(fake_world, tmp_path, monkeypatch):
    """pyproject allows any torch from 2.6: where torch.compiler has no is_dynamo_compiling or compile flag, the
    wrapper asks is_compiling() and never reads what is not there."""
    monkeypatch.delattr(torch.compiler, "is_dynamo_compiling")
    monkeypatch.delattr(torch.compiler, "_is_compiling_flag")
    compiling = [False]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling[0])
    trace.install(tmp_path, 0)
    dist.all_reduce(torch.ones(4))  # traced
    compiling[0] = True
    dist.all_reduce(torch.ones(4))  # torch's own function, untraced
    trace.uninstall()
    assert len(load_traces(tmp_path)[0].events) == 1


def test_a_collective_called_through_a_library_names_the_users_line_and_the_library_call(fake_world, tmp_path,
                                                                                          line_of):
    lib = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "fakelib"
    lib.mkdir(parents=True)
    (lib / "comm.py").write_text("import torch.distributed as dist\n\n\ndef sync(t):\n    dist.all_reduce(t)\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("fakelib_comm", lib / "comm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trace.install(tmp_path / "out", 0)
    module.sync(torch.ones(4))  # USER LINE
    trace.uninstall()
    (event,) = load_traces(tmp_path / "out")[0].events
    assert event.line == line_of(__file__, "# USER LINE")
    assert event.extra["via"] == "fakelib/comm.py:5 in sync"


def test_nccl_collectives_take_their_end_from_the_ring():
    """The tracer leaves a synchronous NCCL collective's end to NCCL's ring, which knows when it completed."""
    ev = traced(1, "all_reduce", 100.0)
    ev.t_end, ev.extra["completion"] = None, "flight_recorder"
    pending = traced(2, "all_reduce", 101.0)
    pending.t_end, pending.extra["completion"] = None, "flight_recorder"
    done = {**entry(0, 1, "nccl:all_reduce", 100.001), "ring": "nccl", "time_discovered_completed_ns": int(100.5e9),
            "state": "completed"}
    started = {**entry(1, 2, "nccl:all_reduce", 101.001), "ring": "nccl", "state": "started"}
    merged = fr.merge([ev, pending], dump([done, started], done=0), TraceEvent)
    assert [(e.id, e.t_end) for e in merged] == [(1, 100.5), (2, None)]


def test_without_a_ring_nccl_ends_are_assumed_but_the_last_of_each_group():
    events = [traced(i, "all_reduce", 100.0 + i) for i in (1, 2, 3)]
    for e in events:
        e.t_end, e.extra["completion"] = None, "flight_recorder"
    fr.merge(events, None, TraceEvent)
    assert [e.t_end is not None for e in events] == [True, True, False]
    assert events[0].extra["end_unknown"] and "end_unknown" not in events[2].extra


def test_compile_rewrites_survive_a_reinstall(fake_world, tmp_path):
    """A pytest pool installs the tracer per test: _functional_collectives, imported while an earlier install was
    active, keyed Dynamo's rewrite by that install's wrapper. The next install must still compile."""
    from torch.distributed import _functional_collectives as fc

    remaps = fc.traceable_collective_remaps
    original = dist.all_reduce
    target = remaps[original]
    trace.install(tmp_path / "a", 0)
    first_wrapper = dist.all_reduce
    trace.uninstall()
    del remaps[original]  # as if imported under the first install
    remaps[first_wrapper] = target
    try:
        trace.install(tmp_path / "b", 0)

        @torch.compile(fullgraph=True, backend="eager")
        def step(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x + 1

        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        trace.uninstall()
        torch._dynamo.reset()
        for key in [k for k in remaps if getattr(k, "__distcheck_original__", None) is original]:
            del remaps[key]
        remaps[original] = target


def test_a_barrier_before_ddp_does_not_swallow_ddps_entries():
    """A traced call that may issue several backend ops owns at most that many, and never what a DDP backward
    that began after it recorded (a barrier right after init is common)."""
    events = [traced(1, "barrier", 100.0)]
    ring = [entry(0, 1, "gloo:barrier", 100.001), entry(1, 2, "gloo:all_reduce", 101.0, size=676),
            entry(2, 3, "gloo:all_reduce", 102.0, size=676)]
    phases = [{"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 100.9, "t1": 101.1},
              {"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 101.9, "t1": 102.1}]
    merged = fr.merge(events, dump(ring, phases), TraceEvent)
    assert [(e.op, e.extra.get("origin")) for e in merged] == [("barrier", None), ("all_reduce", "ddp"),
                                                               ("all_reduce", "ddp")]


def test_an_object_call_without_entries_of_its_own_takes_none_of_ddps():
    """gloo records no ring entry for send_object_list's point-to-point ops: DDP's later entries stay DDP's."""
    events = [traced(1, "send_object_list", 100.0)]
    ring = [entry(0, 1, "gloo:all_reduce", 101.0, size=676)]
    phases = [{"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 100.5, "t1": 101.5}]
    merged = fr.merge(events, dump(ring, phases), TraceEvent)
    assert merged[1].extra["origin"] == "ddp"


def test_group_members_come_from_the_trace_when_the_dump_lost_them():
    """A dump written after destroy_process_group() may name no ranks for a group; the traced calls on it do."""
    doc = {"format": files.FORMAT, "entries": [entry(0, 1, "gloo:all_reduce", 101.0)], "phases": [], "graphs": {},
           "groups": {}, "pg_status": {}, "seen": []}
    merged = fr.merge([traced(1, "broadcast", 100.0)], _load(doc, 0), TraceEvent)
    assert merged[1].pg == (0, 1)


def test_the_innermost_open_phase_is_found_among_many():
    phases = [{"kind": "backward", "t0": float(i), "t1": i + 0.5} for i in range(1000)]
    phases.append({"kind": "ddp_forward", "t0": 10.1, "t1": 10.2})
    index = fr._PhaseIndex(phases)
    assert index.at(10.15)["kind"] == "ddp_forward" and index.at(10.3)["kind"] == "backward"
    assert index.at(10.7) is None and index.at(999.2)["t0"] == 999.0
    assert index.began_between(10.0, 10.15) and not index.began_between(10.2, 10.9)


def test_a_synchronous_nccl_collective_is_left_open_for_the_ring():
    """No CUDA event of distcheck's for a sig whose end NCCL's ring records (+53 us per collective on an H100):
    the record stays open until the analysis stores the ring's end into it."""
    created: list[int] = []

    def new_event():
        created.append(1)
        raise AssertionError("no event may be made for a ring-completed collective")

    completions = CudaCompletions(lambda eid, t: None, new_event, sig_of=lambda eid: 7 if eid == 1 else 8)
    completions.ring_sigs.add(7)
    completions.add(1)
    assert created == [] and completions.poll() == 0


def test_an_entry_of_a_phase_that_ended_is_completed_though_glooss_counter_lags():
    """gloo's completed counter lagged behind DDP ops a rank had long finished: a rank stuck in its data loader
    was said to wait in a DDP broadcast. A phase that ended waited for what it issued; an open one did not."""
    ring = [entry(0, 5, "gloo:broadcast", 101.0), entry(1, 6, "gloo:all_reduce", 102.0)]
    phases = [{"kind": "ddp_forward", "file": "/p/train.py", "line": 30, "t0": 100.9, "t1": 101.1},
              {"kind": "backward", "file": "/p/train.py", "line": 31, "t0": 101.9, "t1": None}]
    merged = fr.merge([], dump(ring, phases, done=4), TraceEvent)
    assert [(e.seq, e.t_end) for e in merged] == [(5, 101.1), (6, None)]


# -- dumps of rings whose every collective was traced --------------------------------------------------------------
def write_trace(report_dir, calls, errors=(), nccl=False) -> None:
    """A rank's trace files as the tracer writes them: ``calls`` (op, group name, start time); ``errors``: indexes
    of calls whose JSON end line carries an error; ``nccl``: synchronous NCCL calls, whose records the tracer
    leaves open for the ring's completion times (``completion: flight_recorder``)."""
    import numpy as np

    from distcheck.contract import trace_slots

    lines = trace_lines.LineWriter(files.rank_file(report_dir, "trace", 0))
    lines.write({"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": 0, "t": 1.0})
    sigs: dict[tuple, int] = {}
    recs = np.zeros(len(calls), trace_slots.slot_dtype())
    for i, (op, group, t) in enumerate(calls):
        if (op, group) not in sigs:
            sigs[op, group] = len(sigs) + 1
            lines.write({"ev": "sig", "sig": sigs[op, group], "op": op, "pg": "0,1", "pg_name": group,
                         "shapes": [[4]], "dtypes": ["float32"], "reduce_op": None, "peer": 1 if "send" in op else None,
                         "root": None, "site": "train.py:10", "file": "/p/train.py", "line": 10,
                         **({"completion": "flight_recorder"} if nccl else {})})
        recs[i] = (trace_slots.START, 0, b"\0\0", sigs[op, group], t, 0.0 if nccl else t + 0.001)
    for i in errors:
        lines.write({"ev": "end", "id": i + 1, "t": calls[i][2] + 0.002, "error": "Connection reset by peer"})
    lines.close()
    with open(files.rank_file(report_dir, "trace_events", 0), "wb") as fh:
        fh.write(trace_slots.header(files.FORMAT))
        recs.tofile(fh)


GIDS = {"0": 0, "7": 1}  # torch's group ids count the groups this process made; the names are the tracer's


def ring_of(calls, untraced=(), held=None) -> tuple[list[dict], dict]:
    """The c10d ring (entries, pg_status keyed ring:group id) of a rank that issued ``calls`` and then
    ``untraced`` (op, group, time) from C++; ``held``: how many of the last entries the ring still holds."""
    entries, count = [], {}
    for rid, (op, group, t) in enumerate(sorted([*calls, *untraced], key=lambda c: c[2])):
        count[group] = count.get(group, 0) + 1
        entries.append({**entry(rid, count[group], f"gloo:{op}", t + 0.0001, group=group), "ring": "c10d",
                        "pg_id": GIDS[group]})
    if held is not None:
        entries = entries[len(entries) - held:]
    status = {f"c10d:{GIDS[g]}": {"last_enqueued_collective": str(n), "last_completed_collective": str(n)}
              for g, n in count.items()}
    return entries, status


def all_traced(tmp_path, calls, untraced=(), held=None, snapshot=None, errors=(), issued=None,
               more_status=None) -> bool:
    """fr.all_traced on a trace of ``calls`` and the ring of a rank that issued ``issued`` (default: the same
    calls) and ``untraced``."""
    write_trace(tmp_path, calls, errors)
    entries, status = ring_of(calls if issued is None else issued, untraced, held)
    text = files.rank_file(tmp_path, "trace", 0).read_text().splitlines()
    binary = files.rank_file(tmp_path, "trace_events", 0).read_bytes()
    return fr.all_traced(entries, {**status, **(more_status or {})}, text, binary,
                         snapshot or {"phases": [], "graphs": {}, "seen": []})


STEPS = [("all_reduce", "0", 100.0 + i) if i % 3 else ("broadcast", "7", 100.0 + i) for i in range(12)]


def test_a_ring_whose_every_collective_was_traced_is_all_traced(tmp_path):
    assert all_traced(tmp_path, STEPS)
    assert all_traced(tmp_path, STEPS, held=3)  # the ring overflowed: group 7's entries are gone, its counter stays
    # gloo runs reduce_scatter as an all-reduce: the ring names what ran (same_kind, as merge)
    assert all_traced(tmp_path, [("reduce_scatter", "0", 100.0), ("all_reduce", "0", 101.0)])


@pytest.mark.parametrize("case", ["ddp_bucket", "evicted_untraced", "other_kind", "created_before_the_call",
                                  "failed_call", "p2p", "ddp_model", "compiled_graph", "nccl", "other_group",
                                  "call_without_entry"])
def test_a_ring_with_anything_untraced_is_not(tmp_path, case):
    """Each case is a ring where merge() finds (or could find) an untraced entry, or whose entries a trace cannot be
    held against one for one: the dump keeps its entries."""
    calls, kw = list(STEPS), {}
    if case == "ddp_bucket":  # an all-reduce issued from C++ after the last traced call
        kw = {"untraced": [("all_reduce", "0", 200.0)]}
    elif case == "evicted_untraced":  # the same, but it left the ring: only group 0's counter says so
        kw = {"untraced": [("all_reduce", "0", 99.0)], "held": len(STEPS)}
    elif case == "other_kind":  # as many entries as calls, but one traced call issued nothing and C++ another op
        calls[4] = ("broadcast", "0", calls[4][2])
        kw = {"issued": STEPS}
    elif case == "created_before_the_call":  # the counts and kinds agree, the order does not
        calls[5] = (calls[5][0], calls[5][1], calls[5][2] + 0.5)
        kw = {"issued": STEPS}
    elif case == "failed_call":
        kw = {"errors": (4,)}
    elif case == "call_without_entry":  # the counters disagree the other way: which call is whose is unknown
        calls.append(("all_reduce", "0", 300.0))
        kw = {"issued": STEPS}
    elif case == "p2p":
        calls.append(("send", "0", 300.0))
        kw = {"issued": STEPS}
    elif case == "ddp_model":
        kw = {"snapshot": {"phases": [], "graphs": {}, "seen": ["backward", "ddp_init"]}}
    elif case == "compiled_graph":
        kw = {"snapshot": {"phases": [], "graphs": {"1": {"fn": "step"}}, "seen": []}}
    elif case == "nccl":
        kw = {"more_status": {"nccl:0": {"last_enqueued_collective": "3", "last_completed_collective": "3"}}}
    elif case == "other_group":  # a group only C++ used, whose entries left the ring
        GIDS["9"] = 2
        kw = {"untraced": [("all_reduce", "9", 50.0)], "held": len(calls)}
    try:
        assert not all_traced(tmp_path, calls, **kw)
    finally:
        GIDS.pop("9", None)
    if case in ("ddp_bucket", "other_kind", "created_before_the_call"):  # what the full join finds there
        entries, _ = ring_of(kw.get("issued") or calls, kw.get("untraced", ()))
        doc = {"format": files.FORMAT, "entries": entries, "phases": [], "graphs": {}, "groups": {}, "pg_status": {},
               "seen": []}
        events = load_traces(tmp_path, summarize=False)[0].events  # no dump yet: the traced calls only
        assert any(e.extra.get("untraced") for e in fr.merge(events, _load(doc, 0), TraceEvent))


def test_the_rank_writes_an_all_traced_dump_without_entries_and_a_full_one_otherwise(tmp_path, monkeypatch):
    """rank/flight_recorder.dump holds the ring (here as torch's dump function returns it) against the trace
    files beside it: counters only when they agree, the whole ring when C++ issued one more."""
    monkeypatch.setattr(rank_fr, "phases", rank_fr.Phases())
    write_trace(tmp_path, STEPS)
    ring: dict = {}

    def fake_dump(with_entries: bool, only_active: bool) -> str:
        status = {key.split(":")[1]: s for key, s in ring["status"].items()}  # torch keys them by group id
        return json.dumps({"version": "2.10", "pg_config": {}, "pg_status": status,
                           **({"entries": ring["entries"]} if with_entries else {})})

    monkeypatch.setattr(rank_fr, "_rings", lambda: [("c10d", fake_dump)])
    ring["entries"], ring["status"] = ring_of(STEPS)
    for e in ring["entries"]:
        e.pop("ring")  # torch's own entries do not name the ring
    assert rank_fr.dump(tmp_path, 0, "exit")
    path = files.rank_file(tmp_path, "flight", 0)
    doc = json.loads(path.read_text())
    assert doc["all_traced"] is True and doc["entries"] == [] and doc["pg_status"] == ring["status"]
    assert path.stat().st_size < 600
    loaded = fr.load_dump(tmp_path, 0)
    assert loaded.all_traced and loaded.entries == [] and loaded.window == {}

    ring["entries"], ring["status"] = ring_of(STEPS, [("all_reduce", "0", 200.0)])
    for e in ring["entries"]:
        e.pop("ring")
    assert rank_fr.dump(tmp_path, 0, "exit")
    doc = json.loads(path.read_text())
    assert doc["all_traced"] is False and len(doc["entries"]) == len(STEPS) + 1
    (extra,) = [e for e in load_traces(tmp_path)[0].events if e.extra.get("untraced")]
    assert extra.seq == 9 and extra.t_start == pytest.approx(200.0001)


# -- NCCL: the ring's completion times stored into the trace at the dump ---------------------------------------------
def nccl_ring_of(calls, untraced=(), held=None, pending=0) -> tuple[list[dict], dict]:
    """NCCL's ring as torch's dump function returns it (entries without a ring name, pg_status keyed by group id)
    for a rank that issued ``calls`` and ``untraced``; each op completed 0.5 ms after its start but the last
    ``pending`` (still on the GPU: no completion time, the group's counter below them)."""
    issued = sorted([*calls, *untraced], key=lambda c: c[2])
    entries, count, completed = [], {}, {}
    for rid, (op, group, t) in enumerate(issued):
        count[group] = count.get(group, 0) + 1
        done = rid < len(issued) - pending
        if done:
            completed[group] = count[group]
        entries.append({**entry(rid, count[group], f"nccl:{op}", t + 0.0001, group=group), "pg_id": GIDS[group],
                        "time_discovered_completed_ns": int((t + 0.0005) * 1e9) if done else 0,
                        "state": "completed" if done else "started"})
    if held is not None:
        entries = entries[len(entries) - held:]
    status = {str(GIDS[g]): {"last_enqueued_collective": str(n), "last_completed_collective": str(completed.get(g, -1))}
              for g, n in count.items()}
    return entries, status


def nccl_dump(tmp_path, monkeypatch, full: bool = False, **ring) -> dict:
    """rank/flight_recorder.dump of an NCCL ring (``ring``: nccl_ring_of's arguments) against the trace files in
    ``tmp_path``; ``full``: as every dump was before the ends were stored (the entries kept). The document."""
    monkeypatch.setattr(rank_fr, "phases", rank_fr.Phases())
    entries, status = nccl_ring_of(STEPS, **ring)

    def fake_dump(with_entries: bool, only_active: bool) -> str:
        return json.dumps({"version": "2.10", "pg_config": {}, "pg_status": status,
                           **({"entries": entries} if with_entries else {})})

    monkeypatch.setattr(rank_fr, "_rings", lambda: [("nccl", fake_dump)])
    with monkeypatch.context() as m:
        if full:
            m.setattr(rank_fr, "_all_traced", lambda *args: False)
        assert rank_fr.dump(tmp_path, 0, "exit")
    return json.loads(files.rank_file(tmp_path, "flight", 0).read_text())


def _said(tmp_path) -> list[tuple]:
    from distcheck.analysis.progress import progress_by_rank

    traces = load_traces(tmp_path)
    return [(e.id, e.seq, e.op, e.pg_name, e.t_start, e.t_end, sorted(e.extra.items()))
            for e in traces[0].events] + [progress_by_rank(traces)[0].to_json()]


def _ends(tmp_path) -> list[float | None]:
    from distcheck.contract import trace_slots

    return [r.t_end for r in trace_slots.iter_slots(files.rank_file(tmp_path, "trace_events", 0).read_bytes())]


@pytest.mark.parametrize("pending", [0, 1])
def test_an_nccl_rank_stores_the_rings_ends_into_its_trace_and_writes_an_all_traced_dump(tmp_path, monkeypatch,
                                                                                        pending):
    """The tracer leaves each synchronous NCCL collective's record open; at the dump the rank stores the ends
    NCCL's ring knows into them, and the dump without entries then reads as the full one merged. With ``pending``,
    the last collective has not completed (a rank stuck in it): its record stays open, as merge leaves it."""
    write_trace(tmp_path, STEPS, nccl=True)
    full = nccl_dump(tmp_path, monkeypatch, full=True, pending=pending)
    assert full["all_traced"] is False and len(full["entries"]) == len(STEPS)
    assert _ends(tmp_path) == [None] * len(STEPS)  # nothing stored: merge takes the ends from the entries
    expected = _said(tmp_path)

    doc = nccl_dump(tmp_path, monkeypatch, pending=pending)
    assert doc["all_traced"] is True and doc["entries"] == [] and fr.load_dump(tmp_path, 0).all_traced
    ends = _ends(tmp_path)
    assert ends[:len(STEPS) - pending] == [pytest.approx(t + 0.0005) for _, _, t in STEPS[:len(STEPS) - pending]]
    assert ends[len(STEPS) - pending:] == [None] * pending
    assert _said(tmp_path) == expected
    events = load_traces(tmp_path)[0].events
    assert (events[-1].t_end is None) == bool(pending) and not any(e.extra.get("end_unknown") for e in events)


def test_the_pairing_names_each_traced_record_and_its_ring_entry(tmp_path):
    write_trace(tmp_path, STEPS, nccl=True)
    entries, status = nccl_ring_of(STEPS, pending=1)
    entries = [{**e, "ring": "nccl"} for e in entries]
    status = {f"nccl:{gid}": s for gid, s in status.items()}
    text = files.rank_file(tmp_path, "trace", 0).read_text().splitlines()
    binary = files.rank_file(tmp_path, "trace_events", 0).read_bytes()
    snapshot = {"phases": [], "graphs": {}, "seen": []}
    ring = fr.traced_ring(entries, status, text, binary, snapshot)
    assert ring is not None
    assert {slot: e["record_id"] for slot, e in ring.pairs.items()} == {i + 1: i for i in range(len(STEPS))}
    assert sorted(ring.ends) == list(range(1, len(STEPS)))  # the last is still on the GPU
    assert not fr.all_traced(entries, status, text, binary, snapshot)  # the plain check still leaves NCCL out


def test_an_nccl_record_whose_entry_left_the_ring_ends_by_its_groups_counter(tmp_path, monkeypatch):
    """A job longer than the ring: the first collective's entry is gone, but its group's completed counter passed
    it, so the small dump still goes, with that record's end taken as its start (when, the ring no longer says)."""
    write_trace(tmp_path, STEPS, nccl=True)
    doc = nccl_dump(tmp_path, monkeypatch, held=len(STEPS) - 1)
    assert doc["all_traced"] is True and doc["entries"] == []
    ends = _ends(tmp_path)
    assert ends[0] == pytest.approx(STEPS[0][2]) and all(e is not None for e in ends)


def test_an_nccl_record_whose_entry_left_the_ring_and_whose_counter_is_below_it_keeps_the_entries(tmp_path):
    """Nothing says the op whose entry left the ring completed (its group's counter is below it): no end to give."""
    write_trace(tmp_path, STEPS, nccl=True)
    entries, status = nccl_ring_of(STEPS, held=len(STEPS) - 1)  # the first op (group 7, position 1) left the ring
    entries = [{**e, "ring": "nccl"} for e in entries]
    status = {f"nccl:{gid}": s for gid, s in status.items()}
    text = files.rank_file(tmp_path, "trace", 0).read_text().splitlines()
    binary = files.rank_file(tmp_path, "trace_events", 0).read_bytes()
    snapshot = {"phases": [], "graphs": {}, "seen": []}
    assert fr.traced_ring(entries, status, text, binary, snapshot) is not None
    status[f"nccl:{GIDS['7']}"]["last_completed_collective"] = "0"
    assert fr.traced_ring(entries, status, text, binary, snapshot) is None


@pytest.mark.parametrize("case", ["untraced_entry", "entry_left_the_ring", "two_open_in_a_group"])
def test_an_nccl_ring_that_cannot_give_every_end_keeps_its_entries_and_the_trace_its_records(tmp_path, monkeypatch,
                                                                                          case):
    """An entry Python did not call (a DDP bucket), an open record whose entry left the ring (no end for it), or a
    group with two ops not yet completed (a load without entries would assume an end for the first): the dump
    keeps its entries, nothing is stored into the trace, and merge reads it as before."""
    write_trace(tmp_path, STEPS, nccl=True)
    ring = {"untraced_entry": {"untraced": [("all_reduce", "0", 200.0)]},
            "entry_left_the_ring": {"held": len(STEPS) - 2, "pending": 2},  # and its group's counter is below it
            "two_open_in_a_group": {"pending": 3}}[case]  # the last three: two of them on group 0
    doc = nccl_dump(tmp_path, monkeypatch, **ring)
    assert doc["all_traced"] is False and doc["entries"]
    assert _ends(tmp_path) == [None] * len(STEPS)
    events = load_traces(tmp_path)[0].events
    if case == "untraced_entry":
        assert [e.seq for e in events if e.extra.get("untraced")] == [9]


# -- graph run lines: a rank's compiled collectives when its ring was never dumped -----------------------------------
GRAPH = {"graph": 1, "fn": "step", "file": "/p/train.py", "line": 20, "groups": {"0": [0, 1]}, "ddp": False,
         "collectives": [{"op": "all_reduce", "file": "/p/train.py", "line": 22, "group": "0",
                          "input_shape": ["s3"], "dtype": "torch.float32"},
                         {"op": "all_gather_into_tensor", "file": "/p/train.py", "line": 23, "group": "0",
                          "input_shape": [2, 2], "dtype": "torch.bfloat16"}]}


def graph_trace(tmp_path, runs, calls=(), rank=0):
    """A rank's trace lines with ``runs`` of GRAPH ((time, size of s3)) and traced all_reduces at ``calls``."""
    lines = [{"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "t": 1.0},
             {"ev": "graph", **GRAPH, "t": runs[0][0]}]
    lines += [{"ev": "graph_run", "graph": 1, "t": t, "sizes": {"s3": n}} for t, n in runs]
    lines += [{"ev": "start", "id": 100 + i, "seq": i + 1, "op": "all_reduce", "pg": "0,1", "pg_name": "0",
               "shapes": [[4]], "dtypes": ["float32"], "t": t} for i, t in enumerate(calls)]
    files.rank_file(tmp_path, "trace", rank).write_text("\n".join(map(json.dumps, lines)) + "\n")
    return lines


def test_graph_and_graph_run_lines_are_read_with_a_dynamic_graphs_sizes(tmp_path):
    from distcheck.analysis.rank_trace import parse_lines

    lines = graph_trace(tmp_path, [(10.0, 8), (11.0, 12)])
    parsed = parse_lines([json.dumps(x) for x in lines] + ['{"ev": "graph_run", "graph": 1'], 0)  # a cut last line
    assert parsed.graphs[1]["collectives"] == GRAPH["collectives"]
    assert parsed.graph_runs == [(1, 10.0, {"s3": 8}, {}), (1, 11.0, {"s3": 12}, {})]  # no DDP: no counters
    with_counter = parse_lines(['{"ev": "graph_run", "graph": 1, "t": 12.0, "seq": {"0": 7}}'], 0).graph_runs
    assert with_counter == [(1, 12.0, {}, {"0": 7})] and with_counter[0].seq == {"0": 7}


def test_without_a_dump_each_graph_run_is_its_collectives_numbered_after_the_traced_ones(tmp_path):
    graph_trace(tmp_path, [(10.0, 8), (11.0, 12)], calls=[5.0, 10.5])
    trace = load_traces(tmp_path)[0]
    compiled = [e for e in trace.events if e.extra.get("from") == "graph_run"]
    assert [(e.op, e.shapes, e.dtypes, e.line, e.seq, e.pg) for e in compiled] == [
        ("all_reduce", [[8]], ["float32"], 22, 2, (0, 1)), ("all_gather", [[2, 2]], ["bfloat16"], 23, 3, (0, 1)),
        ("all_reduce", [[12]], ["float32"], 22, 5, (0, 1)), ("all_gather", [[2, 2]], ["bfloat16"], 23, 6, (0, 1))]
    assert {e.group_key for e in compiled} == {"untraced:0"}
    assert {e.extra["via"].split(" (")[0] for e in compiled} == {"all_reduce inside compiled step",
                                                                  "all_gather inside compiled step"}
    assert [e.t_end for e in compiled] == [10.0, 10.0, None, None]  # the last run is where the rank stopped
    assert [e.id for e in trace.events] == [1, 2, 3, 4, 5, 6] and trace.events[0].t_start == 5.0
    assert trace.flight_dumped  # they name all it can have issued untraced: its untraced sequence is compared


def test_a_dumped_ring_stays_authoritative_for_the_runs_it_covers(tmp_path):
    graph_trace(tmp_path, [(10.0, 8), (11.0, 12)])
    phases = [{"kind": "compiled", "file": "/p/train.py", "line": 20, "t0": 10.0, "t1": 10.5, "graph": 1,
               "fn": "step"}]
    doc = {"format": files.FORMAT, "t": 10.7, "phases": phases, "graphs": {"1": GRAPH}, "groups": {"0": [0, 1]},
           "pg_status": {}, "seen": ["compiled"],
           "entries": [entry(0, 1, "gloo:all_reduce", 10.1, size=8), entry(1, 2, "gloo:all_gather", 10.2)]}
    files.rank_file(tmp_path, "flight", 0).write_text(json.dumps(doc))
    events = load_traces(tmp_path)[0].events
    # the first run from the ring (dumped at 10.7), the one after the dump from its run line: nothing twice
    assert [(e.extra.get("from"), e.shapes, e.seq) for e in events] == [
        (None, [[8]], 1), (None, [[4]], 2), ("graph_run", [[12]], 3), ("graph_run", [[2, 2]], 4)]
    doc["t"] = 12.0  # a dump after both runs: the ring alone
    files.rank_file(tmp_path, "flight", 0).write_text(json.dumps(doc))
    assert [e.extra.get("from") for e in load_traces(tmp_path)[0].events] == [None, None]


def test_graph_runs_after_a_ddp_model_was_built_are_events_but_do_not_stand_for_the_ring(tmp_path):
    lines = graph_trace(tmp_path, [(10.0, 8)])
    lines[1]["ddp"] = True  # DDP's own collectives share the group's untraced sequence and only the ring has them
    files.rank_file(tmp_path, "trace", 0).write_text("\n".join(map(json.dumps, lines)) + "\n")
    trace = load_traces(tmp_path)[0]
    assert len(trace.events) == 2 and not trace.flight_dumped


def test_a_symbol_without_a_value_leaves_the_shape_unknown():
    graphs = {1: {**GRAPH, "collectives": GRAPH["collectives"][:1]}}
    (ev,), complete = fr.graph_run_events([], graphs, [(1, 10.0, {})], None, TraceEvent, 0)
    assert ev.shapes == [] and ev.dtypes == ["float32"] and complete


def test_compiled_graph_runs_write_one_description_and_a_line_per_run(fake_world, tmp_path):
    """Under the tracer, a compiled graph's first run writes its ``graph`` line, each run a ``graph_run`` line; a
    dynamic graph's run line carries its size symbols' values."""
    trace.install(tmp_path, 0)
    try:
        @torch.compile(fullgraph=True, backend="eager")
        def step(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x * 2

        for n in (4, 4, 6, 7):
            step(torch.ones(n))
    finally:
        trace.uninstall()
        torch._dynamo.reset()
    recs = list(trace_lines.read_records(files.rank_file(tmp_path, "trace", 0).read_text().splitlines()))
    graphs = [r for r in recs if r["ev"] == trace_lines.GRAPH]
    runs = [r for r in recs if r["ev"] == trace_lines.GRAPH_RUN]
    assert len(graphs) == 2 and [r["graph"] for r in runs] == [graphs[0]["graph"]] * 2 + [graphs[1]["graph"]] * 2
    (static,), (dynamic,) = graphs[0]["collectives"], graphs[1]["collectives"]
    assert static["input_shape"] == [4] and static["dtype"] == "torch.float32" and static["group"]
    assert graphs[0]["groups"] == {static["group"]: [0, 1]} and graphs[0]["ddp"] is False
    (symbol,) = dynamic["input_shape"]
    assert [r["sizes"] for r in runs[2:]] == [{symbol: 6}, {symbol: 7}] and "sizes" not in runs[0]
