"""The one watch loop and its parts, without launching anything: the progress rule, the stop check, the hook
files the node watcher finds ranks by, and the ptrace permission a rank grants (real ranks: tests/integration)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from distcheck.rank.stack_hooks import install_rank_hooks
from distcheck.supervise.node_watcher import local_ranks
from distcheck.supervise.watch import DONE, HUNG, RankFunctions, WatchLoop


def test_progress_is_any_growth_of_a_trace_or_a_rank_ending(tmp_path):
    from distcheck.contract.progress_token import ProgressTokens

    prog = ProgressTokens(tmp_path, [0, 1])
    before = prog.sizes()
    assert before == (-1, -1) and prog.starting(before)
    (tmp_path / "trace-rank0.jsonl").write_text('{"ev":"meta","rank":0}\n')
    (tmp_path / "trace-rank1.jsonl").write_text('{"ev":"meta","rank":1}\n')
    after = prog.sizes()
    assert after != before and not prog.starting(after)
    assert prog.sizes() == after


def test_watch_loop_stops_a_run_that_provably_cannot_progress(tmp_path):
    for r in (0, 1):
        (tmp_path / f"trace-rank{r}.jsonl").write_text('{"ev":"meta","rank":%d}\n' % r)
    asked = []

    def should_stop(done):
        asked.append(set(done))
        return "rank 0 waits for rank 1, which finished"

    loop = WatchLoop(tmp_path, 30.0, source=RankFunctions(lambda: {0: os.getpid()}, lambda: {1}), expected=2,
                     should_stop=should_stop, stop_grace=0.3, poll=0.05)
    result = loop.run()
    assert result.state == "stopped" and result.stop_reason.startswith("rank 0 waits") and asked == [{1}]
    assert result.seconds < 5


def test_local_ranks_from_hook_files_ignores_stale_ones(tmp_path):
    info = install_rank_hooks(tmp_path, rank=0)
    (tmp_path / "stackhook-pid4194999.json").write_text(json.dumps({"pid": 4194999, "rank": 1, "signal": 12,
                                                                     "file": "x", "host": socket.gethostname()}))
    assert local_ranks(tmp_path) == {0: os.getpid()}
    assert info.pid == os.getpid() and info.file.endswith("faulthandler-rank0.txt")


def test_rank_hooks_name_the_parent_as_ptracer(monkeypatch, tmp_path):
    """Yama ptrace_scope=1 cannot be switched on here (no Yama LSM): check the prctl call itself instead."""
    import ctypes

    from distcheck.rank import stack_hooks as stacks

    calls = []

    class FakeLibc:
        def prctl(self, option, arg, *rest):
            calls.append((option.value, arg.value))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: FakeLibc())
    info = stacks.install_rank_hooks(tmp_path, rank=3)
    assert calls == [(stacks.PR_SET_PTRACER, os.getppid())]
    assert info.ptracer == f"PR_SET_PTRACER {os.getppid()}"
    # and on this kernel the real call reports honestly why nothing was needed
    monkeypatch.undo()
    done, reason = stacks.allow_ptrace_from(os.getppid())
    if not Path("/proc/sys/kernel/yama").exists():
        assert not done and "no Yama LSM" in reason


def test_watch_loop_is_done_once_every_rank_finished(tmp_path):
    result = WatchLoop(tmp_path, 0.5, source=RankFunctions(dict, lambda: {0, 1}), expected=2, poll=0.01).run()
    assert result.state == DONE and result.hang_findings == []


def _meta(tmp_path, *ranks):
    for r in ranks:
        (tmp_path / f"trace-rank{r}.jsonl").write_text(json.dumps({"ev": "meta", "rank": r}) + "\n")


def test_a_rank_still_importing_torch_gets_the_startup_limit(tmp_path):
    """No trace from rank 1 yet: the short no-progress limit does not apply until every rank is up."""
    _meta(tmp_path, 0)
    loop = WatchLoop(tmp_path, 0.1, source=RankFunctions(lambda: {0: 1, 1: 2}), expected=2, startup_timeout=0.6,
                     poll=0.01)
    slow = loop.run()
    _meta(tmp_path, 1)
    fast = WatchLoop(tmp_path, 0.1, source=RankFunctions(lambda: {0: 1, 1: 2}), expected=2, startup_timeout=0.6,
                     poll=0.01).run()
    assert slow.state == fast.state == HUNG
    assert slow.seconds >= 0.6 > fast.seconds >= 0.1


def test_after_a_failure_the_others_get_the_failure_grace(tmp_path):
    _meta(tmp_path, 0, 1)
    result = WatchLoop(tmp_path, 30.0, source=RankFunctions(lambda: {1: 2}, lambda: {0}), expected=2,
                       failed=lambda: True, failure_grace=0.2, poll=0.01).run()
    assert result.state == HUNG and result.seconds < 5


def test_without_an_expected_count_the_run_is_over_once_the_seen_ranks_are_gone(tmp_path):
    """The node watcher's case: ranks that finished count as seen even when no poll caught them running."""
    calls = []

    def live():
        calls.append(1)
        return {0: 123} if len(calls) == 1 else {}  # alive for one call only (the finished() probe)

    result = WatchLoop(tmp_path, 30.0, source=RankFunctions(live, lambda: {0} if len(calls) > 1 else set()),
                       expected=None, poll=0.01).run()
    assert result.state == DONE and result.seconds < 5


def test_a_vanished_report_dir_ends_the_startup_allowance(tmp_path):
    from distcheck.contract.progress_token import ProgressTokens

    prog = ProgressTokens(tmp_path / "gone", [0, 1])
    assert not prog.starting(prog.sizes())


def test_a_full_disk_at_start_up_costs_the_hook_file_not_the_rank(tmp_path, monkeypatch):
    """A report disk that is full when a rank starts must not kill it: the stack-hook file is only a hint for the
    watcher (py-spy still dumps the rank)."""
    import builtins

    from distcheck.contract import atomic_file

    real = builtins.open

    def full(file, *args, **kwargs):  # the disk fills while the hook file's temporary copy is written
        if "stackhook-pid" in str(file):
            raise OSError(28, "No space left on device")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(atomic_file, "open", full, raising=False)
    info = install_rank_hooks(tmp_path, rank=0)
    assert info.pid == os.getpid() and not list(tmp_path.glob("stackhook-pid*"))
    assert not list(tmp_path.glob(".stackhook-pid*"))  # no temporary file left either
