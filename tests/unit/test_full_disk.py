"""A full or failing report file system (no process launched): the tracer allocates its map's blocks before storing
into them and stops recording cleanly when it cannot, every other per-rank writer drops what does not fit without
raising into the script, the readers take a cut trace for the prefix it is, the report says from which collective on
each trace is incomplete, and a report that cannot be written is never named. Also: a rank that ended without its
exit record (os._exit, a signal) is a failure, never "finished its script".

    .venv/bin/python -m pytest -q tests/unit/test_full_disk.py
"""
from __future__ import annotations

import errno
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distcheck.analysis.rank_outcomes import STATE_DIED, STATE_OK, RankOutcome
from distcheck.analysis.stop_rule import provably_stuck
from distcheck.analysis.trace_align import analyze_run
from distcheck.analysis.trace_events import load_traces, parse_lines
from distcheck.contract import files
from distcheck.contract import trace_slots
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, render_text, publish
from distcheck.rank import records as rank_records
from distcheck.rank import sink
from distcheck.rank import trace_log
from distcheck.rank import tracer as trace
from distcheck.supervise import run_report


@pytest.fixture(autouse=True)
def _no_tracer_left():
    yield
    trace.uninstall()
    rank_records.reset()


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Both ways a call is traced (see test_tracer.py)."""
    if request.param == "python":
        monkeypatch.setattr(trace, "_tracefast", None)
    elif trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    return request.param


def disk_of(monkeypatch, capacity: int) -> list[tuple[int, int]]:
    """The trace's file system holds ``capacity`` bytes of records: allocations beyond fail with ENOSPC, as a full
    tmpfs's do. Returns the (offset, length) of every allocation that succeeded."""
    granted: list[tuple[int, int]] = []

    def fallocate(fd, offset, length):
        if offset + length > capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)
        granted.append((offset, length))

    real = os.posix_fallocate

    monkeypatch.setattr(trace_log, "_fallocate", fallocate)
    return granted


