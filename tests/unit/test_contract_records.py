"""The record files (contract/records_file.py) and the automatic-check state file (contract/autocheck_file.py): what
the writer writes the reader reads back, a crash's leftovers are skipped, a full disk is returned, never raised."""
from __future__ import annotations

import errno
import json
import os

import pytest

from distcheck.contract import autocheck_file, files, records_file
from distcheck.contract.autocheck_file import RunFields
from distcheck.contract.records_file import IndexEntry, PartMeta, Writer


def _tensor_entry(name: str, step: int = 0) -> tuple[IndexEntry, list]:
    parts = [(PartMeta("weight", "parameter", "float32", [2]), b"\x00\x00\x80?\x00\x00\x00@"),
             (PartMeta("weight.grad", "gradient", "uint8", [3]), memoryview(b"abc"))]
    return IndexEntry(name, step, "module", replicated=True, rtol=0.5, file="train.py", line=7, auto=True,
                      dp=(1, 2)), parts


def test_records_round_trip(tmp_path):
    w = Writer(tmp_path, 3)
    entry, parts = _tensor_entry("model")
    assert w.append(entry, iter(parts)) is None  # a generator, as the rank passes it
    assert w.append(IndexEntry("loss", 4, "number", value=1.5, replicated=None)) is None
    assert w.append(IndexEntry("count", 4, "number", value=2)) is None
    w.close()
    (model, loss, count) = records_file.read(tmp_path, 3)
    assert model.entry == IndexEntry("model", 0, "module", 0, 3, [
        PartMeta("weight", "parameter", "float32", [2], 0, 8), PartMeta("weight.grad", "gradient", "uint8", [3], 8, 3)],
        None, True, 0.5, None, "train.py", 7, True, (1, 2))
    assert [bytes(d) for d in model.data] == [b"\x00\x00\x80?\x00\x00\x00@", b"abc"]
    assert (loss.entry.seq, loss.entry.value, loss.entry.parts, loss.data) == (1, 1.5, [], [])
    assert type(count.entry.value) is int and count.entry.seq == 2
    assert records_file.ranks(tmp_path) == [3]
    assert sorted(p.name for p in records_file.paths(tmp_path)) == ["records-rank3.bin", "records-rank3.jsonl"]
    # The index line as external readers see it: every key, in the order rank/records.py always wrote them.
    line = json.loads(records_file.index_path(tmp_path, 3).read_text().splitlines()[0])
    assert list(line) == ["format", "name", "step", "seq", "rank", "auto", "dp", "kind", "parts", "replicated",
                          "rtol", "atol", "file", "line"]
    assert line["format"] == files.FORMAT and line["parts"][1] == {
        "key": "weight.grad", "role": "gradient", "dtype": "uint8", "shape": [3], "offset": 8, "nbytes": 3}
    number = json.loads(records_file.index_path(tmp_path, 3).read_text().splitlines()[1])
    assert list(number) == ["format", "name", "step", "seq", "rank", "kind", "value", "replicated", "rtol", "atol",
                            "file", "line"]


def test_a_reused_file_is_appended_to_at_its_end(tmp_path):
    for _ in range(2):
        w = Writer(tmp_path, 0)
        entry, parts = _tensor_entry("model")
        w.append(entry, parts)
        w.close()
    first, second = records_file.read(tmp_path, 0)
    assert second.entry.parts[0].offset == 11 and [bytes(d) for d in second.data] == [bytes(d) for d in first.data]


def test_a_crash_leaves_records_that_are_skipped(tmp_path):
    w = Writer(tmp_path, 0)
    for name in ("a", "b"):
        entry, parts = _tensor_entry(name)
        w.append(entry, parts)
    w.close()
    with open(records_file.index_path(tmp_path, 0), "a") as fh:  # killed in the middle of an index line
        fh.write('{"format": 3, "name": "c", "st')
    assert [r.entry.name for r in records_file.read(tmp_path, 0)] == ["a", "b"]
    os.truncate(records_file.data_path(tmp_path, 0), 20)  # b's bytes cut short: b is not half read
    assert [r.entry.name for r in records_file.read(tmp_path, 0)] == ["a"]


def test_an_index_of_another_format_is_named(tmp_path):
    records_file.index_path(tmp_path, 0).write_text(json.dumps({"format": files.FORMAT + 1, "name": "x"}) + "\n")
    with pytest.raises(files.FormatError, match=f"format {files.FORMAT + 1}"):
        records_file.read(tmp_path, 0)


