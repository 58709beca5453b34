"""Big-job traces: a summarized load (trace_events.TraceSummary) says exactly what a full one says, and the analysis
of a 1024-rank report directory writes files under a size bound."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distcheck.analysis.progress import progress_by_rank
from distcheck.analysis.rank_outcomes import STATE_ERROR, STATE_HUNG, STATE_OK, RankOutcome
from distcheck.analysis.stop_rule import provably_stuck
from distcheck.analysis.trace_align import analyze_run
from distcheck.analysis.trace_events import RankError, load_traces
from distcheck.contract import files, flight_dump_file
from distcheck.contract import trace_slots
from distcheck.contract.report import publish
from distcheck.contract.trace_lines import LineWriter
from distcheck.supervise import run_report


def call(op="all_reduce", pg=(0, 1, 2, 3), shapes=((8,),), line=10, reduce_op=None, peer=None, name=None):
    return {"op": op, "pg": ",".join(map(str, pg)), "pg_name": name, "shapes": [list(s) for s in shapes],
            "dtypes": ["float32"] * len(shapes), "reduce_op": reduce_op, "peer": peer, "root": None,
            "site": f"train.py:{line}", "file": "/w/train.py", "line": line}


def write_rank(report_dir: Path, rank: int, calls: list[dict], *, exit_ok: bool | None = True,
               open_from: int | None = None, errors: dict[int, str] | None = None) -> None:
    """One rank's trace as the tracer writes it: meta and sig lines (rank/tracer.py's writer), one record per call
    (contract/trace_slots.py's layout); calls from ``open_from`` on never ended; ``errors``: call index -> the
    error its JSON end line carries."""
    lines = LineWriter(files.rank_file(report_dir, "trace", rank))
    lines.write({"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "t": 1.0})
    sig_of: dict[int, int] = {}  # one sig per call dict, as the tracer's one per call site
    recs = np.zeros(len(calls), trace_slots.slot_dtype())
    for i, c in enumerate(calls):
        key = id(c)
        if key not in sig_of:
            sig_of[key] = len(sig_of) + 1
            lines.write({"ev": "sig", "sig": sig_of[key], **c})
        recs[i] = (trace_slots.START, 0, b"\0\0", sig_of[key], 10.0 + i, 0.0 if open_from is not None and i >= open_from
                   else 10.5 + i)
    for i, message in (errors or {}).items():
        lines.write({"ev": "end", "id": i + 1, "t": 10.7 + i, "error": message})
    if exit_ok is not None:
        lines.write({"ev": "exit", "ok": exit_ok, "code": 0 if exit_ok else 1})
    lines.close()
    with open(files.rank_file(report_dir, "trace_events", rank), "wb") as fh:
        fh.write(trace_slots.header(files.FORMAT))
        recs.tofile(fh)


def fsdp(n: int, pg: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    step = [call("all_gather_into_tensor", pg=pg, shapes=((64,), (16,)), line=40),
            call("reduce_scatter_tensor", pg=pg, shapes=((16,), (64,)), line=61, reduce_op="SUM"),
            call("all_reduce", pg=pg, line=18, reduce_op="SUM")]
    return (step * n)[:n]


def _scenario(name: str, d: Path) -> dict[int, RankOutcome]:
    ok = {r: RankOutcome(r, STATE_OK, 0) for r in range(4)}
    if name == "same":
        for r in range(4):
            write_rank(d, r, fsdp(40))
    elif name == "different":  # rank 2's all_gather #16 has another shape
        for r in range(4):
            calls = fsdp(40)
            if r == 2:
                calls[15] = call("all_gather_into_tensor", shapes=((64,), (17,)), line=40)
            write_rank(d, r, calls)
    elif name == "missing":  # rank 1 finished without the last 3
        for r in range(4):
            write_rank(d, r, fsdp(37 if r == 1 else 40))
    elif name == "hang":  # every rank waits in its last collective; rank 3 stopped one earlier
        for r in range(4):
            write_rank(d, r, fsdp(39 if r == 3 else 40), exit_ok=None, open_from=None if r == 3 else 39)
        return {r: RankOutcome(r, STATE_HUNG) for r in range(4)}
    elif name == "subgroups":  # the world, and pairs (0,1) and (2,3): rank 3 differs on its pair at #5
        for r in range(4):
            pair = (0, 1) if r < 2 else (2, 3)
            calls = []
            for i in range(30):
                calls.append(fsdp(1)[0])
                calls.append(call("all_reduce", pg=pair, line=70, reduce_op="SUM",
                                  shapes=((9,),) if (r == 3 and i == 4) else ((8,),)))
            write_rank(d, r, calls)
    elif name == "p2p":  # early on, rank 0 sends 4 to rank 1; rank 1's third receive has another shape
        for r in range(4):
            calls = fsdp(20)
            if r == 0:
                calls[5:5] = [call("send", peer=1, line=80)] * 4
            if r == 1:
                calls[5:5] = [call("recv", peer=0, line=81, shapes=((9,),) if i == 2 else ((8,),)) for i in range(4)]
            write_rank(d, r, calls)
    elif name == "failed":  # rank 0's all_reduce #7 failed; it raised; the others wait in their last
        for r in range(4):
            if r == 0:
                write_rank(d, r, fsdp(21), exit_ok=False, errors={20: "Connection closed by peer"})
            else:
                write_rank(d, r, fsdp(24), exit_ok=None, open_from=23)
        error = RankError(0, "RuntimeError", "Connection closed by peer", "tb", "train.py:18", "/w/train.py", 18,
                          50.0)
        return {0: RankOutcome(0, STATE_ERROR, 1, error=error), **{r: RankOutcome(r, STATE_HUNG) for r in (1, 2, 3)}}
    return ok


SCENARIOS = ("same", "different", "missing", "hang", "subgroups", "p2p", "failed")


@pytest.mark.parametrize("name", SCENARIOS)
def test_summarized_traces_say_what_full_traces_say(tmp_path, name):
    outcomes = _scenario(name, tmp_path)
    full = load_traces(tmp_path, summarize=False)
    summarized = load_traces(tmp_path, summarize=True)
    assert all(t.summary is None for t in full.values())
    assert all(t.summary is not None for t in summarized.values())
    # A summarized trace keeps only some events; the answers are the same.
    assert sum(len(t.events) for t in summarized.values()) < sum(len(t.events) for t in full.values())

    def said(traces):
        findings = analyze_run(traces, outcomes, 4, timeout=5.0)
        return [(f.kind, f.ranks, f.message, json.dumps(f.detail, sort_keys=True, default=str)) for f in findings]

    expected = said(full)
    assert said(summarized) == expected
    assert ({r: p.to_json() for r, p in progress_by_rank(summarized).items()}
            == {r: p.to_json() for r, p in progress_by_rank(full).items()})
    finished = {r for r, o in outcomes.items() if o.state == STATE_OK}
    assert provably_stuck(summarized, finished) == provably_stuck(full, finished)
    kinds = {"same": [], "different": ["collective_mismatch"], "missing": ["collective_mismatch"],
             "hang": ["hang"], "subgroups": ["collective_mismatch"], "p2p": ["collective_mismatch"],
             "failed": ["rank_failure", "hang"]}[name]
    assert [k for k, *_ in expected] == kinds
    if name == "different":
        assert expected[0][1] == [2] and "collective #16 on group [0,1,2,3] differs in shapes" in expected[0][2]
    if name == "subgroups":
        assert expected[0][1] == [2, 3] and "collective #5 on group [2,3]" in expected[0][2]
    if name == "p2p":
        assert expected[0][1] == [0, 1] and expected[0][2].startswith("send #3 from rank 0 to rank 1")


def test_a_divergence_far_from_the_kept_events_is_read_back_from_the_records(tmp_path):
    """The position the alignment needs (#1000 of 3000) is neither a rank's last nor an open one: it is read back
    from between two checkpoints of the record file, not from the whole file."""
    for r in range(2):
        calls = fsdp(3000, (0, 1))
        if r == 1:
            calls[3 * 333] = call("all_gather_into_tensor", pg=(0, 1), shapes=((64,), (15,)), line=40)
        write_rank(tmp_path, r, calls)
    traces = load_traces(tmp_path, summarize=True)
    (d,) = analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in range(2)}, 2)
    assert d.kind == "collective_mismatch" and "collective #1000 on group [0,1]" in d.message
    assert d.detail["issued"]["1"]["shapes"] == [[64], [15]] and d.detail["line"] == 40
    assert all(len(t.summary.read) <= 8 for t in traces.values())


def test_analysis_of_a_1024_rank_directory_writes_bounded_files(tmp_path):
    """1024 ranks x 200 collectives on the world group, where the last one differs on one rank: a group of 1024
    listed in every slice of trace.json and every rank's collective in report.json made hundreds of MB."""
    world, n = 1024, 200
    pg = tuple(range(world))
    calls = [call("all_gather_into_tensor", pg=pg, shapes=((64 * world,), (64,)), line=40, name="0")] * n
    odd = calls[:-1] + [call("all_gather_into_tensor", pg=pg, shapes=((64 * world,), (65,)), line=40, name="0")]
    for r in range(world):
        write_rank(tmp_path, r, odd if r == 7 else calls)
    traces = load_traces(tmp_path)  # 204,800 records: summarized by itself (trace_events.TOTAL_LIMIT)
    assert all(t.summary is not None for t in traces.values())
    exits = {r: type("Exit", (), {"killed": None, "returncode": 0, "signal": None})() for r in range(world)}
    outcomes, notes = run_report.outcomes_from_exits(exits, traces, tmp_path)
    report = run_report.build_report(tmp_path, "test", world, traces, outcomes, 60.0, 1.0, [], None, notes)
    run_report.write_trace_view(report, tmp_path, traces)
    publish(report, tmp_path)
    (f,) = [f for f in report.findings if f.kind == "collective_mismatch"]
    assert f.ranks == [7] and f"collective #{n} on group [0-{world - 1}] differs in shapes" in f.message
    sizes = {name: (tmp_path / name).stat().st_size for name in (files.CHROME_TRACE, files.REPORT_JSON)}
    assert sizes[files.CHROME_TRACE] < 1_000_000, sizes
    assert sizes[files.REPORT_JSON] < 1_000_000, sizes
    chrome = json.loads((tmp_path / files.CHROME_TRACE).read_text())
    assert "per-rank trace files" in chrome["otherData"]["partial"]


def _said(traces, outcomes):
    findings = analyze_run(traces, outcomes, 4, timeout=5.0)
    return ([(f.kind, f.ranks, f.message, json.dumps(f.detail, sort_keys=True, default=str)) for f in findings],
            {r: p.to_json() for r, p in progress_by_rank(traces).items()})


def test_a_later_load_reads_only_what_was_appended_and_says_what_a_full_load_says(tmp_path):
    """The watch loop's stop check loads the traces every few seconds: the second load of a directory goes on from
    the first (the same per-rank followers, their file offsets past what was read), takes the records appended
    since, the open record that completed since and an error line for a record read before."""
    from distcheck.analysis.trace_summary import TraceFollower, follower

    hung = {r: RankOutcome(r, STATE_HUNG) for r in range(4)}
    for r in range(4):  # every rank waits in its 30th collective
        write_rank(tmp_path, r, fsdp(30), exit_ok=None, open_from=29)
    first = load_traces(tmp_path, summarize=True)
    assert _said(first, hung) == _said(load_traces(tmp_path, summarize=False), hung)
    assert first[0].summary.open == 1
    followers = dict(follower(tmp_path).ranks)
    offsets = {r: (f.line_pos, f.next_slot) for r, f in followers.items()}

    outcomes = {r: RankOutcome(r, STATE_OK, 0) for r in range(4)}
    for r in range(4):  # the same files, grown: 60 collectives, rank 2's 45th differs, all finished
        calls = fsdp(60)
        if r == 2:
            calls[44] = call("all_gather_into_tensor", shapes=((64,), (17,)), line=40)
        write_rank(tmp_path, r, calls)
    later = load_traces(tmp_path, summarize=True)
    assert follower(tmp_path).ranks == followers  # went on, not over
    assert all(f.line_pos > offsets[r][0] and f.next_slot == 61 > offsets[r][1] for r, f in followers.items())
    full = load_traces(tmp_path, summarize=False)
    assert _said(later, outcomes) == _said(full, outcomes)
    assert _said(later, outcomes) == _said(TraceFollower(tmp_path).load(files.rank_files(tmp_path, "trace")),
                                           outcomes)
    assert later[0].summary.open == 0 and later[0].summary.completed == 60
    (f,) = analyze_run(later, outcomes, 4)
    assert f.ranks == [2] and "collective #45 on group [0,1,2,3] differs in op, shapes" in f.message

    with open(files.rank_file(tmp_path, "trace", 1), "a") as fh:  # an error for a record read already
        fh.write(json.dumps({"ev": "end", "id": 7, "t": 20.0, "error": "Connection reset by peer"}) + "\n")
    again = load_traces(tmp_path, summarize=True)
    assert again[1].summary.failed == 1 and again[1].summary.completed == 59
    assert _said(again, outcomes) == _said(load_traces(tmp_path, summarize=False), outcomes)

    for r in range(4):  # a new run in the same directory: new files
        for kind in ("trace", "trace_events"):
            files.rank_file(tmp_path, kind, r).unlink()
        write_rank(tmp_path, r, fsdp(10))
    fresh = load_traces(tmp_path, summarize=True)
    assert [t.summary.started for t in fresh.values()] == [10] * 4
    assert _said(fresh, outcomes) == _said(load_traces(tmp_path, summarize=False), outcomes)


# -- Flight Recorder dumps of ranks whose every collective was traced ----------------------------------------------
GROUP_NAMES = {"0,1,2,3": "0", "0,1": "1", "2,3": "2"}


def _name_groups(report_dir: Path) -> None:
    """Give each sig line its group's name, as the tracer writes it (the ring names groups by it)."""
    for r in range(4):
        path = files.rank_file(report_dir, "trace", r)
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in lines:
            if rec.get("ev") == "sig":
                rec["pg_name"] = GROUP_NAMES[rec["pg"]]
        path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))


