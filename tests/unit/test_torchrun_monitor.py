"""Rank 0's report thread under torchrun, on several nodes: which ranks it takes for running."""
from __future__ import annotations

import threading
from pathlib import Path

from distcheck.analysis.trace_events import RankTrace
from distcheck.options import RunOptions
from distcheck.supervise.torchrun_monitor import TorchrunMonitor


def test_other_nodes_ranks_that_wrote_their_exit_line_are_not_waited_for(tmp_path, monkeypatch):
    """Without the store's mirror (the exchange never came up) a report dir that every node shares still says that
    the other node's ranks ended: they are not taken for running, so a correct job is not declared hung."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monitor = TorchrunMonitor(0, 2, tmp_path, RunOptions(script=Path("train.py")), tmp_path / ".done",
                              threading.Event(), lambda code: None)
    assert monitor.multi_node and monitor.local_ranks == {0}
    ended = RankTrace(1, [], [], {"pid": 123456789}, {"ev": "exit", "ok": True, "code": 0})
    assert monitor._running({1: ended}) == {}
    running = RankTrace(1, [], [], {"pid": 123456789}, None)
    assert monitor._running({1: running}) == {1: 0}
    assert monitor._running({}) == {1: 0}  # nothing known of it: another node's rank still counts as running
