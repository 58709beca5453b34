"""The many-node exchange's pure side (supervise/node_exchange.py): node summaries as they travel, node 0's merge,
the silent-node finding, and the store channel against a real TCPStore."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from distcheck.analysis.progress import CollectiveRef, GroupProgress, RankProgress
from distcheck.analysis.rank_outcomes import STATE_ERROR, STATE_HUNG, STATE_OK, STATE_STOPPED
from distcheck.contract.node_summary import RUNNING, NodeSummary, RankState
from distcheck.supervise.node_exchange import (NodeEnv, StoreChannel, merge_summaries, rank_outcome,
                                               silent_nodes_finding, where_line)

ENV = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "2",
       "LOCAL_RANK": "0", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7",
       "TORCHELASTIC_RESTART_COUNT": "0"}


def test_node_env_from_torchrun_env():
    env = NodeEnv.from_env(ENV, "node-b")
    assert env is not None
    assert (env.node, env.nnodes, env.ranks, env.reports) == (1, 2, [2, 3], False)
    assert env.node_ranks(0) == [0, 1] and (env.store_host, env.store_port) == ("node-a", 29500)
    assert env.prefix == "distcheck/job7/0/"
    assert NodeEnv.from_env({**ENV, "GROUP_RANK": "0", "RANK": "0"}, "node-a").reports
    # One node: nothing to exchange.
    assert NodeEnv.from_env({**ENV, "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}, "node-a") is None


def progress(rank: int, issued: int, waits: int | None = None) -> RankProgress:
    group = GroupProgress("0", [0, 1, 2, 3], issued=issued, completed=issued - (1 if waits else 0))
    ref = CollectiveRef("all_reduce", waits, [0, 1, 2, 3], "train.py:33", "/p/train.py", 33, group="0") \
        if waits else None
    return RankProgress(rank, started=issued, completed=issued, first_open=ref, open=[ref] if ref else [],
                        groups={"0": group})


def summary(node: int, states: dict[int, RankState], hung: bool = False, **kw) -> NodeSummary:
    prog = {str(r): progress(r, 1).to_json() for r in states}
    return NodeSummary(node, f"node-{'ab'[node]}", sorted(states), states, prog, hung=hung, **kw)


def test_summary_round_trip_keeps_states_errors_and_progress():
    err = {"rank": 3, "exc_type": "ValueError", "message": "bad sample", "traceback": "Traceback...",
           "site": "train.py:23", "file": "/p/train.py", "line": 23, "t": 1.0}
    s = summary(1, {2: RankState(2, RUNNING), 3: RankState(3, STATE_ERROR, 1, error=err, stderr_tail=["boom"])},
                final=False, report_dir="/scratch/rep")
    back = NodeSummary.from_json(json.loads(s.encode()))
    assert back.states[3].error == err and back.states[3].stderr_tail == ["boom"] and back.report_dir == "/scratch/rep"
    outcome = rank_outcome(back.states[3], hung=False)
    assert (outcome.state, outcome.exit_code, outcome.error.exc_type, outcome.error.line) == (STATE_ERROR, 1,
                                                                                              "ValueError", 23)
    assert rank_outcome(back.states[2], hung=True).state == STATE_HUNG
    assert rank_outcome(back.states[2], hung=False).state == STATE_STOPPED


def test_a_summary_names_each_big_group_once_and_node_0_shares_its_list():
    """A 100,000-rank world listed in each rank's refs made a node's summary 13.5 MB: a group of more than 64 ranks
    is sent once (a range when its ranks are one), every ref of it points there, and node 0's decoded refs of one
    group, over every summary, are one list."""
    world = list(range(100_000))
    dp = list(range(3, 100_000, 8))  # a data-parallel group of a 2-D mesh: a range with a step
    odd = [0, 5, 6] + list(range(10, 100))  # neither: listed
    prog = {}
    for r in (8, 9):
        p = RankProgress(r)
        p.last_started = CollectiveRef("all_reduce", 7, world, "t.py:3", "/w/t.py", 3, group="0")
        p.last_completed = CollectiveRef("all_gather", 6, dp, "t.py:4", "/w/t.py", 4, group="3")
        p.first_open = CollectiveRef("broadcast", 2, odd, "t.py:5", "/w/t.py", 5, group="5")
        p.groups = {"0": GroupProgress("0", world, 7, 6), "2": GroupProgress("2", [8, 9], 1, 1)}
        prog[str(r)] = p.to_json()
    s = NodeSummary(1, "node-b", [8, 9], {8: RankState(8, RUNNING), 9: RankState(9, RUNNING)}, prog)
    data = s.encode()
    assert len(data) < 3000, len(data)
    sent = json.loads(data)
    assert sent["groups"][:2] == [{"range": [0, 100_000, 1]}, {"range": [3, 100_003, 8]}]
    assert sent["groups"][2] == {"ranks": odd} and len(sent["groups"]) == 3
    assert sent["progress"]["8"]["last_started"]["pg"] == "@0" and sent["progress"]["9"]["groups"]["2"]["pg"] == [8, 9]
    back = NodeSummary.from_json(sent)
    again = NodeSummary.from_json(json.loads(data))
    p8, p9 = (RankProgress.from_json(r, back.progress[str(r)]) for r in (8, 9))
    assert p8.last_started.pg == world and p8.last_completed.pg == dp and p8.first_open.pg == odd
    assert p8.groups["0"].pg == world and p9.groups["2"].pg == [8, 9]
    shared = RankProgress.from_json(8, again.progress["8"]).last_started.pg
    assert p8.last_started.pg is p9.last_started.pg is p9.groups["0"].pg is shared
    assert s.progress["8"]["last_started"]["pg"] is world  # encoding left the node's own progress as it was
    # the node's ranks that issued the same collectives send their digests once; node 0 gets one object for them
    s.digests = {"8": {"0": [7, ["ab" * 8], 0, "cd" * 8]}, "9": {"0": [7, ["ab" * 8], 0, "cd" * 8]},
                 "10": {"0": [6, ["ef" * 8], 0, ""]}}
    sent = json.loads(s.encode())
    assert sent["digest_table"] == [[7, ["ab" * 8], 0, "cd" * 8], [6, ["ef" * 8], 0, ""]]
    assert sent["digests"] == {"8": {"0": 0}, "9": {"0": 0}, "10": {"0": 1}}
    back = NodeSummary.from_json(sent)
    assert back.digests == s.digests and back.digests["8"]["0"] is back.digests["9"]["0"]
    # a summary of format 2 (groups and digests inline) still reads
    old = {**sent, "format": 2, "progress": json.loads(json.dumps(prog)), "digests": s.digests}
    del old["groups"], old["digest_table"]
    old_back = NodeSummary.from_json(old)
    assert RankProgress.from_json(8, old_back.progress["8"]).last_started.pg == world
    assert old_back.digests == s.digests


def test_summary_is_bounded_stacks_stay_on_the_node():
    big = {"format": 2, "ranks": [{"rank": 2, "threads": [{"frames": ["x" * 1000] * 200}]}]}
    s = summary(1, {2: RankState(2, RUNNING)}, hung=True, stacks=big)
    data = s.encode(limit=50_000)
    assert len(data) < 50_000
    back = NodeSummary.from_json(json.loads(data))
    assert back.stacks is None and "too large to send" in back.note and "node-b" in back.note
    assert len(s.encode()) > 100_000  # the default limit lets it through


def test_merge_names_each_remote_rank_and_a_silent_node_once():
    got = {1: summary(1, {2: RankState(2, STATE_OK, 0), 3: RankState(3, RUNNING)}, hung=True)}
    merged = merge_summaries(got, [1, 2], lambda n: [2 * n, 2 * n + 1], hung=False)
    assert {r: o.state for r, o in merged.outcomes.items()} == {2: STATE_OK, 3: STATE_HUNG}
    assert sorted(merged.progress) == [2, 3] and merged.hosts == {1: "node-b"}
    assert merged.silent == {2: [4, 5]}
    f = silent_nodes_finding(merged.silent, 30.0, "node-a:29500")
    assert f.kind == "rank_failure" and f.ranks == [4, 5]
    assert f.message.startswith("node 2 (torchrun's GROUP_RANK; ranks 4-5) sent nothing by the deadline (30s)")
    assert "node-a:29500" in f.message
    assert silent_nodes_finding({}, 30.0, "x") is None


def test_where_line():
    assert where_line("node-a:/scratch/rep/report.txt", 300) == \
        "distcheck: the report of this job is on node-a: /scratch/rep/report.txt\n"
    env = NodeEnv.from_env(ENV, "node-b")
    assert "node 0 (node-a, the node of rank 0) ended before" in where_line(None, 300, env, gone=True)


def test_store_channel_against_a_real_store():
    torch_dist = pytest.importorskip("torch.distributed")
    master = torch_dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    env0 = NodeEnv.from_env({**ENV, "GROUP_RANK": "0", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(master.port)}, "node-a")
    env1 = NodeEnv.from_env({**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port)}, "node-b")
    zero, one = StoreChannel.connect(env0), StoreChannel.connect(env1)
    assert one.report_location() is None and one.hang_announced() is None
    assert one.send_summary(summary(1, {2: RankState(2, RUNNING), 3: RankState(3, RUNNING)}, hung=True))
    got = zero.gather([1], time.monotonic() + 5, ready=lambda s: s.hung)
    assert got[1].ranks == [2, 3] and got[1].hung
    # A node that never answers costs the deadline, not more.
    began = time.monotonic()
    assert zero.gather([1, 5], time.monotonic() + 0.5, ready=lambda s: s.hung).keys() == {1}
    assert time.monotonic() - began < 3
    one.announce_hang(1, "node-b")
    assert zero.hang_announced() == (1, "node-b")
    zero.post_report_path("node-a", "/scratch/rep/report.txt")
    assert zero.await_report_seen(1, time.monotonic() + 0.3) == 0
    assert one.report_location() == "node-a:/scratch/rep/report.txt"
    assert zero.await_report_seen(1, time.monotonic() + 5) == 1
    # Counters: another node's progress is visible as a change of the shared count.
    before = zero.progress_count()
    one.bump_progress()
    assert zero.progress_count() == before + 1
    # Only our prefix is touched: the ranks' own keys are not.
    assert not master.check(["report"]) and master.check(["distcheck/job7/0/report"])
    del master  # the store goes away (node 0's torchrun ended): calls fail fast, then the channel gives up
    for _ in range(3):
        one.hang_announced()
    assert one.broken and one.report_location() is None


def test_store_channel_unreachable_is_none():
    env = NodeEnv.from_env({**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "node-b")
    began = time.monotonic()
    assert StoreChannel.connect(env, timeout=1.0) is None
    assert time.monotonic() - began < 10


def test_a_mismatch_that_only_says_another_nodes_traces_are_elsewhere_is_dropped():
    from distcheck.contract.findings import Finding
    from distcheck.supervise.node_exchange import MergedNodes
    from distcheck.supervise.run_report import without_contradicted

    # Node 0 sees rank 0's 3 all_reduces and no trace of rank 2 (on node 1): "rank 2 issued fewer".
    missing = Finding("collective_mismatch", [2], "rank 2 issued 0 collectives on group [0,2], rank 0 issued 3",
                      {"group": [0, 2], "group_name": "0", "counts": {0: 3, 2: 0}})
    other = Finding("rank_failure", [2], "rank 2 raised ValueError", {})
    same = MergedNodes(progress={2: progress(2, 3)})
    assert without_contradicted([missing, other], same, {0}) == [other]
    fewer = MergedNodes(progress={2: progress(2, 2)})  # it really issued fewer: kept
    assert without_contradicted([missing, other], fewer, {0}) == [missing, other]


class FakeChannel:
    """The store as NodeLink sees it: counters and flags another node sets."""

    broken = False
    exchange = True  # already on node 0's exchange store

    def __init__(self) -> None:
        self.count, self.hang, self.report, self.published = 0, None, None, []

    def bump_progress(self):
        self.count += 1
        return self.count

    def progress_count(self):
        return self.count

    def hang_announced(self):
        return self.hang

    def report_location(self):
        return self.report

    def version(self):
        return 0

    def summaries(self, nodes):
        return {}

    def post_report_path(self, host, path):
        self.published.append((host, path))


def test_node_link_sees_other_nodes_progress_hang_and_report(tmp_path):
    import threading

    from distcheck.supervise.node_exchange import NodeLink

    env = NodeEnv.from_env(ENV, "node-b")
    channel, cancel, token = FakeChannel(), threading.Event(), [0]
    link = NodeLink(env, channel, tmp_path, lambda: token[0], cancel)
    link.step()
    assert link.others_progressed == 0.0  # only our own bump so far
    channel.count += 1  # another node's ranks progressed
    link.step()
    assert time.monotonic() - link.others_progressed < 5.0 and link.job_idle() < 1.0
    token[0] = 1  # ours did too, within a second of the last bump: noted, not sent yet
    link.step()
    assert channel.count == 2
    channel.hang = (1, "node-b")  # our own announcement does not cancel us
    link.step()
    assert not cancel.is_set()
    channel.hang = (0, "node-b")  # another node, though its host has our name: by index, never by hostname
    link.step()
    assert cancel.is_set() and link.remote_hang == "node-b"
    channel.report = "node-a:/scratch/rep/report.txt"
    link.step()
    # This node's watcher prints where node 0's report is.
    assert link.report == channel.report
