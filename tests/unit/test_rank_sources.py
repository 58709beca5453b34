"""The RankSource each supervisor gives the one watch loop (supervise/watch.py): which ranks run, which finished.
Fake processes only (real ranks: tests/integration)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from distcheck.supervise.launcher import LauncherRanks, Supervisor
from distcheck.supervise.node_watcher import Attempt, NodeRanks
from distcheck.supervise.watch import RankFunctions
from distcheck.testing.pool import Pool, PoolRanks, PoolOutcome


class FakeProc:
    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


class FakeTree:
    def __init__(self) -> None:
        self.observed: list[dict[int, int]] = []

    def observe(self, pids: dict[int, int]) -> None:
        self.observed.append(dict(pids))


def test_rank_functions_default_to_no_finished_rank():
    source = RankFunctions(lambda: {0: 7})
    assert source.live() == {0: 7} and source.finished() == set()


def test_the_launcher_answers_from_its_child_processes(tmp_path):
    sup = Supervisor(2, lambda r: [], report_dir=tmp_path, timeout=1.0)
    sup.procs = {0: FakeProc(10, 0), 1: FakeProc(11)}
    sup.tree = FakeTree()
    source = LauncherRanks(sup)
    assert source.live() == {1: 11} and sup.tree.observed == [{1: 11}]
    assert source.finished() == {0}


def test_the_pool_collects_outcomes_as_ranks_finish():
    class Conn:
        def __init__(self, outcome=None):
            self.outcome = outcome

        def poll(self, timeout):
            return self.outcome is not None

        def recv(self):
            return self.outcome

    pool = Pool(3, "gloo", [])
    pool.procs = [FakeProc(20), FakeProc(21, -9), FakeProc(22)]
    pool.conns = [Conn(PoolOutcome(0, "passed")), Conn(), Conn()]
    source = PoolRanks(pool)
    assert source.live() == {0: 20, 2: 22}  # rank 1 died
    assert source.finished() == {0, 1} and not source.outcomes[0].text
    assert source.outcomes[1].status == "died" and "signal 9" in source.outcomes[1].text
    assert source.live() == {2: 22} and source.failed()


def _trace(tmp_path, rank: int, ppid: int) -> None:
    (tmp_path / f"trace-rank{rank}.jsonl").write_text(json.dumps({"ev": "meta", "rank": rank, "ppid": ppid}) + "\n")


def test_the_node_watcher_counts_a_rank_that_ended_before_it_looked(tmp_path):
    """No hook file (the rank is gone): its trace under this agent makes it seen, hence finished."""
    _trace(tmp_path, 0, ppid=4242)
    _trace(tmp_path, 1, ppid=1)  # another agent's
    seen: set[int] = set()
    source = NodeRanks(tmp_path, "here", FakeTree(), seen, Attempt(0, {}, None), agent=4242, traced=range(2))
    assert source.live() == {} and source.finished() == {0} and seen == {0}
    assert NodeRanks(tmp_path, "here", FakeTree(), set(), Attempt(0, {}, None), agent=4242).finished() == set()


def test_the_node_watcher_sends_each_change_of_the_ended_ranks(tmp_path, monkeypatch):
    """Each change of the ended ranks: this node's own report first (never final while the watch runs: the last
    summary comes once it is over), then the summary to node 0, except on node 0 itself."""
    _trace(tmp_path, 2, ppid=4242)
    sent: list = []
    written: list = []
    channel = SimpleNamespace(send_summary=sent.append, summaries=lambda nodes: {})
    env = SimpleNamespace(ranks=[2, 3], reports=False, nnodes=2, node=1)
    source = NodeRanks(tmp_path, "here", FakeTree(), set(), Attempt(0, {}, None), agent=4242, traced=env.ranks,
                       exchange=(env, channel))
    source.own_report = lambda running, final: written.append((sorted(running), final)) or ("summary", final)
    assert source.finished() == {2} and source.finished() == {2}
    assert written == [([], False)] and sent == [("summary", False)]  # once: the ended ranks did not change
    node0 = NodeRanks(tmp_path, "here", FakeTree(), set(), Attempt(0, {}, None), agent=4242, traced=env.ranks,
                      exchange=(SimpleNamespace(ranks=[2, 3], reports=True, nnodes=2, node=0), channel))
    node0.own_report = source.own_report
    assert node0.finished() == {2} and len(written) == 2 and len(sent) == 1  # node 0 writes, sends nothing
