"""A job diagnosed from torch's Flight Recorder dumps alone (analysis/fr_postmortem.py), on NCCL-format dumps
synthesized in torch's pickle layout (tests/fr_dump_builder.py): states, times and timeouts, point-to-point ops,
all_to_all, a rank without a dump, a ring that wrapped, and a correct job. Each detection asserts the finding's
kind, its ranks and the user's line it names.

    .venv/bin/python -m pytest -q tests/unit/test_fr_postmortem.py
"""
from __future__ import annotations

import time

import pytest

from fr_dump_builder import Ring, world, write

from distcheck.analysis.fr_postmortem import Postmortem
from distcheck.contract import torch_fr_dumps


def diagnose(folder, fast=True):
    dumps = torch_fr_dumps.find(str(folder))
    pm = Postmortem()
    for path, why in dumps.skipped:
        pm.skip(path, why)
    for ring in torch_fr_dumps.read_all(dumps, fast=fast):
        if isinstance(ring, torch_fr_dumps.Unreadable):
            pm.unreadable(ring.rank, ring.path, ring.reason)
        else:
            pm.add(ring)
    return pm.result()


def rings(n, steps=3, **kw):
    """n ranks that each ran ``steps`` all_reduces at line 10 of train.py, completed."""
    out = [Ring(r, world(n), **kw) for r in range(n)]
    for ring in out:
        for _ in range(steps):
            ring.coll("all_reduce", line=10)
    return out


def only(diag, kind):
    found = [f for f in diag.findings if f.kind == kind]
    assert len(found) == 1, [f"[{f.kind}] {f.ranks}: {f.message}" for f in diag.findings]
    return found[0]


def test_a_correct_job_gives_no_finding(tmp_path):
    for ring in rings(4, steps=50):
        write(tmp_path, ring)
    diag = diagnose(tmp_path)
    assert diag.findings == [] and diag.world_size == 4
    assert all(c.ok for c in diag.checks) and not diag.warnings
    assert [(g["name"], g["members"], g["positions"]) for g in diag.data["flight_recorder"]["groups"]] == \
        [("0", "0-3", [1, 50])]


def test_a_running_job_with_collectives_in_flight_is_not_a_hang(tmp_path):
    """A dump of a job that runs (the debug server's): the last collective in flight for milliseconds on every rank,
    one rank a collective behind. Not a hang: the wait is far below the timeout and a minute."""
    now = time.time_ns()
    rs = rings(4, steps=5, t0=now - 50_000_000)
    for r in rs[:3]:
        r.coll("all_reduce", line=10, state="started")
    for r in rs:
        write(tmp_path, r, mtime_ns=now)
    assert diagnose(tmp_path).findings == []


def test_a_rank_that_never_issued_the_collective_is_named_where_it_is(tmp_path):
    rs = rings(4)
    for r in rs[:3]:
        r.coll("all_reduce", line=12, state="started")  # #4: ranks 0-2 wait in it
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [3]
    assert f.detail["cause"] == "never_issued" and f.detail["position"] == 4
    assert "ranks 0-2 wait in all_reduce" in f.message and "timed out (waited 3600 s, timeout 600 s)" in f.message
    assert "rank 3 never issued it" in f.message and "CPU-side divergence" in f.message
    assert f.detail["file"] == "/job/train.py" and f.detail["line"] == 10  # where rank 3 was last seen
    assert "train.py:12" in f.message


def test_started_on_every_rank_and_never_completed_is_the_network_or_gpu(tmp_path):
    rs = rings(4)
    for r in rs:
        r.coll("all_reduce", line=12, state="started")
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [0, 1, 2, 3] and f.detail["cause"] == "not_completing"
    assert "every rank issued it and none completed it" in f.message and "network" in f.message
    assert f.detail["line"] == 12 and "timed out" in f.message


def test_a_rank_that_never_started_it_on_its_gpu(tmp_path):
    rs = rings(4)
    for r in rs:
        r.coll("all_reduce", line=12, state="scheduled" if r.rank == 2 else "started")
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [2] and f.detail["cause"] == "not_started" and f.detail["line"] == 12


def test_peers_completed_it_but_one_rank_did_not(tmp_path):
    rs = rings(4)
    for r in rs:
        r.coll("all_reduce", line=12, state="scheduled" if r.rank == 1 else "completed")
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [1] and f.detail["cause"] == "behind_on_gpu"
    assert "ranks 0,2-3 completed" in f.message


def test_a_timeout_retired_by_nccls_watchdog(tmp_path):
    """NCCL's watchdog retires a collective it timed out: retired and not completed, whatever the times say."""
    now = time.time_ns()
    rs = rings(2, t0=now - 5_000_000_000)
    for r in rs:
        r.coll("all_reduce", line=12, state="started", retired=True, timeout_ms=1000)
        write(tmp_path, r, mtime_ns=now)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [0, 1] and f.detail["line"] == 12
    assert "timed out" in f.message and "timeout 1 s" in f.message


