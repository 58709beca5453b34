"""Per-rank file names and their format version (contract/files.py), checked by every reader."""
from __future__ import annotations

import json

import pytest

from distcheck.analysis.record_values import load_run
from distcheck.analysis.trace_events import load_traces
from distcheck.contract import files
from distcheck.contract import autocheck_file, findings_file
from distcheck.rank import sink


def test_names_round_trip():
    assert files.rank_file("d", "trace", 3).name == "trace-rank3.jsonl"
    assert files.rank_of("d/records-rank12.jsonl", "records_index") == 12
    with pytest.raises(ValueError):
        files.rank_of("d/trace-rank1.jsonl.bak", "trace")


def test_rank_files_ignores_other_names(tmp_path):
    for name in ("trace-rank0.jsonl", "trace-rank10.jsonl", "trace-rank1.jsonl.tmp", "trace-rankX.jsonl"):
        (tmp_path / name).write_text("")
    assert list(files.rank_files(tmp_path, "trace")) == [0, 10]


def _write_all(tmp_path, fmt):
    meta = {"ev": "meta", "rank": 0, "pid": 1}
    if fmt is not None:
        meta["format"] = fmt
    files.rank_file(tmp_path, "trace", 0).write_text(json.dumps(meta) + "\n")
    finding = {"kind": "hang", "ranks": [0], "message": "m", "detail": {}}
    index = {"name": "loss", "step": 0, "rank": 0, "kind": "number", "value": 1.0}
    state = {"rank": 0, "model_checks": []}
    for data in (finding, index, state):
        if fmt is not None:
            data["format"] = fmt
    files.rank_file(tmp_path, "findings", 0).write_text(json.dumps(finding) + "\n")
    files.rank_file(tmp_path, "records_index", 0).write_text(json.dumps(index) + "\n")
    files.rank_file(tmp_path, "autocheck", 0).write_text(json.dumps(state))


@pytest.mark.parametrize("reader", [load_traces, findings_file.collect, load_run, autocheck_file.read_all])
def test_readers_accept_this_format(tmp_path, reader):
    _write_all(tmp_path, files.FORMAT)
    assert reader(tmp_path)


@pytest.mark.parametrize("reader", [load_traces, findings_file.collect, load_run, autocheck_file.read_all])
def test_readers_name_unversioned_files_as_format_1(tmp_path, reader):
    _write_all(tmp_path, None)  # written before files carried a version; format 2 moved trace events to .bin
    with pytest.raises(files.FormatError, match=f"format 1.*reads format {files.FORMAT}"):
        reader(tmp_path)


@pytest.mark.parametrize("reader", [load_traces, findings_file.collect, load_run, autocheck_file.read_all])
def test_readers_name_a_file_from_another_format(tmp_path, reader):
    _write_all(tmp_path, files.FORMAT + 1)
    with pytest.raises(files.FormatError, match=f"format {files.FORMAT + 1}.*reads format {files.FORMAT}"):
        reader(tmp_path)


def test_writers_stamp_the_format(tmp_path, monkeypatch):
    from distcheck.contract.findings import Finding

    monkeypatch.setenv(sink.ENV_REPORT_DIR, str(tmp_path))
    sink.emit([Finding("hang", [0], "m")], rank=0)
    line = json.loads(files.rank_file(tmp_path, "findings", 0).read_text())
    assert line["format"] == files.FORMAT


def test_trace_progress_with_a_hint_reads_only_past_the_last_poll(tmp_path, monkeypatch):
    """The watch loop polls every rank ten times a second: with its memo (the hint), a poll of a grown-by-segments
    record file reads a couple of bytes when nothing was appended, not a bisection of the whole segment; and it
    counts what a poll without the memo counts, also after the file was rewritten shorter."""
    import os

    from distcheck.contract import trace_slots

    path = files.rank_file(tmp_path, "trace_events", 0)
    (tmp_path / "trace-rank0.jsonl").write_text("{}\n")

    def write(used: int, ended_last: bool = True) -> None:
        data = bytearray(trace_slots.header(files.FORMAT)) + bytearray(trace_slots.SIZE * trace_slots.SEGMENT_SLOTS)
        for slot in range(1, used + 1):
            t_end = 0.0 if slot == used and not ended_last else 2.0
            trace_slots.SLOT.pack_into(data, slot * trace_slots.SIZE, trace_slots.START, 0, 1, 1.0, t_end)
        path.write_bytes(bytes(data))

    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(off) or real_pread(fd, n, off))
    hint: dict[str, int] = {}
    write(1000)
    first = files.trace_progress(tmp_path, 0, hint)
    assert hint == {"used": 1000} and first == files.trace_progress(tmp_path, 0)
    reads.clear()
    assert files.trace_progress(tmp_path, 0, hint) == first
    assert len(reads) <= 4, reads  # the header, the last used slot, the next one, the last end
    reads.clear()
    files.trace_progress(tmp_path, 0)
    assert len(reads) >= 15  # without the memo: a bisection of the 131,072-slot segment
    write(1300, ended_last=False)  # 300 appended, the last one still open
    assert files.trace_progress(tmp_path, 0, hint) == files.trace_progress(tmp_path, 0) and hint["used"] == 1300
    write(40)  # a new run rewrote the file: the memo is not taken
    assert files.trace_progress(tmp_path, 0, hint) == files.trace_progress(tmp_path, 0) and hint["used"] == 40


@pytest.mark.parametrize("written, expect", [
    ([], 0),  # nothing recorded: the header alone stays
    (list(range(1, 1001)), 1000),
    # a thread claimed slot 1000 and was killed before writing it; slots after it were written
    ([*range(1, 1000), 1001, 1002], 1002),
    # the same with the gap where the bisection probes first (the middle of the segment), and a later slot
    # written only in its last bytes (its time, not yet its kind)
    ([*range(1, 65536), *range(65537, 65600), ("end only", 65601)], 65601),
])
def test_truncate_unused_keeps_every_written_slot_and_reads_little(tmp_path, monkeypatch, written, expect):
    """The launcher cuts a rank's 3 MiB segment down to what was recorded, including slots written after one a
    killed thread had claimed, and reads a few windows for it rather than the whole file; the analysis reads the
    same records without the tail."""
    import os

    from distcheck.contract import trace_slots

    size = trace_slots.SIZE
    data = bytearray(trace_slots.header(files.FORMAT)) + bytearray(size * trace_slots.SEGMENT_SLOTS)
    for slot in written:
        if isinstance(slot, tuple):
            trace_slots.END_TIME.pack_into(data, slot[1] * size + trace_slots.END_OFFSET, 2.0)
        else:
            trace_slots.SLOT.pack_into(data, slot * size, trace_slots.START, 0, 1, 1.0, 2.0)
    path = tmp_path / "trace-rank0.bin"
    path.write_bytes(bytes(data))
    read = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: read.append(n) or real_pread(fd, n, off))
    assert trace_slots.read_records(path) == bytes(data[:(expect + 1) * size])  # what the analysis reads
    assert sum(read) < (expect + 1) * size + 4 * trace_slots.TAIL_WINDOW * size
    read.clear()
    trace_slots.truncate_unused(path)
    assert path.stat().st_size == (expect + 1) * size
    assert sum(read) < 4 * trace_slots.TAIL_WINDOW * size < len(data) // 8
    trace_slots.truncate_unused(path)  # already cut: unchanged
    assert path.stat().st_size == (expect + 1) * size