def _write_dump(report_dir: Path, rank: int, untraced: tuple[str, float] | None = None) -> bool:
    """The rank's flight-rank<R>.json as rank/flight_recorder.dump writes it, for a gloo ring that recorded each of
    its traced calls (and ``untraced``: an op issued from C++ at a time); returns whether it was all traced."""
    from distcheck.analysis import flight_recorder as fr
    from distcheck.analysis.trace_events import load_rank_records
    from distcheck.rank import flight_recorder as rank_fr

    events = load_rank_records(files.rank_file(report_dir, "trace", rank), rank, merge=False).events
    issued = [(e.op, e.pg_name, e.t_start) for e in events] + ([(untraced[0], "0", untraced[1])] if untraced else [])
    gids = {name: i for i, name in enumerate(sorted(set(GROUP_NAMES.values())))}
    count: dict[str, int] = {}
    entries = []
    for rid, (op, group, t) in enumerate(sorted(issued, key=lambda c: c[2])):
        count[group] = count.get(group, 0) + 1
        entries.append({"ring": "c10d", "record_id": rid, "pg_id": gids[group], "process_group": [group, "pg"],
                        "collective_seq_id": count[group], "p2p_seq_id": 0, "is_p2p": False,
                        "profiling_name": f"gloo:{op}", "time_created_ns": int((t + 1e-4) * 1e9),
                        "time_discovered_completed_ns": 0, "state": "scheduled"})
    status = {f"c10d:{gids[g]}": {"last_enqueued_collective": str(n), "last_completed_collective": str(n)}
              for g, n in count.items()}
    snapshot = {"phases": [{"kind": "backward", "file": "/w/train.py", "line": 30, "t0": 5.0, "t1": 6.0}],
                "graphs": {}, "seen": ["backward"]}
    traced = fr.all_traced(entries, status, files.rank_file(report_dir, "trace", rank).read_text().splitlines(),
                           files.rank_file(report_dir, "trace_events", rank).read_bytes(), snapshot)
    flight_dump_file.write(report_dir, rank, rank_fr.document(rank, "exit", entries, status, {"0": [0, 1, 2, 3]},
                                                           snapshot, traced))
    return traced