def test_an_op_mismatch_names_the_odd_rank_even_rank_0(tmp_path):
    rs = rings(4)
    for r in rs:
        if r.rank == 0:
            r.coll("broadcast", line=33, state="started")
        else:
            r.coll("all_reduce", line=12, state="started")
        write(tmp_path, r)
    diag = diagnose(tmp_path)
    f = only(diag, "collective_mismatch")
    assert f.ranks == [0] and f.detail["fields"] == ["op"] and f.detail["position"] == 4
    assert f.detail["line"] == 33
    assert "rank 0 issued broadcast #4" in f.message and "ranks 1-3 issued all_reduce #4" in f.message
    assert "then wait in it" in f.message  # the hang it causes is this finding's, not a second one
    assert not [x for x in diag.findings if x.kind == "hang"]


def test_two_ranks_that_disagree_are_both_named(tmp_path):
    rs = rings(2)
    rs[0].coll("all_reduce", line=12, state="started")
    rs[1].coll("broadcast", line=14, state="started")
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [0, 1] and f.detail["line"] in (12, 14)


def test_keeps_going_after_the_first_mismatch_one_finding_per_cause(tmp_path):
    """Rank 1 passes another shape at five positions of group 0 (one cause, one finding that counts them), and in
    group 1 rank 2 passes another dtype (a second cause): torch's analyzer stops at the first."""
    groups = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("dp", [0, 1, 2, 3])}
    rs = [Ring(r, groups) for r in range(4)]
    for step in range(20):
        for r in rs:
            odd = r.rank == 1 and step % 4 == 1
            r.coll("all_reduce", ins=[[8]] if odd else [[4]], line=50 if odd else 10)
            r.coll("all_gather", group="1", dtype="Half" if r.rank == 2 and step == 7 else "Float",
                   line=60, ins=[[4]], outs=[[16]])
    for r in rs:
        write(tmp_path, r)
    diag = diagnose(tmp_path)
    found = sorted((f.detail["group"], tuple(f.ranks), tuple(f.detail["fields"]), f.detail["positions"],
                    f.detail["line"]) for f in diag.findings)
    assert found == [("0", (1,), ("input sizes", "output sizes"), 5, 50),
                     ("1", (2,), ("input dtypes", "output dtypes"), 1, 60)]


def test_a_shifted_sequence_is_one_finding(tmp_path):
    """Rank 3 skipped one all_reduce on a branch: every later position differs, one cause."""
    rs = [Ring(r, world(4)) for r in range(4)]
    for step in range(10):
        for r in rs:
            if r.rank == 3 and step == 4:
                continue
            r.coll("all_reduce" if step % 2 == 0 else "broadcast", line=10 + step % 2)
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [3] and f.detail["position"] == 5 and f.detail["positions"] == 5


def test_a_rank_without_a_dump_that_the_others_wait_for(tmp_path):
    rs = rings(4)
    for r in rs[:3]:
        r.coll("all_reduce", line=12, state="started")
        write(tmp_path, r)
    diag = diagnose(tmp_path)
    f = only(diag, "hang")
    assert f.ranks == [3] and f.detail["cause"] == "without_dump" and f.detail["line"] == 12
    assert "rank 3 left no dump" in f.message
    assert any(w.kind == "files_incomplete" and w.ranks == [3] for w in diag.warnings)


def test_a_ring_overwritten_before_the_divergence_is_named(tmp_path):
    """Rank 2's ring is short: it no longer holds #2, where rank 1 diverged (ranks 0 and 3 are the majority)."""
    rs = [Ring(r, world(4)) for r in range(4)]
    for step in range(40):
        for r in rs:
            r.coll("all_reduce", ins=[[8]] if (r.rank == 1 and step == 1) else [[4]], line=51 if r.rank == 1 and
                   step == 1 else 10)
    rs[2].keep_last(20)
    for r in rs:
        write(tmp_path, r)
    diag = diagnose(tmp_path)
    f = only(diag, "collective_mismatch")
    assert f.ranks == [1] and f.detail["position"] == 2 and f.detail["line"] == 51
    assert f.detail["overwritten"] == [2] and "rank 2: the ring no longer holds #2" in f.message
    assert any(w.kind == "ring_overwritten" and w.ranks == [2] for w in diag.warnings)


def test_a_rank_stuck_in_another_groups_collective_is_one_finding(tmp_path):
    """Ranks 0-1 wait in group 0's #4; rank 2 waits in group 1's #3, which rank 3 never issued: one cause."""
    groups = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("pp", [2, 3])}
    rs = [Ring(r, {k: v for k, v in groups.items() if r in v[1]}) for r in range(4)]
    for r in rs:
        for _ in range(3):
            r.coll("all_reduce", line=10)
        if r.rank in (2, 3):
            for _ in range(2):
                r.coll("all_reduce", group="1", line=70)
    for r in rs[:2]:
        r.coll("all_reduce", line=12, state="started")
    rs[2].coll("all_reduce", group="1", line=72, state="started")
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [3] and f.detail["group"] == "1" and f.detail["position"] == 3
    assert f.detail["also_blocks"][0]["group"] == "0" and "this also holds up group 0" in f.message


