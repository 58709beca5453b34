"""Ranks that ran different numbers of training steps (analysis/step_counts.py), from their dumps' counts."""
from __future__ import annotations

from types import SimpleNamespace

from distcheck.analysis.step_counts import uneven_steps
from distcheck.contract.findings import Finding


def trace(backward: int, steps: int, line: int = 30):
    return SimpleNamespace(step_counts={"backward": backward, "optimizer_step": steps, "backward_file": "/w/t.py",
                                        "backward_line": line})


def waiting(op: str | None):
    return SimpleNamespace(pending=SimpleNamespace(op=op, completed=False) if op else None)


def test_a_rank_that_went_on_without_a_step_is_named_with_every_ranks_counts():
    traces = {0: trace(4, 3), 1: trace(3, 3), 2: trace(4, 3)}
    progress = {0: waiting("all_reduce"), 1: waiting("barrier"), 2: waiting("all_reduce")}
    clause, detail = uneven_steps(traces, progress)
    assert clause.startswith("backward() ran 4 times on ranks 0,2, 3 times on rank 1, optimizer.step() 3 times on "
                             "every rank: rank 1 ran 1 training step fewer than ranks 0,2")
    assert "ranks 0,2's backward() #4 at t.py:30 waits for an all-reduce rank 1 never issues" in clause
    assert detail == {"step_counts": {"0": {"backward": 4, "optimizer_step": 3}, "1": {"backward": 3,
                                      "optimizer_step": 3}, "2": {"backward": 4, "optimizer_step": 3}}}
    f = Finding("hang", [0, 1, 2], "no progress for 10s: ...", {})
    from distcheck.analysis.step_counts import add_to_hang

    add_to_hang(f, traces, progress)
    assert f.message.startswith("no progress for 10s: ...; backward() ran 4 times") and "step_counts" in f.detail


def test_equal_counts_a_rank_stuck_before_its_backward_and_no_counts_add_nothing():
    assert uneven_steps({0: trace(4, 3), 1: trace(4, 3)}, {0: waiting("all_reduce"), 1: waiting("barrier")}) is None
    # rank 1 is stuck in its data loader (no collective pending): its fewer backward() are the consequence
    assert uneven_steps({0: trace(4, 3), 1: trace(3, 3)}, {0: waiting("all_reduce"), 1: waiting(None)}) is None
    assert uneven_steps({0: trace(4, 3), 1: SimpleNamespace(step_counts={})}, {}) is None
