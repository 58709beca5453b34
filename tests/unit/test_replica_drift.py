"""Replica drift from the ranks' autocheck states, without launching ranks (analysis/replica_drift.py)."""
from __future__ import annotations

import torch

from distcheck.analysis.check_table import judge
from distcheck.analysis.replica_drift import drift_finding, fingerprint_row
from distcheck.rank.checks.fingerprint import fingerprint

DDP = ["ddp", [0, 1]]
SITE = {"file": "/w/train.py", "line": 40}
NO_SYNC = {"file": "/w/train.py", "line": 36}


def _row(step, tensors, key=DDP, backwards=2, unsynced=0):
    row = {"step": step, "params": [fingerprint_row(n, key, fingerprint(t)) for n, t in tensors.items()]}
    if step >= 0:
        row.update(backwards=backwards, unsynced=unsynced, site=SITE, no_sync_site=NO_SYNC if unsynced else None)
    return row


def _states(rows_by_rank):
    """``{rank: the replica_drift check's state}``."""
    return {r: {"steps": 3, "checked": rows, "seconds": 0.01} for r, rows in rows_by_rank.items()}


def _docs(rows_by_rank):
    """The ranks' autocheck documents holding those states."""
    return {r: {"rank": r, "steps": 3, "counter": "optimizer.step", "backwards": 6, "replica_drift": state}
            for r, state in _states(rows_by_rank).items()}


def _params(seed):
    torch.manual_seed(seed)
    return {"fc.weight": torch.randn(4, 4), "fc.bias": torch.randn(4), "head.weight": torch.randn(2, 4)}


def test_no_sync_on_every_micro_step_is_named_with_its_line():
    same, a, b = _params(0), _params(1), _params(2)
    states = _states({0: [_row(-1, same), _row(0, a, unsynced=2)], 1: [_row(-1, same), _row(0, b, unsynced=2)]})
    finding, compared = drift_finding(states)
    assert finding.kind == "tensor_divergence" and finding.ranks == [0, 1] and compared == 1
    assert finding.detail["params"] == ["fc.weight", "fc.bias", "head.weight"] and finding.detail["step"] == 0
    assert (finding.detail["file"], finding.detail["line"], finding.detail["cause"]) == ("/w/train.py", 36, "no_sync")
    assert "after the first optimizer.step() (train.py:40)" in finding.message
    assert "all 2 backward() calls before that step ran under no_sync() at train.py:36" in finding.message
    assert len(finding.message.splitlines()) <= 3


def test_identical_replicas_and_the_first_step_that_drifts():
    same, later = _params(0), _params(3)
    rows0 = [_row(-1, same), _row(0, same), _row(1, later)]
    rows1 = [_row(-1, same), _row(0, same), _row(1, dict(later, **{"head.weight": torch.zeros(2, 4)}))]
    assert drift_finding(_states({0: rows0[:2], 1: rows1[:2]})) == (None, 1)
    finding, _ = drift_finding(_states({0: rows0, 1: rows1}))
    assert finding.detail["params"] == ["head.weight"] and finding.detail["step"] == 1
    assert "optimizer.step() #1" in finding.message and finding.detail["cause"] is None
    assert (finding.detail["file"], finding.detail["line"]) == ("/w/train.py", 40)  # the step's line
    assert "DDP did not average their gradients" in finding.message


def test_differences_already_at_the_first_forward_are_not_drift():
    a, b = _params(1), _params(2)  # check_model's first-forward finding, not a step's
    assert drift_finding(_states({0: [_row(-1, a), _row(0, a)], 1: [_row(-1, b), _row(0, b)]}))[0] is None


def test_only_ranks_with_equal_keys_are_compared():
    """HSDP-like keys: ranks 0,2 and 1,3 are replicas of each other; 0 and 1 hold different shards."""
    shards = {0: _params(0), 1: _params(1)}
    rows = {r: [_row(-1, shards[r % 2], key=[[0, 1, 2, 3], [2, 2], [[1, r % 2]]]),
                _row(0, shards[r % 2], key=[[0, 1, 2, 3], [2, 2], [[1, r % 2]]])] for r in range(4)}
    assert drift_finding(_states(rows))[0] is None
    rows[3][1] = _row(0, _params(7), key=[[0, 1, 2, 3], [2, 2], [[1, 1]]])
    finding, _ = drift_finding(_states(rows))
    assert finding.ranks == [1, 3] and "Replicate DTensor parameters" in finding.message


def test_the_check_table_adds_the_check_and_the_finding():
    same, a, b = _params(0), _params(1), _params(2)
    found = judge(_docs({0: [_row(-1, same), _row(0, a, unsynced=2)], 1: [_row(-1, same), _row(0, b, unsynced=2)]}))
    assert [f.kind for f in found.findings] == ["tensor_divergence"]
    assert [(c.name, c.ok) for c in found.checks if c.name == "replica_drift"] == [("replica_drift", False)]
    found = judge(_docs({0: [_row(-1, same), _row(0, same)], 1: [_row(-1, same), _row(0, same)]}))
    assert found.findings == [] and [c.note for c in found.checks if c.name == "replica_drift"] == [
        "replicated parameters identical on every rank after 1 optimizer step"]
    # Nothing replicated (plain FSDP2): no baseline row, no check line.
    assert "replica_drift" not in [c.name for c in judge(_docs({0: [], 1: []})).checks]


def test_which_parameters_must_be_replicas(fake_world):
    """DDP's parameters over its group, except those the user told DDP to ignore (DDP never syncs them)."""
    from torch.nn.parallel import DistributedDataParallel

    from distcheck.rank.autocheck.replica_drift import replicated_params

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["1.weight"])
    ddp = DistributedDataParallel(model)
    assert [(n, k) for n, k, _ in replicated_params([ddp])] == [
        ("0.weight", ["ddp", [0, 1]]), ("0.bias", ["ddp", [0, 1]]), ("1.bias", ["ddp", [0, 1]])]
    assert replicated_params([torch.nn.Linear(2, 2)]) == []  # a plain model: no replica known
