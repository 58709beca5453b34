"""Reading torch's Flight Recorder dumps (contract/torch_fr_dumps.py and its C scanner _frscan.c): which files
are dumps, the rank from the name, pickle (torch's layout and Python's) and JSON, cut-off and bad files, and the
scanner's columns equal to a whole unpickle's at every cut of a real-layout dump.

    .venv/bin/python -m pytest -q tests/unit/test_torch_fr_dumps.py
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from fr_dump_builder import Ring, dump_bytes, world, write

from distcheck.contract import torch_fr_dumps as frd
from distcheck.errors import UsageError

needs_scanner = pytest.mark.skipif(frd._frscan is None, reason="the C scanner is not built (no compiler at install)")


def ring_doc(rank=0, n=2, steps=3):
    r = Ring(rank, {"0": ("default_pg", list(range(n))), "1": ("tp", list(range(n)))})
    for k in range(steps):
        r.coll("all_reduce", line=10 + k % 2)
        r.coll("all_gather", group="1", ins=[[2, 3]], outs=[[2 * n, 3]], dtype="BFloat16", line=20)
    r.send(1 - rank if n == 2 else 1, line=30)
    r.coll("broadcast", line=40, state="started")
    return r


def columns(ring):
    """A ring's rows as plain values, whichever reader made them."""
    rows = []
    for i in range(ring.rows):
        row = {c: int(ring.ints[c][i]) for c in frd.INT_COLUMNS}
        row.update({c: int(ring.flags[c][i]) for c in frd.FLAG_COLUMNS})
        row.update({c: ring.values[c][ring.ids[c][i]] if ring.ids[c][i] >= 0 else None for c in frd.VALUE_COLUMNS})
        rows.append(row)
    return rows


@needs_scanner
@pytest.mark.parametrize("layout", ["torch", "python"])
def test_the_scanner_reads_what_unpickling_reads(layout):
    data = dump_bytes(ring_doc().doc(), layout)
    fast, whole = frd.parse(data, 0, "x", fast=True), frd.parse(data, 0, "x", fast=False)
    assert fast.rows == whole.rows == 8
    assert columns(fast) == columns(whole)
    assert (fast.version, fast.pg_config, fast.pg_status) == (whole.version, whole.pg_config, whole.pg_status)
    first = columns(fast)[0]
    assert first["profiling_name"] == "nccl:all_reduce" and first["process_group"] == ("0", "default_pg")
    assert first["frames"][2] == ("/job/train.py", 10, "step") and first["input_sizes"] == ((4,),)
    assert columns(fast)[-1]["state"] == "started" and columns(fast)[-1]["time_discovered_completed_ns"] == 0


@needs_scanner
def test_the_scanners_fast_path_and_general_loop_agree_at_every_cut():
    """Every prefix of a dump in torch's layout: the entry fast path gives up where the bytes end and the general
    loop reads the same entries, values and keys."""
    from distcheck.contract import _frscan

    data = dump_bytes(ring_doc(steps=2).doc(), "torch")
    for cut in range(0, len(data) + 1):
        assert _frscan.scan(data[:cut], fast=True) == _frscan.scan(data[:cut], fast=False), cut