@pytest.mark.parametrize("name", ["same", "different", "missing", "hang", "subgroups"])
def test_all_traced_flight_dumps_leave_a_big_job_summarized(tmp_path, monkeypatch, name):
    """Every real run's ranks dump their ring at exit. A dump whose ring held nothing untraced has no entries, so a
    big job's load stays summarized and says what the full load with the dumps merged says."""
    from distcheck.analysis import trace_events

    outcomes = _scenario(name, tmp_path)
    _name_groups(tmp_path)
    before = _said(load_traces(tmp_path, summarize=False), outcomes)  # no dumps yet
    assert all(_write_dump(tmp_path, r) for r in range(4))
    assert all(len(files.rank_file(tmp_path, "flight", r).read_text()) < 600 for r in range(4))
    monkeypatch.setattr(trace_events, "FULL_LIMIT", 10)  # these 4 x 40 records are a "big job"
    traces = load_traces(tmp_path)
    assert all(t.summary is not None and t.flight_dumped for t in traces.values())
    full = load_traces(tmp_path, summarize=False)
    assert all(t.summary is None and t.flight_dumped for t in full.values())
    assert _said(traces, outcomes) == _said(full, outcomes) == before


def test_a_dump_with_untraced_entries_still_takes_the_full_load(tmp_path, monkeypatch):
    """Rank 2's ring has an all-reduce Python never called (a DDP bucket, issued from C++) after its last traced
    call: its dump keeps the entries, the load merges them (not summarized) and the extra collective is found."""
    from distcheck.analysis import trace_events

    _scenario("same", tmp_path)
    _name_groups(tmp_path)
    assert [_write_dump(tmp_path, r, ("all_reduce", 60.0) if r == 2 else None) for r in range(4)] == [
        True, True, False, True]
    monkeypatch.setattr(trace_events, "FULL_LIMIT", 10)
    traces = load_traces(tmp_path)
    assert all(t.summary is None for t in traces.values())
    (extra,) = [e for e in traces[2].events if e.extra.get("untraced")]
    assert (extra.op, extra.seq, extra.extra["origin"]) == ("all_reduce", 41, "torch")
    (f,) = analyze_run(traces, {r: RankOutcome(r, STATE_OK, 0) for r in range(4)}, 4)
    assert f.kind == "collective_mismatch" and f.ranks == [2], f.message