def test_send_and_receive_that_disagree(tmp_path):
    rs = rings(2)
    rs[0].send(1, sizes=[[4]], line=20)
    rs[1].recv(0, sizes=[[8]], line=31)
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [0, 1] and f.detail["src"] == 0 and f.detail["dst"] == 1 and f.detail["line"] == 20
    assert "rank 0 sends [[4]] float32 to rank 1" in f.message and "receives [[8]]" in f.message


def test_a_send_whose_receive_was_never_posted(tmp_path):
    rs = rings(2)
    rs[0].send(1, line=20)
    rs[1].recv(0, line=31)
    rs[0].send(1, line=22, state="started")  # p2p #2: rank 1 went elsewhere
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [1] and f.detail["cause"] == "p2p_unmatched" and f.detail["line"] == 22
    assert "rank 1 never posted the matching receive" in f.message


def test_all_to_all_checked_per_pair(tmp_path):
    """The list form holds each peer's tensor: rank 1 sends rank 2 three rows where rank 2 expects two."""
    n = 3
    rs = [Ring(r, world(n)) for r in range(n)]
    send = {0: [[2], [2], [2]], 1: [[2], [2], [3]], 2: [[2], [2], [2]]}
    for r in rs:
        recv = [send[src][r.rank] for src in range(n)]
        if r.rank == 2:
            recv = [[2], [2], [2]]
        r.coll("all_to_all", ins=send[r.rank], outs=recv, line=80 + r.rank)
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [1, 2] and f.detail["pairs"] == [{"src": 1, "dst": 2, "sent": [3], "expected": [2]}]
    assert f.detail["line"] == 81 and "rank 1 sends" in f.message


def test_all_to_all_single_totals_must_balance(tmp_path):
    rs = rings(2)
    rs[0].coll("all_to_all", ins=[[6]], outs=[[4]], line=90)
    rs[1].coll("all_to_all", ins=[[4]], outs=[[4]], line=90)
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [0, 1] and "send 10 elements in total but receive 8" in f.message and f.detail["line"] == 90


def test_a_group_made_with_different_members(tmp_path):
    rs = [Ring(r, {"0": ("default_pg", [0, 1, 2, 3]), "5": ("tp", [0, 1] if r != 1 else [1, 2])})
          for r in range(4)]
    for r in rs:
        r.coll("all_reduce", line=10)
        if r.rank < 3:
            r.coll("all_reduce", group="5", line=15)
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.detail["fields"] == ["group"] and f.ranks == [1] and "group 5 (tp) has different members" in f.message
    assert f.detail["line"] == 15  # where rank 1 used it


def test_gloo_rings_complete_by_retired(tmp_path):
    """gloo's ring never says completed: ``retired`` does; and it records no group members (pg_config)."""
    rs = [Ring(r, world(2), backend="gloo", config=False) for r in range(2)]
    for r in rs:
        r.coll("all_reduce", line=10, state="scheduled", retired=True)
    rs[0].coll("all_reduce", line=12, state="scheduled", retired=False)
    for r in rs:
        write(tmp_path, r)
    f = only(diagnose(tmp_path), "hang")
    assert f.ranks == [1] and f.detail["cause"] == "never_issued" and f.detail["line"] == 10


@pytest.mark.parametrize("layout", ["torch", "python", "json"])
def test_the_same_diagnosis_from_every_format(tmp_path, layout):
    rs = rings(4)
    for r in rs:
        r.coll("broadcast" if r.rank == 2 else "all_reduce", line=33 if r.rank == 2 else 12, state="started")
        write(tmp_path, r, layout=layout)
    f = only(diagnose(tmp_path), "collective_mismatch")
    assert f.ranks == [2] and f.detail["position"] == 4
    assert f.detail.get("line") == (None if layout == "json" else 33)  # torch's JSON carries no frames


def test_unreadable_and_cut_off_files_are_named_not_fatal(tmp_path):
    rs = rings(4)
    for r in rs:
        r.coll("all_reduce", line=12, state="started")
    for r in rs[:2]:
        write(tmp_path, r)
    data = write(tmp_path, rs[2]).read_bytes()
    (tmp_path / "rank_2").write_bytes(data[: len(data) * 3 // 4])  # cut off: entries before the cut are read
    (tmp_path / "rank_3").write_bytes(b"\x80\x02garbage")
    diag = diagnose(tmp_path)
    notes = {(tuple(w.ranks), w.message.split(" ", 1)[1][:12]) for w in diag.warnings if w.kind == "files_incomplete"}
    assert ((3,), "is not a rea") in notes
    if torch_fr_dumps._frscan is not None:
        assert ((2,), "is cut off: ") in notes
    assert diag.world_size == 4
