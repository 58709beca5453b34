"""The collective tracer on torch's fake process group (no process launched): what it records, where it records it
(a shared memory map that survives the process), and when an op counts as completed."""
from __future__ import annotations

import contextlib
import json
import sys
import time

import pytest
import torch
import torch.distributed as dist

from distcheck.analysis.hang import progress_from_events
from distcheck.analysis.trace_events import load_traces, parse_lines
from distcheck.contract import files
from distcheck.contract import trace_slots
from distcheck.rank import tracer as trace
from distcheck.rank.call_keys import call_key
from distcheck.rank.cuda_completions import CudaCompletions


@pytest.fixture(autouse=True)
def _no_tracer_left():
    yield
    trace.uninstall()  # a failing test must not leave the next one traced


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Both ways a call is traced: the C path (_tracefast.c, built by pip install where a compiler is there) and
    the Python path every call falls back to."""
    if request.param == "python":
        monkeypatch.setattr(trace, "_tracefast", None)
    elif trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    return request.param


def test_events_carry_the_user_site_shapes_and_completion(fake_world, tmp_path, line_of, hot_path):
    trace.install(tmp_path, 0)
    x = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(x)  # SYNC
    dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True).wait()  # ASYNC
    dist.broadcast(torch.ones(2, 3), src=1)  # ROOTED
    trace.uninstall()
    events = load_traces(tmp_path)[0].events

    def site(marker: str) -> str:
        return f"test_tracer.py:{line_of(__file__, marker)}"

    assert [(e.op, e.seq, e.site) for e in events] == [
        ("all_reduce", 1, site("# SYNC")), ("all_reduce", 2, site("# SYNC")), ("all_reduce", 3, site("# SYNC")),
        ("all_reduce", 4, site("# ASYNC")), ("broadcast", 5, site("# ROOTED"))]
    assert all(e.completed and not e.issued_only for e in events)
    assert events[3].reduce_op == "MAX" and events[4].root == 1 and events[4].shapes == [[2, 3]]
    # One sig line per distinct call, not per event; one record per collective, its end stored into it; the
    # closed record file holds exactly what was written.
    lines = [json.loads(s) for s in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
    assert [d["ev"] for d in lines] == ["meta", "sig", "sig", "sig"] and lines[0]["hot_path"] == hot_path
    assert (tmp_path / "trace-rank0.bin").stat().st_size == trace_slots.SIZE * (1 + len(events))
    assert [e.id for e in events] == [1, 2, 3, 4, 5] and all(e.t_end >= e.t_start for e in events)


def test_a_call_with_new_tensors_each_step_reuses_its_description(fake_world, tmp_path, hot_path):
    """Keyword or positional, a fresh tensor of the same shape is the same call: one sig line, no tensor kept."""
    trace.install(tmp_path, 0)
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # torch < 2.13
    for _ in range(5):
        dist.all_reduce(tensor=torch.ones(4), op=dist.ReduceOp.SUM)
        getattr(dist, gather)(torch.empty(8), torch.ones(4))
    trace.uninstall()
    lines = [json.loads(s) for s in (tmp_path / "trace-rank0.jsonl").read_text().splitlines()]
    assert [d["op"] for d in lines if d["ev"] == "sig"] == ["all_reduce", gather]
    assert len(load_traces(tmp_path)[0].events) == 10


def test_one_line_issuing_what_changes_from_call_to_call_records_each_call_as_it_was(fake_world, tmp_path,
                                                                                     hot_path):
    """The C path's site cache holds a line's last call: a call at that line with another shape, dtype, reduce op,
    group or keywords, or with its one tensor resized in place, is recorded as itself, and alternating calls stay
    right."""
    trace.install(tmp_path, 0)
    other = dist.new_group([0, 1])
    x = torch.ones(4)
    MAX, SUM = dist.ReduceOp.MAX, dist.ReduceOp.SUM
    calls = [((x,), {}), ((torch.ones(2, 2),), {}), ((torch.ones(4, dtype=torch.float64),), {}), ((x, MAX), {}),
             ((x, SUM, other), {}), ((x,), {"op": MAX}), ((x,), {"group": other}), ((), {"tensor": x}),
             ((), {"tensor": torch.ones(3)}), ((x,), {}), ((torch.ones(2, 2),), {})]
    expected = []
    for args, kwargs in calls * 2:
        dist.all_reduce(*args, **kwargs)  # ONE LINE
        tensor = args[0] if args else kwargs["tensor"]
        op = args[1] if len(args) > 1 else kwargs.get("op", SUM)
        group = args[2] if len(args) > 2 else kwargs.get("group")
        expected.append((list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                         "MAX" if op is MAX else "SUM", "other" if group is other else "world"))
    for size in (4, 6):  # the same tensor, resized in place between two calls at one line
        x.resize_(size)
        dist.all_reduce(x)
        expected.append(([size], "float32", "SUM", "world"))
    trace.uninstall()
    events = load_traces(tmp_path)[0].events
    world = events[0].pg_name  # the new group has the world's ranks: its name tells it apart
    got = [(e.shapes[0], e.dtypes[0], e.reduce_op, "world" if e.pg_name == world else "other") for e in events]
    assert got == expected


def test_records_are_on_disk_without_close_and_the_map_grows(fake_world, tmp_path, monkeypatch, hot_path):
    """A SIGKILLed rank never closes its trace: every record stored into the map is already in the file."""
    monkeypatch.setattr(trace_slots, "SEGMENT_SLOTS", 8)
    tracer = trace.install(tmp_path, 0)
    x = torch.ones(4)
    before = files.trace_progress(tmp_path, 0)
    for _ in range(20):  # 20 records after the header: the map grows twice
        dist.all_reduce(x)
    assert trace_slots.written(tmp_path / "trace-rank0.bin") == 20 and files.trace_progress(tmp_path, 0) > before
    data = (tmp_path / "trace-rank0.bin").read_bytes()  # while the map is open, as a supervisor reads it
    assert [(r.id, r.t_end is not None, r.issued) for r in trace_slots.iter_slots(data)] == [
        (i, True, False) for i in range(1, 21)]
    assert [e.seq for e in load_traces(tmp_path)[0].events] == list(range(1, 21))
    assert tracer.events.cap == 24 * trace_slots.SIZE


def test_progress_counts_starts_and_the_latest_completion(tmp_path):
    """A rank that finished a long collective and now computes has progressed: the watch loop must see it."""
    path = tmp_path / "trace-rank0.bin"
    start = trace_slots.START_SLOT.pack(trace_slots.start_word(1), 5.0)
    size = trace_slots.SIZE
    path.write_bytes(trace_slots.header(files.FORMAT) + start + bytes(size - len(start)) + bytes(size))
    begun = trace_slots.progress(path)
    with open(path, "r+b") as fh:
        fh.seek(trace_slots.SIZE + trace_slots.END_OFFSET)
        fh.write(trace_slots.END_TIME.pack(6.0))
    assert trace_slots.written(path) == 1 and trace_slots.progress(path) > begun
    assert trace_slots.progress(tmp_path / "none.bin") == -1


def test_a_killed_ranks_zero_tail_is_skipped_and_cut(tmp_path):
    path = tmp_path / "trace-rank0.bin"
    rec = trace_slots.SLOT.pack(trace_slots.START, 0, 1, 5.0, 0.0)
    path.write_bytes(trace_slots.header(files.FORMAT) + rec + b"\0" * trace_slots.SIZE * 100)
    assert trace_slots.written(path) == 1
    assert len(list(trace_slots.iter_slots(path.read_bytes()))) == 1
    files.tidy(tmp_path)
    assert path.stat().st_size == 2 * trace_slots.SIZE


def test_records_of_another_format_are_named(tmp_path):
    (tmp_path / "trace-rank0.jsonl").write_text(json.dumps({"ev": "meta", "format": files.FORMAT}) + "\n")
    (tmp_path / "trace-rank0.bin").write_bytes(trace_slots.header(files.FORMAT + 1))
    with pytest.raises(files.FormatError, match="trace records of rank 0 have distcheck file format"):
        load_traces(tmp_path)


class FakeCudaEvent:
    """Stands in for torch.cuda.Event: passes when the test says the GPU got there."""

    def __init__(self, done: list[bool]) -> None:
        self.done, self.index = done, len(done)
        done.append(False)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done[self.index]


def test_gpu_collectives_end_when_their_event_passes_not_on_return():
    ends: list[int] = []
    done: list[bool] = []
    completions = CudaCompletions(lambda eid, t: ends.append(eid), lambda: FakeCudaEvent(done))
    completions.POLL_S = 0.001
    completions.add(7)
    completions.add(8)
    assert completions.poll() == 2 and ends == []  # returned, still queued on the GPU
    done[1] = True
    assert completions.poll() == 2 and ends == []  # a later event cannot pass before an earlier one's op
    done[0] = True
    completions.drain(timeout=1.0)
    assert ends == [7, 8]


def test_drain_is_bounded_when_the_gpu_is_stuck():
    done: list[bool] = []
    completions = CudaCompletions(lambda eid, t: None, lambda: FakeCudaEvent(done))
    completions.add(1)
    completions.drain(timeout=0.05)  # returns: a hung GPU must not hang the rank's exit
    assert completions.poll() == 1


def _line(**kw) -> str:
    return json.dumps(kw)


def test_the_pending_collective_is_the_earliest_not_completed():
    """Async ops complete out of issue order as seen from the host: the stuck one is the first open one."""
    lines = [_line(ev="meta", format=files.FORMAT)]
    for i in (1, 2, 3):
        lines.append(_line(ev="start", id=i, seq=i, pg="0,1", op="all_reduce", site=f"t.py:{i}", file="/t.py",
                           line=i, t=float(i)))
    lines.append(_line(ev="end", id=1, t=1.5))
    lines.append(_line(ev="end", id=3, t=3.5))  # the second bucket's Work finished; the first's never did
    events = parse_lines(lines, 0).events
    progress = progress_from_events(0, events)
    assert progress.pending is not None and (progress.pending.seq, progress.pending.line) == (2, 2)
    assert progress.last_started.seq == 3 and progress.last_started.completed


def test_a_closed_trace_never_breaks_the_users_collective(fake_world, tmp_path):
    """The trace may close while a call runs (uninstall on another thread): the op's result still comes back."""
    tracer = trace.install(tmp_path, 0)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        tracer.events.close()
        return None

    traced = tracer.wrap(all_reduce, "all_reduce", funcol=False)
    assert traced(torch.ones(4)) is None
    assert traced(torch.ones(4)) is None  # and with the trace closed before the call


