"""consistency's rank 0 hands its report to the node watcher, which publishes it (contract/report_handoff.py,
supervise/report_desk.py, node_report.deliver_handed): no rank launched.

    python -m pytest tests/unit/test_report_handoff.py
"""
from __future__ import annotations

import os
from pathlib import Path

from distcheck.contract import report_handoff
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, load_report, publish
from distcheck.supervise import node_report
from distcheck.supervise.report_desk import ReportDesk


def consistency_report(note: str = "") -> Report:
    return Report("distcheck consistency", 2, [Finding("env_mismatch", [1], "OMP_NUM_THREADS differs", {"line": 3})],
                  [CheckResult("environment", False, 0.1, note)], {"report.json": "report.json"},
                  {"placement": [{"name": "w"}]}, {"placement": "w  param  Tensor"})


def published_as(report_dir: Path, report: Report) -> bool:
    """report.json holds ``report`` (the writer lists report.txt among the artifacts)."""
    written = load_report(report_dir)
    return (written.findings, written.checks, written.data) == (report.findings, report.checks, report.data)


def test_an_offer_is_claimed_whole_with_its_text_sections_and_pending_until_published(tmp_path):
    report_handoff.offer(tmp_path, consistency_report(), final=True)
    assert report_handoff.pending(tmp_path)
    handed = report_handoff.claim(tmp_path)
    assert handed is not None and handed.final and handed.pid == os.getpid()
    assert handed.report == consistency_report()  # sections travel too: report.txt's placement table
    assert report_handoff.pending(tmp_path)  # claimed, not yet published: rank 0 still waits
    assert report_handoff.claim(tmp_path) is None
    report_handoff.published(tmp_path)
    assert not report_handoff.pending(tmp_path)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # the mailbox is no artifact


def test_an_offer_made_while_the_previous_one_is_published_is_not_lost(tmp_path):
    report_handoff.offer(tmp_path, consistency_report("so far"), final=False)
    first = report_handoff.claim(tmp_path)
    report_handoff.offer(tmp_path, consistency_report("final"), final=True)
    report_handoff.published(tmp_path)
    assert report_handoff.pending(tmp_path)
    second = report_handoff.claim(tmp_path)
    assert first.report.checks[0].note == "so far" and not first.final
    assert second.report.checks[0].note == "final" and second.final


def test_a_withdrawal_carries_no_report_and_an_unreadable_offer_is_dropped(tmp_path):
    report_handoff.offer(tmp_path, None, final=True)
    withdrawn = report_handoff.claim(tmp_path)
    assert withdrawn.report is None and withdrawn.final
    (tmp_path / report_handoff.OFFERED).write_text("{not json")
    assert report_handoff.claim(tmp_path) is None and not report_handoff.pending(tmp_path)


def test_the_final_report_is_printed_the_partial_written_only(tmp_path, capsys):
    partial = report_handoff.Handed(consistency_report("so far"), False, 1)
    assert node_report.deliver_handed(partial, tmp_path) == node_report.PUBLISHED
    assert capsys.readouterr().out == "" and load_report(tmp_path).checks[0].note == "so far"
    final = report_handoff.Handed(consistency_report(), True, 1)
    assert node_report.deliver_handed(final, tmp_path) == node_report.PUBLISHED
    out = capsys.readouterr().out
    assert "OMP_NUM_THREADS differs" in out and "w  param  Tensor" in out
    assert (tmp_path / "report.txt").read_text() == out


def test_the_watchdogs_diagnosis_is_never_overwritten_by_the_report_of_the_run_it_ended(tmp_path, capsys):
    watchdog = Report("distcheck consistency", 2, [Finding("hang", [1], "rank 1 waits in all_reduce at m.py:9",
                                                           {"line": 9})],
                      [CheckResult("watchdog", False, 30.0, "no progress for 30s")])
    publish(watchdog, tmp_path)
    interrupted = report_handoff.Handed(consistency_report("interrupted"), True, 1)
    assert node_report.deliver_handed(interrupted, tmp_path) == node_report.SUPERSEDED
    assert load_report(tmp_path).to_json() == watchdog.to_json() and capsys.readouterr().out == ""


def test_a_withdrawal_removes_the_partial_report(tmp_path):
    node_report.deliver_handed(report_handoff.Handed(consistency_report("so far"), False, 1), tmp_path)
    assert node_report.deliver_handed(report_handoff.Handed(None, True, 1), tmp_path) == node_report.WITHDRAWN
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "report.txt").exists()