@needs_scanner
def test_a_cut_off_pickle_keeps_the_entries_before_the_cut():
    data = dump_bytes(ring_doc(steps=20).doc(), "torch")
    whole = frd.parse(data, 0, "x")
    cut = frd.parse(data[: len(data) * 2 // 3], 0, "x")
    assert isinstance(cut, frd.TorchRing) and cut.cut and "cut off" in cut.problem
    assert 0 < cut.rows < whole.rows and columns(cut) == columns(whole)[: cut.rows]
    assert cut.pg_status == whole.pg_status  # written before the entries


def test_bad_files_are_unreadable_with_a_reason():
    assert "empty" in frd.parse(b"", 1, "x").reason
    assert "neither a pickle nor JSON" in frd.parse(b"hello", 1, "x").reason
    assert "not a readable pickle" in frd.parse(b"\x80\x02}q\x00(X", 1, "x").reason
    assert "not valid JSON" in frd.parse(b'{"entries": [', 1, "x").reason
    # a pickle that names a function is refused, never run
    evil = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00truer."
    bad = frd.parse(evil, 1, "x")
    assert isinstance(bad, frd.Unreadable) and "os.system" in bad.reason
    assert isinstance(frd.parse(evil, 1, "x", fast=False), frd.Unreadable)
    assert "no list of entries" in frd.parse(pickle.dumps([1, 2]), 1, "x").reason


def test_json_dumps_as_torch_writes_them(tmp_path):
    path = write(tmp_path, ring_doc(), layout="json")
    ring = frd.read(frd.DumpFile(0, path))
    assert ring.fmt == "json" and ring.rows == 8
    assert ring.pg_status["0"]["last_completed_collective"] == 3  # "3" in the JSON
    row = columns(ring)[0]
    assert row["process_group"] == ("0", "default_pg") and row["frames"] is None
    assert row["time_discovered_started_ns"] > 0 and columns(ring)[-1]["time_discovered_completed_ns"] == 0


def test_find_a_folder_a_prefix_and_the_rank_from_the_name(tmp_path):
    for rank in (0, 1, 10):
        write(tmp_path / "dumps", ring_doc(rank % 2))  # rank from the name, whatever the ring says
        os.replace(tmp_path / "dumps" / f"rank_{rank % 2}", tmp_path / "dumps" / f"nccl_trace_rank_{rank}")
    (tmp_path / "dumps" / "train1.log").write_text("not a dump")
    (tmp_path / "dumps" / "notes.txt").write_text("x")
    by_dir = frd.find(tmp_path / "dumps")
    assert [f.rank for f in by_dir.files] == [0, 1, 10] and by_dir.prefixes == [str(tmp_path / "dumps" / "nccl_trace_rank_")]
    by_prefix = frd.find(str(tmp_path / "dumps" / "nccl_trace_rank_"))
    assert [f.rank for f in by_prefix.files] == [0, 1, 10]
    assert frd.looks_like_dumps(tmp_path / "dumps") and frd.looks_like_dumps(str(tmp_path / "dumps" / "nccl_trace_rank_"))


def test_per_node_folders_and_host_prefixes_are_one_job(tmp_path):
    write(tmp_path / "nodeA", ring_doc(0), prefix="hostA_rank_")
    write(tmp_path / "nodeB", Ring(1, world(2)), prefix="hostB_rank_")
    found = frd.find(tmp_path)
    assert [f.rank for f in found.files] == [0, 1] and len(found.prefixes) == 2


def test_two_prefixes_of_the_same_ranks_are_ambiguous(tmp_path):
    write(tmp_path, ring_doc(0), prefix="rank_")
    write(tmp_path, ring_doc(0), prefix="json_", layout="json")
    with pytest.raises(UsageError, match="same ranks under two prefixes.*pass one prefix"):
        frd.find(tmp_path)


def test_a_second_dump_of_a_rank_is_passed_over_and_said(tmp_path):
    write(tmp_path, ring_doc(0), layout="torch")
    old = tmp_path / "rank_0"
    os.utime(old, ns=(1, 1))
    write(tmp_path, ring_doc(0), layout="json")  # rank_0.json, newer
    found = frd.find(tmp_path)
    assert [f.path.name for f in found.files] == ["rank_0.json"]
    assert found.skipped and found.skipped[0][0] == str(old) and "newer dump" in found.skipped[0][1]


def test_what_is_not_a_dump_folder_says_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="neither report.json nor Flight Recorder dumps"):
        frd.find(tmp_path / "empty")
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "fr_trace_20260101_120000.txt").write_text("--- Collectives ---")
    with pytest.raises(UsageError, match="torch.distributed.debug server.*handler/fr_trace_json"):
        frd.find(tmp_path / "srv")
    with pytest.raises(UsageError, match="no file is named"):
        frd.find(str(tmp_path / "empty" / "rank_"))
    assert not frd.looks_like_dumps(tmp_path / "empty")
    # a report directory of distcheck's own without its report.json (a node's, a run cut short) is not torch's dumps
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "flight-rank0.json").write_text('{"format": 3, "entries": []}')
    (tmp_path / "rep" / "autocheck-rank0.json").write_text("{}")
    assert not frd.looks_like_dumps(tmp_path / "rep")
    # a torchrun node's report dir: leftover stack-hook, exchange and watcher files, its report in its node folder
    node = tmp_path / "node-b-rep"
    (node / "node-node-b").mkdir(parents=True)
    for name in ("stackhook-pid4242.json", "exchange-node-b-0.json", "watcher-node-b.json"):
        (node / name).write_text('{"pid": 4242}')
    assert not frd.looks_like_dumps(node)  # before its node report exists: none of those is a rank's dump
    (node / "node-node-b" / "report.json").write_text("{}")
    assert not frd.looks_like_dumps(node)


def test_reading_many_files_in_threads_keeps_rank_order(tmp_path):
    for rank in range(12):
        write(tmp_path, Ring(rank, world(12)))
    rings = list(frd.read_all(frd.find(tmp_path), threads=3))
    assert [r.rank for r in rings] == list(range(12)) and all(isinstance(r, frd.TorchRing) for r in rings)
    assert all(np.all(r.ints["record_id"] >= 0) for r in rings)


@needs_scanner
def test_entries_read_from_plans_are_the_general_loops():
    """Entries alike but for their numbers are read from the plan of an earlier one: numbers that change width on
    the way (record ids and seq ids past 255 and 65,535), states and shapes that change now and then, all read as
    the general loop reads them, at every cut too."""
    from distcheck.contract import _frscan

    r = Ring(0, {"0": ("default_pg", [0, 1]), "1": ("tp", [0, 1])}, first_record=65_400)
    for k in range(400):
        r.coll("all_reduce", line=10, seq=65_300 + k, ins=[[8]] if k % 97 == 5 else [[4]],
               state="started" if k % 131 == 7 else "completed")
        r.coll("all_gather", group="1", ins=[[2, 3]], outs=[[4, 3]], line=20)
    data = dump_bytes(r.doc(), "torch")
    assert _frscan.scan(data, fast=True) == _frscan.scan(data, fast=False)
    for cut in range(0, len(data), 997):
        assert _frscan.scan(data[:cut], fast=True) == _frscan.scan(data[:cut], fast=False), cut
    ring = frd.parse(data, 0, "x")
    seqs = ring.ints["collective_seq_id"]
    assert seqs[0] == 65_300 and seqs[-2] == 65_699 and ring.ints["record_id"][-1] == 65_400 + 799
    assert [columns(ring)[2 * k]["input_sizes"] for k in (4, 5, 6)] == [((4,),), ((8,),), ((4,),)]
    assert columns(ring)[2 * 7]["state"] == "started" and columns(ring)[2 * 7]["time_discovered_completed_ns"] == 0