def test_torchs_own_collectives_inside_a_traced_call_are_not_traced(fake_world, tmp_path, line_of, hot_path):
    """all_gather_object runs all_gather inside torch: the trace names the op the user wrote, once, at the user's
    line; a functional collective (DTensor's kind) ends when issued, as flagged."""
    from torch.distributed import _functional_collectives as funcol

    trace.install(tmp_path, 0)
    dist.all_gather_object([None, None], {"step": 1})  # OBJECT
    funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()  # FUNCOL
    trace.uninstall()
    events = load_traces(tmp_path)[0].events
    assert [(e.op, e.site, e.issued_only) for e in events] == [
        ("all_gather_object", f"test_tracer.py:{line_of(__file__, '# OBJECT')}", False),
        ("all_reduce", f"test_tracer.py:{line_of(__file__, '# FUNCOL')}", True)]


def test_positions_count_per_group_and_per_point_to_point_direction():
    """Records carry no position: the reader counts it per group, and per (sender, receiver) for send/recv."""
    sigs = [{"ev": "sig", "sig": 1, "op": "all_reduce", "pg": "0,1", "pg_name": "0"},
            {"ev": "sig", "sig": 2, "op": "all_reduce", "pg": "0,1", "pg_name": "7"},
            {"ev": "sig", "sig": 3, "op": "send", "pg": "0,1", "pg_name": "0", "peer": 1},
            {"ev": "sig", "sig": 4, "op": "recv", "pg": "0,1", "pg_name": "0", "peer": 1}]
    order = [1, 2, 3, 1, 4, 3, 2, 1]
    binary = trace_slots.header(files.FORMAT) + b"".join(
        trace_slots.SLOT.pack(trace_slots.START, 0, sig, float(i), float(i) + 0.5) for i, sig in enumerate(order))
    events = parse_lines([json.dumps(s) for s in sigs], 0, binary).events
    assert [(e.op, e.pg_name, e.seq) for e in events] == [
        ("all_reduce", "0", 1), ("all_reduce", "7", 1), ("send", "0", 1), ("all_reduce", "0", 2),
        ("recv", "0", 1), ("send", "0", 2), ("all_reduce", "7", 2), ("all_reduce", "0", 3)]


