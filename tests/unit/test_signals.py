"""Stop signals without launching anything: who takes them over, the one rule for the verdict (supervise/signals.py),
and what the watch loop makes of a signal at each moment (supervise/watch.py). Real launchers:
tests/integration/test_faults_signals.py."""
from __future__ import annotations

import json
import os
import time

import pytest

from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report
from distcheck.supervise import signals
from distcheck.options import is_launcher
from distcheck.supervise.signals import Interrupt, StopNow, StopSignals, settle
from distcheck.supervise.watch import (DONE, INTERRUPTED, HangDump, RankFunctions, WatchLoop, as_start_up,
                                       script_ended)


def interrupted(cause: str = "SIGTERM") -> Interrupt:
    interrupt = Interrupt()
    interrupt.set(cause)
    return interrupt


def write_trace(tmp_path, rank: int, exit_line: bool = False) -> None:
    lines = [json.dumps({"ev": "meta", "format": 3, "rank": rank, "pid": 1, "t": time.time()}, separators=(",", ":"))]
    if exit_line:
        lines.append(json.dumps({"ev": "exit", "ok": True, "code": 0, "t": time.time()}, separators=(",", ":")))
    (tmp_path / f"trace-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("argv, env, expected", [
    (["run", "--nproc", "2", "--", "t.py"], {}, True),
    (["compare", "--nproc", "2", "--", "t.py"], {}, True),
    (["run", "--", "t.py"], {"RANK": "0", "WORLD_SIZE": "2"}, False),  # a rank: torchrun's, or a launcher's
    (["consistency"], {}, False),
    (["stacks", "123"], {}, False),
    (["--version"], {}, False),
])
def test_only_a_launcher_takes_the_stop_signals_over(argv, env, expected):
    assert is_launcher(argv, env) is expected


def test_a_first_signal_is_recorded_and_a_second_stops_at_once(capfd):
    handlers = StopSignals()
    handlers._handle(15, None)
    assert handlers.interrupt.cause == "SIGTERM" and handlers.interrupt.is_set()
    assert handlers.interrupt.after >= 0
    with pytest.raises(StopNow, match="stopped at once by a second SIGINT"):
        handlers._handle(2, None)
    assert "SIGTERM received" in capfd.readouterr().err


def test_handlers_installed_early_stay_for_the_whole_process(monkeypatch):
    early = StopSignals()
    monkeypatch.setattr(signals, "_early", early)
    with StopSignals() as interrupt:
        assert interrupt is early.interrupt
    assert signals.early_interrupt() is early.interrupt


def passed_report(note: str = "stopped from outside by SIGTERM") -> Report:
    return Report(command="distcheck run", world_size=2, findings=[],
                  checks=[CheckResult("collective_order", True, 1.0), CheckResult("ranks_completed", True, 0.0, note)])


def test_a_signal_that_stopped_nothing_is_a_warning_and_keeps_the_verdict():
    report = passed_report()
    assert settle(report, interrupted())
    assert report.ok and report.exit_code == 0
    (w,) = report.warnings
    assert w.kind == "stop_signal" and w.message.startswith("SIGTERM arrived ")
    assert "after every rank had finished: it stopped nothing" in w.message
    assert {c.name: c.note for c in report.checks}["ranks_completed"] == ""
    assert not settle(report, interrupted())  # once


def test_a_signal_that_stopped_ranks_is_left_to_its_finding():
    stopped = Finding("hang", [0, 1], "the run was stopped from outside by SIGTERM after 3s: ...",
                      {"stopped_by": "SIGTERM"})
    report = passed_report()
    report.findings.append(stopped)
    assert not settle(report, interrupted()) and not report.warnings and not report.ok
    assert not settle(passed_report(), None) and not settle(passed_report(), Interrupt())


def test_a_signal_after_every_rank_finished_stops_nothing(tmp_path):
    for r in (0, 1):
        write_trace(tmp_path, r, exit_line=True)
    loop = WatchLoop(tmp_path, 30.0, source=RankFunctions(lambda: {}, lambda: {0, 1}), expected=2,
                     interrupt=interrupted(), dump=HangDump(world_size=2))
    result = loop.run()
    assert result.state == DONE and not result.hang_findings and result.stop_reason is None