# -- NCCL: the ends the ring knows, stored into the trace at the dump ------------------------------------------------
def _to_nccl(report_dir: Path) -> dict[int, list[float]]:
    """Make each rank's trace what the tracer writes on NCCL: sigs whose end the ring holds, records left open.
    Returns each rank's ends as they were (0: not completed), for the ring to know."""
    _name_groups(report_dir)
    ends = {}
    for r in range(4):
        path = files.rank_file(report_dir, "trace", r)
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**rec, "completion": "flight_recorder"} if rec.get("ev") == "sig"
                                           else rec) + "\n" for rec in lines))
        bin_path = files.rank_file(report_dir, "trace_events", r)
        data = bytearray(bin_path.read_bytes())
        recs = np.frombuffer(data, trace_slots.slot_dtype(), offset=trace_slots.SIZE)
        ends[r] = recs["t_end"].tolist()
        recs["t_end"] = 0.0
        bin_path.write_bytes(bytes(data))
    return ends


def _write_nccl_dump(report_dir: Path, rank: int, ends: list[float], full: bool = False) -> bool:
    """The rank's flight-rank<R>.json for an NCCL ring that completed each traced call at its old end (``ends``,
    0: still on the GPU); with ``full``, as every NCCL dump was before the ends were stored (its entries kept),
    else as rank/flight_recorder.py writes it now (the ends stored into the trace first). Whether all traced."""
    from distcheck.analysis.trace_events import load_rank_records
    from distcheck.rank import flight_recorder as rank_fr

    events = load_rank_records(files.rank_file(report_dir, "trace", rank), rank, merge=False).events
    gids = {name: i for i, name in enumerate(sorted(set(GROUP_NAMES.values())))}
    names = {"all_gather_into_tensor": "_allgather_base", "reduce_scatter_tensor": "_reduce_scatter_base"}
    count: dict[str, int] = {}
    completed: dict[str, int] = {}
    entries = []
    for rid, (e, end) in enumerate(zip(events, ends)):
        count[e.pg_name] = count.get(e.pg_name, 0) + 1
        if end:
            completed[e.pg_name] = count[e.pg_name]
        entries.append({"ring": "nccl", "record_id": rid, "pg_id": gids[e.pg_name], "process_group": [e.pg_name, "pg"],
                        "collective_seq_id": count[e.pg_name], "p2p_seq_id": 0, "is_p2p": False,
                        "profiling_name": f"nccl:{names.get(e.op, e.op)}", "time_created_ns": int((e.t_start + 1e-4) * 1e9),
                        "time_discovered_completed_ns": int(end * 1e9), "state": "completed" if end else "started"})
    status = {f"nccl:{gids[g]}": {"last_enqueued_collective": str(n),
                                  "last_completed_collective": str(completed.get(g, -1))} for g, n in count.items()}
    snapshot = {"phases": [], "graphs": {}, "seen": []}
    traced = not full and rank_fr._all_traced(report_dir, rank, entries, status, snapshot)
    flight_dump_file.write(report_dir, rank, rank_fr.document(rank, "exit", entries, status, {"0": [0, 1, 2, 3]},
                                                           snapshot, traced))
    return traced