def _begin(recorder, *args, **kwargs):
    """Calls the C path as the tracer's wrapper does: the call's site is this function's caller."""
    return recorder.begin(args, kwargs)


def _wrapper(recorder, *args):
    """Stands in for the tracer's wrapper on the stack: a call under it is one torch makes inside a traced call."""
    return _begin(recorder, *args)


def test_the_c_path_stores_records_where_the_readers_look():
    """_tracefast.c has its own copy of the record layout (tracer.py leaves a stale build out at import)."""
    import importlib

    built = importlib.util.find_spec("distcheck.rank._tracefast")
    if built is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    fast = importlib.import_module("distcheck.rank._tracefast")
    assert (fast.RECORD_SIZE, fast.START_TIME_OFFSET, fast.END_OFFSET) == (
        trace_slots.SIZE, trace_slots.START_TIME_OFFSET, trace_slots.END_OFFSET) == (
        trace_slots.SLOT.size, trace_slots.START_SLOT.size - 8, trace_slots.START_SLOT.size)


def test_a_stale_build_of_the_c_path_is_left_out():
    """A build from another record layout, or from before Recorder.call, is not used (the Python path runs)."""
    import types

    def build(call: bool, size: int = trace_slots.SIZE):
        recorder = type("Recorder", (), {"begin": None, **({"call": None} if call else {})})
        return types.SimpleNamespace(RECORD_SIZE=size, START_TIME_OFFSET=trace_slots.START_TIME_OFFSET,
                                     END_OFFSET=trace_slots.END_OFFSET, UNRECORDED_OFFSET=trace_slots.UNRECORDED_OFFSET,
                                     Recorder=recorder)

    assert trace._current_build(build(call=True))
    assert not trace._current_build(build(call=False))  # the two-call C path of before 2026-11-27
    assert not trace._current_build(build(call=True, size=trace_slots.SIZE + 8))
    if trace._tracefast is not None:
        assert trace._current_build(trace._tracefast)