def test_ranks_that_wrote_their_exit_line_get_a_moment_to_end(tmp_path):
    for r in (0, 1):
        write_trace(tmp_path, r, exit_line=True)
    assert script_ended(tmp_path, 0) and not script_ended(tmp_path, 5)
    ends = time.monotonic() + 0.3  # both ranks are still there when the signal comes; gone 0.3 s later

    def live():
        return {0: 11, 1: 12} if time.monotonic() < ends else {}

    def finished():
        return set() if time.monotonic() < ends else {0, 1}

    loop = WatchLoop(tmp_path, 30.0, source=RankFunctions(live, finished), expected=2, interrupt=interrupted(),
                     dump=HangDump(world_size=2))
    started = time.monotonic()
    result = loop.run()
    assert result.state == DONE and time.monotonic() - started < 2


def test_a_signal_before_any_rank_runs_the_script_is_a_stop_during_start_up(tmp_path):
    """No trace yet: nothing is dumped (the pids here do not exist), no line is named."""
    interrupt = interrupted()
    loop = WatchLoop(tmp_path, 30.0, source=RankFunctions(lambda: {0: 999999998, 1: 999999999}), expected=2,
                     interrupt=interrupt, dump=HangDump(world_size=2))
    started = time.monotonic()
    result = loop.run()
    assert result.state == INTERRUPTED and time.monotonic() - started < 2
    (f,) = result.hang_findings
    assert f.kind == "hang" and f.ranks == [0, 1]
    assert f.detail["stopped_by"] == "SIGTERM" and f.detail["phase"] == "start-up" and "file" not in f.detail
    assert f.message.startswith("the run was stopped from outside by SIGTERM during start-up, after ")
    assert f.message.endswith("ranks 0-1 were still starting (importing torch and distcheck), so none of the "
                              "script ran")


def stack(*frames: tuple[str, str, int]) -> dict:
    return {"threads": [{"main": True, "frames": [{"name": n, "file": f, "line": line, "native": False}
                                                  for n, f, line in frames]}]}


def test_a_stop_during_start_up_names_no_import_line():
    importing = stack(("<module>", "/home/me/proj/slow_module.py", 2),
                      ("_find_and_load", "<frozen importlib._bootstrap>", 1176),
                      ("<module>", "/home/me/proj/train.py", 3))
    joining = stack(("init_process_group", "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", 90),
                    ("main", "/home/me/proj/train.py", 7))
    waiting = stack(("<module>", "/home/me/proj/train.py", 8))
    setting_up = stack(("install", "/work/main/distcheck/rank/autocheck/__init__.py", 40))
    finding = Finding("hang", [1], "the run was stopped from outside by SIGTERM after 2s: rank 1 is in <module> "
                      "(train.py:3)", {"file": "/home/me/proj/train.py", "line": 3, "odd_ranks": [1],
                                       "stacks": {"0": joining, "1": importing, "3": waiting, "4": setting_up},
                                       "last_collectives": {"3": {"first_open": {"op": "all_reduce", "seq": 1,
                                                                                 "site": "train.py:8"}}}})
    f = as_start_up(finding, "SIGTERM", 2.04, [0, 1, 2, 3, 4])
    assert f.message == ("the run was stopped from outside by SIGTERM during start-up, after 2.0s, before any "
                         "collective completed: rank 0 was in main (train.py:7); rank 1 was importing modules; "
                         "rank 2 was still starting (importing torch and distcheck); rank 3 was waiting in "
                         "all_reduce #1 (train.py:8); rank 4 was still starting, before its script ran")
    assert f.ranks == [0, 1, 2, 3, 4] and "file" not in f.detail and "line" not in f.detail
    assert f.detail["phase"] == "start-up" and f.detail["odd_ranks"] == [] and f.detail["stopped_by"] == "SIGTERM"