def _nccl_job(tmp_path: Path, name: str):
    """A scenario's job on NCCL: what the full load of its full dumps says, then its all-traced dumps written."""
    outcomes = _scenario(name, tmp_path)
    ends = _to_nccl(tmp_path)
    for r in range(4):
        assert not _write_nccl_dump(tmp_path, r, ends[r], full=True)
    expected = _said(load_traces(tmp_path, summarize=False), outcomes)
    assert all(_write_nccl_dump(tmp_path, r, ends[r]) for r in range(4))
    assert all(len(files.rank_file(tmp_path, "flight", r).read_text()) < 600 for r in range(4))
    return outcomes, ends, expected


@pytest.mark.parametrize("name", ["same", "hang", "subgroups"])
def test_nccl_dumps_store_the_rings_ends_and_say_what_the_full_dumps_said(tmp_path, name):
    """On NCCL the tracer leaves synchronous collectives open for the ring's completion times; the rank's dump stores
    them into its trace and writes no entries, and the load then says what the full dumps merged said (a rank
    waiting in its last collective: still open, the same hang)."""
    outcomes, ends, expected = _nccl_job(tmp_path, name)
    for r in range(4):
        binary = files.rank_file(tmp_path, "trace_events", r).read_bytes()
        stored = [rec.t_end for rec in trace_slots.iter_slots(binary)]
        assert [t is not None for t in stored] == [bool(e) for e in ends[r]]
    assert _said(load_traces(tmp_path, summarize=False), outcomes) == expected