def test_the_c_path_keys_a_call_as_the_python_path_does(fake_world, tmp_path):
    """The two paths share one cache: a key the C path builds must equal the Python path's for the same call, from
    the user's frame, found through torch's frames as tracer._user_frame finds it."""
    if trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    tracer = trace.install(tmp_path, 0)
    tracer._internal[__file__] = False  # this file is the user's code

    def recorder():
        return trace._tracefast.Recorder(tracer._fast, {}, _wrapper.__code__, trace._NESTED)

    Tensor, gpu = torch.Tensor, tracer._gpu_build
    calls = [((torch.ones(4),), {}),
             ((torch.ones(2, 3), 1), {"group": dist.group.WORLD, "async_op": True}),
             ((torch.empty(8), torch.ones(4, dtype=torch.float16)), {"op": dist.ReduceOp.MAX}),
             ((torch.ones(3),), {"tensor": torch.ones(5, dtype=torch.int64), "tag": "x"})]
    frame = sys._getframe()
    for args, kwargs in calls:
        key = _begin(recorder(), *args, **kwargs)  # a miss: the key comes back
        assert key[0] == id(frame.f_code) and key[1] > 0
        assert key[2:] == call_key(frame, args, kwargs, Tensor, gpu)[2:]
    # Called from torch's code (here: this file, as if it were torch's), the site is the first user frame out.
    user_code: dict = {}
    exec(compile("import sys\ndef user(call, *args):\n    return call(*args), sys._getframe().f_code\n",
                 "/user/train.py", "exec"), user_code)
    tracer._internal.update({__file__: True, "/user/train.py": False})
    args = (torch.ones(2),)
    key, code = user_code["user"](_begin, recorder(), *args)
    assert key[0] == id(code) and key[2:] == call_key(None, args, {}, Tensor, gpu)[2:]
    assert user_code["user"](_wrapper, recorder(), *args)[0] is trace._NESTED  # a traced call on the stack
    assert tracer._user_frame(sys._getframe()) is None  # pytest's frames count as internal too: no user frame
    assert _begin(recorder(), *args) == call_key(None, args, {}, Tensor, gpu)
    # Arguments keyed recursively (lists, tensor subclasses) and files not classified yet are the Python path's.
    tracer._internal[__file__] = False
    assert _begin(recorder(), [torch.ones(2)], torch.ones(2)) is None
    assert _begin(recorder(), torch.nn.Parameter(torch.ones(2))) is None
    del tracer._internal[__file__]
    assert _begin(recorder(), torch.ones(2)) is None