def _full_after(limit: int, monkeypatch) -> None:
    """os.write that writes at most ``limit`` more bytes, then fails as a full disk does."""
    real, left = os.write, [limit]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data)[:left[0]])
        left[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("limit", [5, 9, 20])  # in the first part, in the second, in the index line
def test_a_full_disk_takes_the_record_back_and_stops_the_writer(tmp_path, monkeypatch, limit):
    w = Writer(tmp_path, 0)
    w.append(IndexEntry("before", 0, "number", value=1))
    index_size = records_file.index_path(tmp_path, 0).stat().st_size
    _full_after(limit, monkeypatch)
    entry, parts = _tensor_entry("model")
    exc = w.append(entry, parts)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC and w.failed
    assert records_file.data_path(tmp_path, 0).stat().st_size == 0  # no half record's bytes
    assert records_file.index_path(tmp_path, 0).stat().st_size == index_size  # no half line
    monkeypatch.undo()
    entry, parts = _tensor_entry("later")
    assert w.append(entry, parts) is exc  # stopped for good: the records stay a prefix
    assert records_file.data_path(tmp_path, 0).stat().st_size == 0
    assert [r.entry.name for r in records_file.read(tmp_path, 0)] == ["before"]


def test_a_failing_value_takes_its_bytes_back_and_the_writer_goes_on(tmp_path):
    w = Writer(tmp_path, 0)

    def parts():
        yield PartMeta("a", "parameter", "uint8", [2]), b"xy"
        raise RuntimeError("full_tensor() failed")

    with pytest.raises(RuntimeError):
        w.append(IndexEntry("model", 0, "module"), parts())
    assert not w.failed and records_file.data_path(tmp_path, 0).stat().st_size == 0
    entry, good = _tensor_entry("next")
    assert w.append(entry, good) is None
    (rec,) = records_file.read(tmp_path, 0)
    assert rec.entry.parts[0].offset == 0 and rec.entry.seq == 0


def _state(rank: int, steps: int) -> dict:
    return autocheck_file.document(RunFields(rank, steps, "optimizer.step", 3), {
        "models": {"model_checks": [{"root": "Net"}], "warnings": [{"kind": "mixed_mesh", "message": "m"}]},
        "nan_watch": {"first_bad": None, "seconds": 0.25}, "auto_records": 2,
        "replica_drift": {"steps": 3, "checked": [], "seconds": 0.0}})


def test_autocheck_state_round_trip(tmp_path):
    assert autocheck_file.write(tmp_path, 1, _state(1, 5)) is None
    assert autocheck_file.write(tmp_path, 0, _state(0, 4)) is None
    states = autocheck_file.read_all(tmp_path)
    assert list(states) == [0, 1] and states[1] == {"format": files.FORMAT, **_state(1, 5)}
    text = autocheck_file.path(tmp_path, 1).read_text()
    # the run-level fields, then each check's state under its name (rank/autocheck/registry.py)
    assert list(json.loads(text)) == ["format", "rank", "steps", "counter", "backwards", "models", "nan_watch",
                                      "auto_records", "replica_drift"]
    assert autocheck_file.runs_of(states)[1] == RunFields(1, 5, "optimizer.step", 3)
    assert autocheck_file.parts_of(states, "auto_records") == {0: 2, 1: 2}
    assert autocheck_file.parts_of(states, "pipeline") == {}
    assert json.loads(text)["format"] == files.FORMAT and text.endswith("}\n")


def test_unreadable_autocheck_states_are_skipped(tmp_path):
    autocheck_file.write(tmp_path, 0, _state(0, 1))
    files.rank_file(tmp_path, "autocheck", 1).write_text('{"format": 3, "rank": 1, "mod')  # not ours: half written
    files.rank_file(tmp_path, "autocheck", 2).write_text("[1, 2]")
    assert list(autocheck_file.read_all(tmp_path)) == [0]
    files.rank_file(tmp_path, "autocheck", 3).write_text(json.dumps({"format": files.FORMAT + 1, "rank": 3}))
    with pytest.raises(files.FormatError):
        autocheck_file.read_all(tmp_path)


def test_a_full_disk_keeps_the_previous_autocheck_state_and_is_returned(tmp_path, monkeypatch):
    autocheck_file.write(tmp_path, 0, _state(0, 1))

    def replace(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", replace)
    exc = autocheck_file.write(tmp_path, 0, _state(0, 2))
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    monkeypatch.undo()
    assert autocheck_file.read_all(tmp_path)[0]["steps"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["autocheck-rank0.json"]  # no temporary file left