def test_run_stopped_before_any_rank_was_launched_writes_the_report(tmp_path):
    from distcheck.commands.run import stopped_before_launch
    from distcheck.options import RunOptions

    (tmp_path / "trace-rank1.jsonl").write_text("{}\n")  # an earlier run's file in a reused directory
    opts = RunOptions(tmp_path / "train.py", nproc=2, report_dir=str(tmp_path), command="distcheck run")
    report, report_dir = stopped_before_launch(opts, 2, interrupted())
    data = json.loads((report_dir / "report.json").read_text())
    assert not data["ok"] and report.exit_code == 1
    (f,) = data["findings"]
    assert f["kind"] == "hang" and f["ranks"] == [0, 1] and f["detail"]["phase"] == "start-up"
    assert f["message"].endswith("during start-up, after 0.0s: no rank was started, so none of the script ran")
    assert not (tmp_path / "trace-rank1.jsonl").exists()


def test_compare_stopped_before_its_first_run_launches_nothing(tmp_path, monkeypatch):
    from distcheck.options import CompareOptions, RunOptions
    from distcheck.supervise import compare_runs

    def launch(*args, **kwargs):
        raise AssertionError("a run was launched after the stop")

    monkeypatch.setattr(compare_runs, "supervised_run", launch)
    run = RunOptions(tmp_path / "train.py", report_dir=str(tmp_path), command="distcheck compare")
    report, _ = compare_runs.compare(CompareOptions(run, (2,)), interrupted())
    assert not report.ok
    (f,) = report.findings
    assert f.kind == "hang" and f.detail["stopped_by"] == "SIGTERM" and f.detail["phase"] == "start-up"
    assert f.message.startswith("reference run (1 rank): the run was stopped from outside by SIGTERM during "
                                "start-up")
    notes = {c.name: c.note for c in report.checks}
    assert notes["2-rank run"] == "not run: stopped from outside by SIGTERM"
    assert os.path.exists(tmp_path / "report.json")


def test_start_up_lasts_until_some_rank_completed_a_collective(tmp_path):
    from distcheck.contract import trace_slots as tr

    def loop() -> WatchLoop:
        return WatchLoop(tmp_path, 30.0, source=RankFunctions(dict), expected=2)

    for r in (0, 1):
        write_trace(tmp_path, r)
    assert loop().progress.none_completed()  # traces, no collective
    issued = tr.header(3) + tr.SLOT.pack(1, 0, 1, 1.0, 0.0)
    for r in (0, 1):
        (tmp_path / f"trace-rank{r}.bin").write_bytes(issued)
    assert loop().progress.none_completed()  # each issued its first one, none completed
    pending = tr.SLOT.pack(1, 0, 1, 1.0, 0.0)
    (tmp_path / "trace-rank1.bin").write_bytes(issued + pending * 45000 + tr.SLOT.pack(1, 0, 1, 1.0, 2.0))
    assert not loop().progress.none_completed()  # found past the first chunk of records too
    (tmp_path / "trace-rank1.bin").write_bytes(issued + pending * 45000)
    assert loop().progress.none_completed()
    (tmp_path / "trace-rank1.bin").write_bytes(issued)
    (tmp_path / "flight-rank0.status").write_text("3\n")  # torch's ring completed some (DDP's buckets)
    assert not loop().progress.none_completed()


def test_a_signal_that_reached_the_ranks_too_is_not_said_to_have_stopped_nothing():
    """Ctrl-C in a terminal reaches the whole process group: the ranks raise KeyboardInterrupt themselves."""
    report = passed_report(note="")
    report.checks[1].ok = False
    report.findings.append(Finding("rank_failure", [0, 1], "ranks 0-1 raised KeyboardInterrupt:  at t.py:4",
                                   {"exception": "KeyboardInterrupt"}))
    assert settle(report, interrupted("SIGINT"))
    (w,) = report.warnings
    assert w.ranks == [0, 1] and "reached the ranks too" in w.message and "stopped nothing" not in w.message
    assert not report.ok
