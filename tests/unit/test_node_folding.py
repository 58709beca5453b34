"""Node 0's report folds the consequences into their cause (supervise/node_report.fold_node_consequences), and
names the nodes whose part never arrived with where their own reports are (node_exchange.silent_nodes_finding)."""
from __future__ import annotations

from distcheck.analysis.progress import CollectiveRef, RankProgress
from distcheck.contract.findings import Finding
from distcheck.contract.node_summary import RankState, NodeSummary
from distcheck.contract.watcher_file import WatcherState
from distcheck.supervise.node_exchange import merge_summaries, silent_nodes_finding
from distcheck.supervise.node_report import fold_node_consequences


def ref(seq: int) -> CollectiveRef:
    return CollectiveRef("all_reduce", seq, [0, 1], "train.py:16", "/job/train.py", 16, group="0,1")


def test_ranks_that_died_in_the_mismatched_collective_fold_into_it():
    mismatch = Finding("collective_mismatch", [0, 1], "collective #1 on group [0,1] differs in shapes across nodes",
                       {"across_nodes": True, "position": 1, "group_name": "0,1"})
    died = Finding("rank_failure", [1], "rank 1 ended without finishing its script", {})
    other = Finding("rank_failure", [0], "rank 0 raised KeyError", {"error": "KeyError: 'x'"})
    progress = {1: RankProgress(1, last_started=ref(1)), 0: RankProgress(0, last_started=None)}
    out = fold_node_consequences([mismatch, died, other], progress)
    assert out == [mismatch, other]
    assert mismatch.message.endswith("; then rank 1 died there")


def test_a_rank_that_only_lost_its_peer_on_a_silent_node_is_not_the_cause():
    silent = silent_nodes_finding({1: [1]}, 1.5, "node-a:4000", {1: "node-b"}, {1: "/data/rep"})
    lost = Finding("rank_failure", [0], "rank 0 raised RuntimeError: gloo lost its connection",
                   {"error": "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                             "[127.0.0.1]:5000"})
    out = fold_node_consequences([lost, silent], {})
    assert out == [silent]
    assert silent.message.startswith("node 1 (node-b) (torchrun's GROUP_RANK; rank 1) did not send its last summary")
    assert "node-b's own report: /data/rep/node-node-b/report.txt" in silent.message
    assert silent.message.endswith("; then rank 0 failed (gloo lost its connection to another rank: that rank ended "
                                   "or left the group) there")


def test_a_node_whose_last_summary_is_not_final_keeps_the_ends_it_sent():
    summary = NodeSummary(1, "node-b", [2, 3], {2: RankState(2, "error", 1), 3: RankState(3, "running")},
                          report_dir="/data/rep")
    merged = merge_summaries({1: summary}, [1], lambda n: [2 * n, 2 * n + 1], hung=False)
    assert merged.outcomes[2].state == "error" and 3 not in merged.outcomes
    assert merged.silent == {1: [3]} and merged.hosts == {1: "node-b"}


def test_a_failed_rank_is_covered_once_its_nodes_report_holds_it_and_the_exchange_is_in_place():
    state = WatcherState(1, 2, "3:4", 0, covered=[1], covered_attempt=0)
    assert not state.covers(0, 1)  # the exchange is not in place yet
    state.exchange_attempt = 0
    assert state.covers(0, 1) and not state.covers(0, 0) and not state.covers(1, 1)