@pytest.mark.parametrize("name", ["same", "hang"])
def test_nccl_all_traced_dumps_leave_a_big_job_summarized(tmp_path, monkeypatch, name):
    from distcheck.analysis import trace_events

    outcomes, _, expected = _nccl_job(tmp_path, name)
    monkeypatch.setattr(trace_events, "FULL_LIMIT", 10)  # these 4 x 40 records are a "big job"
    traces = load_traces(tmp_path)
    assert all(t.summary is not None and t.flight_dumped for t in traces.values())
    assert _said(traces, outcomes) == expected


def test_an_open_record_that_becomes_its_groups_first_open_is_read_back(tmp_path):
    """Two collectives of a group in flight and more after them: the second is neither kept nor in the tail. Once the
    first ends, the second is what the rank waits on: a later load reads its record back, as a full load has it."""
    from distcheck.analysis.progress import progress_by_rank

    write_rank(tmp_path, 0, fsdp(10), exit_ok=None, open_from=3)  # calls 3..9 in flight
    first = load_traces(tmp_path, summarize=True)
    assert progress_by_rank(first)[0].first_open.seq == progress_by_rank(load_traces(tmp_path))[0].first_open.seq
    with open(files.rank_file(tmp_path, "trace_events", 0), "r+b") as fh:  # call 3 (slot 4) ends
        fh.seek(4 * trace_slots.SIZE + trace_slots.END_OFFSET)
        fh.write(trace_slots.END_TIME.pack(20.0))
    later, full = progress_by_rank(load_traces(tmp_path, summarize=True))[0], \
        progress_by_rank(load_traces(tmp_path, summarize=False))[0]
    assert later.first_open is not None and later.first_open.seq == full.first_open.seq
    assert later.first_open.op == full.first_open.op == "reduce_scatter_tensor"  # call 4