def test_the_map_never_covers_unallocated_blocks_and_stops_cleanly_when_the_disk_is_full(
        fake_world, tmp_path, monkeypatch, hot_path, caplog):
    """A full disk used to be a SIGBUS in the hot path's store (the map covered a sparse file). Now each segment is
    allocated before the map covers it; when no more can be had, the script's collectives go on untraced, the
    header says from which one on and why, and counts them (the watch loop's progress)."""
    monkeypatch.setattr(trace_slots, "SEGMENT_SLOTS", 400)
    monkeypatch.setattr(trace_slots, "MIN_SEGMENT_SLOTS", 100)
    granted = disk_of(monkeypatch, 650 * trace_slots.SIZE)  # room for 650 slots: 400, then 200 (halved), then 50 short
    tracer = trace.install(tmp_path, 0)
    x = torch.ones(4)
    for _ in range(900):
        assert dist.all_reduce(x) is None  # the op's own result, traced or not
    path = tmp_path / "trace-rank0.bin"
    assert granted == [(0, 400 * trace_slots.SIZE), (400 * trace_slots.SIZE, 200 * trace_slots.SIZE)]
    assert tracer.events.cap == 600 * trace_slots.SIZE == len(tracer.events.mm)  # the map: exactly what was allocated
    assert trace_slots.written(path) == 599  # slots 1..599 (slot 0 is the header)
    state = trace_slots.read_state(path.read_bytes())
    assert (state.cut, state.errno, state.unrecorded) == (600, errno.ENOSPC, 900 - 599)
    warnings = [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
    assert warnings == ["the report directory's file system was full (No space left on device): collectives "
                        "from #600 on are not recorded; the script goes on untraced"]  # once
    before = files.trace_progress(tmp_path, 0)
    dist.all_reduce(x)
    assert files.trace_progress(tmp_path, 0) > before  # a stopped trace still shows progress
    trace.uninstall()
    rank = load_traces(tmp_path)[0]
    assert [e.seq for e in rank.events] == list(range(1, 600))  # a clean prefix
    assert rank.incomplete.from_id == 600 and rank.incomplete.unrecorded == 302


def test_a_disk_full_from_the_start_records_nothing_and_breaks_nothing(fake_world, tmp_path, monkeypatch,
                                                                       hot_path):
    disk_of(monkeypatch, 0)
    trace.install(tmp_path, 0)
    x = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(x)
    trace.uninstall()
    assert (tmp_path / "trace-rank0.bin").stat().st_size == 0
    rank = load_traces(tmp_path)[0]
    assert rank.events == [] and rank.incomplete.from_id == 1 and not rank.exit_recordable


def test_the_trace_leaves_a_tenth_of_a_small_file_system_to_the_report(fake_world, tmp_path, monkeypatch):
    """The trace takes at most half of what is free above the reserve at a time, and nothing of the reserve."""
    free = {"bytes": 100 * 4096}

    def fstatvfs(fd):
        return SimpleNamespace(f_bavail=free["bytes"] // 4096, f_frsize=4096, f_blocks=128)

    monkeypatch.setattr(os, "fstatvfs", fstatvfs)
    granted: list[int] = []
    real = os.posix_fallocate
    monkeypatch.setattr(trace_log, "_fallocate", lambda fd, offset, length: (granted.append(length),
                                                                         real(fd, offset, length)))
    tracer = trace.install(tmp_path, 0)
    room = 100 * 4096 - int(128 * 4096 * trace_log.RESERVE_FRACTION)
    assert granted == [room // 2 // trace_slots.SIZE * trace_slots.SIZE]
    free["bytes"] = int(128 * 4096 * trace_log.RESERVE_FRACTION) + 4000  # less than a page above the reserve
    for _ in range(tracer.events.cap // trace_slots.SIZE + 5):
        dist.all_reduce(torch.ones(1))
    assert tracer.events.stopped and len(granted) == 1


def test_lost_trace_lines_are_cut_whole_and_the_exit_survives_in_the_header(fake_world, tmp_path, monkeypatch):
    """A sig line the disk refused: the reader stops before the first record naming it (its position and every later
    one could no longer be counted). An exit line it refused: the header still says how the script ended."""
    tracer = trace.install(tmp_path, 0)
    dist.all_reduce(torch.ones(4))
    real_write = os.write
    jsonl = tracer.writer.fd
    half = {"done": False}

    def write(fd, data):
        if fd != jsonl:
            return real_write(fd, data)
        if not half["done"]:  # the disk fills in the middle of the line
            half["done"] = True
            return real_write(fd, data[:7])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    dist.all_reduce(torch.ones(8))  # a new call: its sig line is lost
    dist.all_reduce(torch.ones(4))
    tracer.note({"ev": "exit", "ok": True, "code": 0})
    monkeypatch.setattr(os, "write", real_write)
    trace.uninstall()
    lines = (tmp_path / "trace-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["ev"] for line in lines] == ["meta", "sig"]  # the half line was taken back
    rank = load_traces(tmp_path)[0]
    assert [e.seq for e in rank.events] == [1] and rank.incomplete.from_id == 2
    assert trace_slots.LOST_NAMES[trace_slots.LOST_LINES] in rank.incomplete.lost
    assert rank.finished == {"ev": "exit", "ok": True, "code": 0, "from": "records"}
    assert run_report.outcome_from_trace(0, rank).state == STATE_OK


def test_records_findings_and_autocheck_state_never_raise_into_the_script(fake_world, tmp_path, monkeypatch):
    from distcheck.rank import autocheck

    tracer = trace.install(tmp_path, 0)
    monkeypatch.setenv(rank_records.ENV_REPORT_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    rank_records.reset()
    rank_records.record("loss", torch.ones(3))
    real_write = os.write

    def full(fd, data):
        if fd in (tracer.writer.fd,):
            return real_write(fd, data)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    rank_records.record("loss", torch.ones(3))  # no exception: recording stops here
    monkeypatch.setattr(os, "write", real_write)
    rank_records.record("loss", torch.ones(3))  # and stays stopped: the records stay a prefix
    sink.append(tmp_path, 0, [Finding("tensor_divergence", [0], "x")])  # fits
    monkeypatch.setattr(os, "write", full)
    sink.append(tmp_path, 0, [Finding("tensor_divergence", [0], "y")])  # dropped whole
    monkeypatch.setattr(os, "write", real_write)
    check = autocheck.AutoCheck(tmp_path, 0, emit=False)
    monkeypatch.setattr("distcheck.contract.report.atomic_write",
                        lambda path, text: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    check.write_state()
    index = (tmp_path / "records-rank0.jsonl").read_text().splitlines()
    assert len(index) == 1 and (tmp_path / "records-rank0.bin").stat().st_size == 12
    assert [json.loads(line)["message"] for line in (tmp_path / "findings-rank0.jsonl").read_text().splitlines()] \
        == ["x"]
    trace.uninstall()
    gap = load_traces(tmp_path)[0].incomplete
    assert gap.from_id is None and gap.errno == errno.ENOSPC
    assert gap.lost == ["records (distcheck.record)", "findings of API calls", "automatic-check state"]
    (note,) = run_report.incomplete_notes(load_traces(tmp_path))
    assert note.kind == "files_incomplete" and note.message == (
        "rank 0 could not write everything into the report directory (the report directory's file system was "
        "full); lost: records (distcheck.record), findings of API calls, automatic-check state")


def _rank_trace(rank: int, n: int, cut: int | None = None, exit_ok: bool | None = True) -> tuple[list[str], bytes]:
    """Lines and record bytes of a rank that issued ``n`` all_reduces (recording cut at slot ``cut``)."""
    sig = {"ev": "sig", "sig": 1, "op": "all_reduce", "pg": [0, 1], "pg_name": "0", "shapes": [[4]],
           "dtypes": ["float32"], "site": "train.py:9", "file": "/w/train.py", "line": 9}
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": rank, "t": 1.0}), json.dumps(sig)]
    if exit_ok is not None:
        lines.append(json.dumps({"ev": "exit", "ok": exit_ok, "code": 0 if exit_ok else 1}))
    kept = n if cut is None else cut - 1
    head = bytearray(trace_slots.header(files.FORMAT))
    if cut is not None:
        trace_slots.CUT.pack_into(head, trace_slots.CUT_OFFSET, cut)
        trace_slots.UNRECORDED.pack_into(head, trace_slots.UNRECORDED_OFFSET, n - kept)
        head[trace_slots.ERRNO_OFFSET] = errno.ENOSPC
    body = b"".join(trace_slots.SLOT.pack(trace_slots.START, 0, 1, 10.0 + i, 10.5 + i) for i in range(kept))
    return lines, bytes(head) + body


def test_a_cut_trace_is_compared_as_far_as_it_goes_and_warned_about():
    """Rank 1's trace stops at its collective #40 while rank 0 recorded all 100: no count mismatch (what rank 1
    issued after #39 is unknown), nor a stuck rank; the report warns, naming the collective."""
    lines0, bin0 = _rank_trace(0, 100)
    lines1, bin1 = _rank_trace(1, 100, cut=40)
    traces = {0: parse_lines(lines0, 0, bin0), 1: parse_lines(lines1, 1, bin1)}
    outcomes = {r: run_report.outcome_from_trace(r, t) for r, t in traces.items()}
    assert analyze_run(traces, outcomes, 2) == []
    running = {0: parse_lines(lines0[:2], 0, bin0[:-8] + bytes(8)), 1: traces[1]}  # rank 0 still in its #100
    assert provably_stuck(running, {1}) is None
    (note,) = run_report.incomplete_notes(traces)
    assert note.kind == "trace_incomplete" and note.ranks == [1]
    assert note.message == ("trace of rank 1 is incomplete from collective #40 on: the report directory's file "
                            "system was full (61 later collectives not recorded); collectives from there on were "
                            "not compared")
    assert note.detail["last_recorded"]["seq"] == 39
    # Where a message places a rank from its cut trace, it says the position may be stale.
    outcomes[0] = RankOutcome(0, STATE_DIED, -9, "SIGKILL")
    (f,) = analyze_run(traces, outcomes, 2)
    assert f.ranks == [0] and f.message.endswith(
        "rank 1 finished its script (its trace stops before its collective #40: the report directory's file system "
        "was full)")


def test_the_c_path_counts_where_the_readers_look():
    """_tracefast.c bumps the header's count of unrecorded collectives itself (tracer.py leaves a stale build out)."""
    if trace._tracefast is None:
        pytest.skip("the C path was not built here (pip install -e . with a C compiler builds it)")
    assert trace._tracefast.UNRECORDED_OFFSET == trace_slots.UNRECORDED_OFFSET
    assert trace_slots.STATE.size + trace_slots.STATE_OFFSET == trace_slots.HEADER.size == trace_slots.SIZE


def test_a_rank_without_its_exit_record_ended_without_finishing_its_script():
    """os._exit(0) on rank 1 after 4 of 5 all_reduces: exit code 0, no exit line. It is a rank_failure naming rank 1,
    never "finished its script"; rank 0's lost peer is the consequence. Where the header holds the exit (its line
    was lost to a full disk) the rank finished; where not even the header could be written, nothing is claimed."""
    lines0, bin0 = _rank_trace(0, 5, exit_ok=False)
    lines1, bin1 = _rank_trace(1, 4, exit_ok=None)
    trace0 = parse_lines(lines0 + [json.dumps({"ev": "error", "exc_type": "RuntimeError", "message": "Connection "
                                               "closed by peer [127.0.0.1]:1", "traceback": "", "site": "train.py:9",
                                               "file": "/w/train.py", "line": 9, "t": 20.0}),
                                   json.dumps({"ev": "end", "id": 5, "t": 20.0, "error": "RuntimeError: Connection "
                                               "closed by peer [127.0.0.1]:1"})], 0, bin0)
    traces = {0: trace0, 1: parse_lines(lines1, 1, bin1)}
    exits = {0: SimpleNamespace(returncode=1, signal=None, killed=None),
             1: SimpleNamespace(returncode=0, signal=None, killed=None)}
    outcomes, notes = run_report.outcomes_from_exits(exits, traces)
    assert outcomes[1].state == STATE_DIED and outcomes[1].exit_code == 0 and not notes
    findings = analyze_run(traces, outcomes, 2)
    (f,) = findings
    assert f.kind == "rank_failure" and f.ranks == [1] and "0" in json.dumps(f.detail["consequences"])
    assert f.message.startswith("rank 1 ended without finishing its script: os._exit or a signal (exit code 0) "
                                "after all_reduce #4 at train.py:9; rank 0 failed in all_reduce #5")
    assert "finished its script" not in f.message.replace("without finishing its script", "")
    # The exit line lost, the header's exit kept: finished.
    head = bytearray(bin1)
    trace_slots.EXIT.pack_into(head, trace_slots.EXIT_OFFSET, trace_slots.EXIT_RETURNED, 0)
    kept = parse_lines(lines1, 1, bytes(head))
    assert run_report.outcomes_from_exits({1: exits[1]}, {1: kept})[0][1].state == STATE_OK
    # No header at all (the disk was full from the start): unknown, so the exit code decides.
    blind = parse_lines(lines1, 1, b"")
    assert run_report.outcomes_from_exits({1: exits[1]}, {1: blind})[0][1].state == STATE_OK


def test_a_report_that_cannot_be_written_is_never_named(tmp_path, monkeypatch, capsys):
    """report.txt written, report.json refused (the disk filled between them): neither is left, the text printed
    afterwards names no report file, and stderr has one line of reason, then the JSON."""
    from distcheck.contract import report as report_module

    real = report_module.atomic_write

    def atomic_write(path, text):
        if path.name == "report.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(report_module, "atomic_write", atomic_write)
    report = Report("distcheck run", 2, [], [CheckResult("collective_order", True, 0.1)])
    assert publish(report, tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    text = render_text(report, tmp_path)
    assert "report.json" not in text.replace("report.json went to stderr", "")
    assert text.endswith("report: not written (No space left on device); report.json went to stderr\n")
    err = capsys.readouterr().err
    reason, _, document = err.partition("\n")
    assert reason == (f"distcheck: error: could not write the report into {tmp_path} (No space left on device); "
                      "report.json follows on stderr")
    data = json.loads(document)
    assert data["ok"] and "report.txt" not in data["artifacts"]
    monkeypatch.setattr(report_module, "atomic_write", real)
    assert publish(report, tmp_path) == tmp_path / "report.json"  # written after all: named again
    assert render_text(report, tmp_path).endswith(f"report: {tmp_path / 'report.json'}\n")