def test_the_c_path_walks_out_through_torchs_frames_to_the_users_instruction(fake_world, tmp_path):
    """The C path reads the interpreter's frames (no frame objects): out through three frames of a file classified
    as torch's, its key is the Python path's key for the user's frame, the instruction (f_lasti) included."""
    if trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    tracer = trace.install(tmp_path, 0)
    code: dict = {}
    exec(compile("import sys\n"
                 "def t0(begin, rec, x, py):\n    return begin(rec, x), py(sys._getframe(0))\n"
                 "def t1(begin, rec, x, py):\n    return t0(begin, rec, x, py)\n"
                 "def t2(begin, rec, x, py):\n    return t1(begin, rec, x, py)\n", "/torch/_chain.py", "exec"), code)
    exec(compile("def user(t2, begin, rec, x, py):\n    y = 1\n    return t2(begin, rec, x, py)\n",
                 "/user/train.py", "exec"), code)
    tracer._internal.update({"/torch/_chain.py": True, "/user/train.py": False, __file__: True})
    x = torch.ones(3)

    def python_path(inner):  # while the user's frame is still in its call
        user_frame = tracer._user_frame(inner)
        return user_frame.f_code, user_frame.f_lasti, call_key(user_frame, (x,), {}, torch.Tensor,
                                                                      tracer._gpu_build)

    for _ in range(3):
        recorder = trace._tracefast.Recorder(tracer._fast, {}, _wrapper.__code__, trace._NESTED)
        key, (user_code, lasti, python_key) = code["user"](code["t2"], _begin, recorder, x, python_path)
        assert user_code is code["user"].__code__ and lasti > 0
        assert key[:2] == (id(user_code), lasti)
        assert key == python_key


def test_the_c_path_reads_a_tensor_attribute_patched_on_torch_tensor(fake_world, tmp_path, monkeypatch):
    """The C path calls torch's getters (shape, dtype) straight, kept while torch.Tensor is unchanged: a patch of
    the class is seen at the next call, and its removal too."""
    if trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    tracer = trace.install(tmp_path, 0)
    tracer._internal[__file__] = False
    recorder = trace._tracefast.Recorder(tracer._fast, {}, _wrapper.__code__, trace._NESTED)
    x = torch.ones(4)
    keyed = call_key(None, (x,), {}, torch.Tensor, tracer._gpu_build)[2:]  # (shape, dtype[, is_cuda])
    assert keyed[:2] == (torch.Size([4]), torch.float32) and _begin(recorder, x)[2:] == keyed
    real = torch._C.TensorBase.__dict__["shape"]
    reads = []

    def shape(self):
        reads.append(1)
        return real.__get__(self)

    monkeypatch.setattr(torch.Tensor, "shape", property(shape), raising=False)
    assert _begin(recorder, x)[2:] == keyed and reads == [1]
    monkeypatch.undo()
    assert _begin(recorder, x)[2:] == keyed and reads == [1]