def test_the_desk_publishes_what_rank_0_hands_over_and_rank_0_waits_for_it(tmp_path, capsys):
    desk = ReportDesk(tmp_path, poll=0.01).start()
    try:
        report_handoff.offer(tmp_path, consistency_report(), final=True)
        assert report_handoff.wait_published(tmp_path, 10.0, lambda: True)
    finally:
        desk.stop()
    assert published_as(tmp_path, consistency_report()) and "OMP_NUM_THREADS differs" in capsys.readouterr().out


def test_rank_0_publishes_itself_through_the_same_path_when_its_watcher_is_gone(tmp_path, capsys):
    """No watcher claims the offer (SIGKILLed, or never started): rank 0 does not wait out the limit, and its report
    is written and printed all the same, with no offer left behind."""
    from distcheck.commands import consistency as command

    class GoneWatcher:
        def running(self) -> bool:
            return False

    command._hand_over(consistency_report(), tmp_path, GoneWatcher())
    assert published_as(tmp_path, consistency_report())
    assert "OMP_NUM_THREADS differs" in capsys.readouterr().out
    assert not report_handoff.pending(tmp_path)


def test_rank_0_does_not_wait_for_a_partial_report(tmp_path):
    from distcheck.commands import consistency as command

    class SlowWatcher:
        def running(self) -> bool:
            raise AssertionError("a partial report is not waited for")

    command._hand_over(consistency_report("so far"), tmp_path, SlowWatcher(), final=False)
    assert report_handoff.pending(tmp_path) and not (tmp_path / "report.json").exists()


def test_no_module_but_the_watchers_desk_and_rank_0s_fallback_delivers_a_handed_report():
    import ast

    pkg = Path(__file__).resolve().parents[2] / "distcheck"
    callers = set()
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == \
                    "deliver_handed":
                callers.add(path.relative_to(pkg).as_posix())
    assert callers == {"supervise/report_desk.py", "commands/consistency.py"}


def test_the_watchs_last_look_waits_for_the_offer_the_desk_is_publishing(tmp_path, monkeypatch):
    """The watch's last look (report_desk.take) found the mailbox empty while the desk's thread was still publishing
    the offer it had claimed; the watcher then ended, its daemon desk thread with it, and no report.json was left
    (rank 0 SIGKILLed right after its offer: the CI failure of test_a_sigkilled_rank_0_leaves_the_report...)."""
    import threading
    import time

    from distcheck.supervise import report_desk

    real = node_report.deliver_handed
    claimed = threading.Event()

    def slow(handed, report_dir):
        claimed.set()
        time.sleep(0.3)  # a loaded machine: the desk's first publication imports the report writers
        return real(handed, report_dir)

    monkeypatch.setattr(node_report, "deliver_handed", slow)
    report_handoff.offer(tmp_path, consistency_report("so far"), final=False)
    desk = threading.Thread(target=report_desk.take, args=(tmp_path,))
    desk.start()
    assert claimed.wait(5.0)
    assert report_desk.take(tmp_path) is None  # nothing left to claim, but it returned only once that was out
    assert published_as(tmp_path, consistency_report("so far")) and not report_handoff.pending(tmp_path)
    desk.join(5.0)


def test_a_stopped_rank_holds_torchrun_until_rank_0s_handed_report_is_out(tmp_path, monkeypatch):
    """Rank 0 SIGKILLed right after its offer: rank 1, stopped by torchrun, ends only once the watcher published it
    (torchrun returns when rank 1 ends, and a CI step then kills the watcher); at once when nothing waits."""
    import threading
    import time

    from distcheck.contract import watcher_file
    from distcheck.contract.watcher_file import WatcherState
    from distcheck.processes import launcher_id, start_ticks
    from distcheck.rank import entry
    from distcheck.contract import env

    me = os.getpid()
    monkeypatch.setenv(env.AGENT_PID, str(me))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    started = time.monotonic()
    assert entry.wait_for_handed_report(tmp_path, limit=5.0)  # no offer: no wait, even with no watcher at all
    assert time.monotonic() - started < 0.5
    watcher_file.write(tmp_path, WatcherState(me, start_ticks(me), launcher_id(me), watching=0))
    report_handoff.offer(tmp_path, consistency_report("so far"), final=False)
    publishing = threading.Timer(0.3, lambda: report_handoff.published(tmp_path) if report_handoff.claim(tmp_path)
                                 else None)
    publishing.start()
    started = time.monotonic()
    assert entry.wait_for_handed_report(tmp_path, limit=5.0)
    assert 0.25 < time.monotonic() - started < 5.0