def test_a_collective_called_straight_from_c_is_traced_without_a_site(fake_world, tmp_path, hot_path):
    """A thread started from C calls the collective with no Python frame above it: traced, with no user line."""
    import _thread
    import threading

    trace.install(tmp_path, 0)
    done = threading.Event()
    _thread.start_new_thread(lambda *a: (dist.all_reduce(*a), done.set()), (torch.ones(2),))
    assert done.wait(10)
    _thread.start_new_thread(dist.all_reduce, (torch.ones(3),))  # nothing but C calls dist.all_reduce
    deadline = time.monotonic() + 10
    while len(load_traces(tmp_path)[0].events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    trace.uninstall()
    events = load_traces(tmp_path)[0].events
    assert [(e.op, e.shapes, e.site is None) for e in events] == [("all_reduce", [[2]], False),
                                                                  ("all_reduce", [[3]], True)]


def test_a_ctrl_c_while_the_tracer_reads_a_tensor_reaches_the_user(fake_world, tmp_path, hot_path):
    """Python code can run under the tracer (a __torch_function__ mode sees Tensor.shape): a KeyboardInterrupt
    raised there is the user's, and the tracer must not swallow it as one of its own errors."""
    from torch.overrides import TorchFunctionMode

    class InterruptOnce(TorchFunctionMode):
        fired = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not self.fired and getattr(func, "__self__", None) is torch.Tensor.shape:  # reading x.shape
                InterruptOnce.fired = True
                raise KeyboardInterrupt
            return func(*args, **(kwargs or {}))

    trace.install(tmp_path, 0)
    for interrupt in (False, True):  # the first call has the tracer know this file and cache the call
        with InterruptOnce() if interrupt else contextlib.nullcontext():
            try:
                dist.all_reduce(torch.ones(2))
            except KeyboardInterrupt:
                assert interrupt
            else:
                assert not interrupt, "the KeyboardInterrupt never reached the caller"
    assert InterruptOnce.fired


def test_a_reduce_op_instance_is_named_by_its_type_not_its_address():
    """NCCL's PREMUL_SUM is a ReduceOp instance (FSDP2's set_gradient_divide_factor): its text holds its address,
    which differs per rank and made every such reduce a false collective_mismatch."""
    from distcheck.rank.tracer import _reduce_op_name

    assert _reduce_op_name(dist._make_nccl_premul_sum(0.5)) == "PREMUL_SUM"
    assert _reduce_op_name(dist.ReduceOp.SUM) == "SUM" and _reduce_op_name(dist.ReduceOp.AVG) == "AVG"


def test_the_per_peer_sizes_of_an_exchange_are_described_as_torch_splits_them():
    import torch

    from distcheck.rank.tracer import SPLIT_PEERS, _peer_split

    T = torch.Tensor
    x, out = torch.zeros(8, 4), torch.zeros(7, 4)
    given = {"output": out, "input": x, "output_split_sizes": [3, 4], "input_split_sizes": [3, 5]}
    assert _peer_split("all_to_all_single", given, 2, T) == {"send": [[3, 4], [5, 4]], "recv": [[3, 4], [4, 4]],
                                                             "unit": "rows"}
    # No splits: dim 0 evenly over the group, as torch does; the functional form sizes its output from the input's.
    even = _peer_split("all_to_all_single", {"output": x, "input": x}, 2, T)
    assert even["send"] == even["recv"] == [[4, 4], [4, 4]]
    funcol = _peer_split("all_to_all_single", {"self": x, "output_split_sizes": None, "input_split_sizes": [2, 6]},
                         2, T)
    assert funcol["send"] == [[2, 4], [6, 4]] and funcol["recv"] == [[4, 4], [4, 4]]
    lists = _peer_split("all_to_all", {"output_tensor_list": [torch.zeros(2), torch.zeros(3)],
                                       "input_tensor_list": [torch.zeros(1), torch.zeros(5)]}, 2, T)
    assert lists == {"send": [[1], [5]], "recv": [[2], [3]]}
    assert _peer_split("all_gather", {"tensor_list": [torch.zeros(3), torch.zeros(2)], "tensor": torch.zeros(3)},
                       2, T) == {"send": [[3], [3]], "recv": [[3], [2]]}
    assert _peer_split("reduce_scatter", {"output": torch.zeros(2), "input_list": [torch.zeros(2)] * 2}, 2,
                       T) == {"send": [[2], [2]], "recv": [[2], [2]]}
    assert _peer_split("all_reduce", {"tensor": x}, 2, T) is None
    assert _peer_split("all_to_all_single", {"output": x, "input": x}, SPLIT_PEERS + 1, T) is None


def test_an_op_that_raises_and_an_async_op_on_both_paths(fake_world, tmp_path, hot_path, line_of):
    """The C path runs the op itself: an exception the op raises reaches the caller as itself, with the op's
    frames in its traceback, and the record ends with it; a Work the user's line gets back is handed to on_async
    with that line (the C path calls finish() from C, the Python path from Python)."""
    tracer = trace.install(tmp_path, 0)
    boom = RuntimeError("Connection closed by peer")

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.numel() == 3:
            raise boom
        return dist.all_reduce.__distcheck_original__(tensor, op, group, async_op)

    traced = tracer.wrap(all_reduce, "all_reduce", funcol=False)
    noted = []
    tracer.on_async = lambda works, op, args, kwargs, site: noted.append((op, str(site), len(works)))
    for _ in range(3):  # described once, then cached (in C on the C path)
        with pytest.raises(RuntimeError) as raised:
            traced(torch.ones(3))  # RAISES IN THE OP
        assert raised.value is boom and raised.traceback[-1].name == "all_reduce"
        traced(torch.ones(2), async_op=True).wait()  # A WORK BACK
    trace.uninstall()
    events = load_traces(tmp_path)[0].events
    line = line_of(__file__, "# RAISES IN THE OP")
    assert [(e.site, e.error) for e in events[::2]] == [
        (f"test_tracer.py:{line}", "RuntimeError: Connection closed by peer")] * 3
    assert noted == [("all_reduce", f"test_tracer.py:{line_of(__file__, '# A WORK BACK')}", 1)] * 3


@pytest.mark.parametrize("after", ["end", "event", "nothing"])
def test_what_the_wrapper_does_after_a_synchronous_op(fake_world, tmp_path, hot_path, after, monkeypatch):
    """After the op returns, a call's cached sig says what comes next, on both paths (the C path encodes it in the
    slot it returns): its end now (CPU), a CUDA event (GPU tensors), or nothing (NCCL's ring gives the end: no
    Python call at all, which cost the H200's NCCL path microseconds)."""
    mode = {"end": trace.AFTER_END, "event": trace.AFTER_EVENT, "nothing": trace.AFTER_NOTHING}[after]
    tracer = trace.install(tmp_path, 0)
    describe = tracer._new_sig
    monkeypatch.setattr(tracer, "_new_sig", lambda *a: (describe(*a)[0], mode))
    added: list[int] = []
    monkeypatch.setattr(tracer.completions, "add", added.append)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    traced = tracer.wrap(all_reduce, "all_reduce", funcol=False)
    for _ in range(4):  # the first call describes the op; the others hit the cache (in C on the C path)
        traced(torch.ones(4))
    trace.uninstall()
    events = load_traces(tmp_path)[0].events
    assert [e.op for e in events] == ["all_reduce"] * 4
    assert added == ([e.id for e in events] if after == "event" else [])
    ended = [e.t_end is not None and not e.extra.get("end_unknown") for e in events]
    assert ended == [after == "end"] * 4
