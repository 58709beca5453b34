"""The node watcher's report, composed from synthetic evidence (supervise/node_report.py): no rank launched.

    python -m pytest tests/unit/test_node_report.py
"""
from __future__ import annotations

import json
from pathlib import Path

from distcheck.contract import files
from distcheck.contract.findings import CheckResult, Finding, Note
from distcheck.contract.report import Report, publish
from distcheck.supervise.node_report import (ENDED, HANG, NODE0_GONE, RANK0_DIED, STOPPED, Evidence, compose,
                                             deliver)

AGENT = 4242  # torchrun's agent: the ranks' parent, named in their traces


def write_trace(report_dir: Path, rank: int, *, ok: bool | None, raised: str | None = None) -> None:
    """A rank's trace: its meta line, the exception it raised, its exit line (``ok`` None: none, still running)."""
    lines = [{"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "pid": 100 + rank, "ppid": AGENT,
              "t": 1.0, "argv": ["/x/distcheck/__main__.py", "run", "--", "train.py"]}]
    if raised:
        lines.append({"ev": "error", "exc_type": raised, "message": "disk gone", "traceback": "",
                      "site": "train.py:22", "file": "/src/train.py", "line": 22, "t": 2.0})
    if ok is not None:
        lines.append({"ev": "exit", "ok": ok, "code": 0 if ok else 1, "t": 3.0})
    (report_dir / f"trace-rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def evidence(tmp_path: Path, ending: str, **found) -> Evidence:
    return Evidence(ending, tmp_path, tmp_path, 2, 30.0, 5.0, 0.0, **found)


def hang(ranks: list[int]) -> Finding:
    return Finding("hang", ranks, f"no progress for 30s: ranks {ranks} wait in all_reduce at train.py:9",
                   {"line": 9})


def test_a_hang_before_any_trace_is_the_diagnosis_with_the_watchdog_check(tmp_path):
    pub = compose(evidence(tmp_path, HANG, note="no progress for 30s", findings=[hang([0, 1])], check_seconds=1.5))
    assert not pub.report.ok and pub.report.findings == [hang([0, 1])]
    assert pub.report.checks == [CheckResult("watchdog", False, 1.5, note="no progress for 30s")]
    assert files.STACKS_TXT in pub.report.artifacts
    assert pub.out_dir == tmp_path and not pub.to_stdout  # the watcher's diagnoses go to stderr
    assert pub.diagnosis == [hang([0, 1])]


def test_a_hang_of_traced_ranks_names_the_finding_and_the_hung_ranks(tmp_path):
    write_trace(tmp_path, 0, ok=None)
    write_trace(tmp_path, 1, ok=None)
    report = compose(evidence(tmp_path, HANG, note="no progress for 30s", findings=[hang([0, 1])])).report
    assert [f.kind for f in report.findings] == ["hang"]
    assert "train.py:9" in report.findings[0].message
    assert report.data["ranks"]["0"]["state"] == report.data["ranks"]["1"]["state"] == "hung"
    assert report.command == "distcheck run -- train.py"  # from the ranks' argv


def test_a_stop_after_a_ranks_failure_is_the_failure_with_a_warning_where_the_others_were(tmp_path):
    write_trace(tmp_path, 0, ok=None)
    write_trace(tmp_path, 1, ok=False, raised="OSError")
    where = Note("stopped_by_torchrun", [0], "torchrun stopped rank 0 (SIGTERM) after rank 1 failed", {})
    report = compose(evidence(tmp_path, STOPPED, note="rank 1 ended first; torchrun stopped the others",
                              warnings=[where], running={0}, command="distcheck run -- train.py")).report
    assert [(f.kind, f.ranks) for f in report.findings] == [("rank_failure", [1])]
    assert "OSError" in report.findings[0].message
    assert where in report.warnings
    assert report.data["ranks"]["0"]["state"] == "stopped"
    assert report.exit_code == 1


def test_an_ended_run_is_its_verdict_printed_like_run_nproc(tmp_path):
    write_trace(tmp_path, 0, ok=True)
    write_trace(tmp_path, 1, ok=True)
    pub = compose(evidence(tmp_path, ENDED, command="distcheck run -- train.py", agent=AGENT))
    assert pub.report.ok and pub.report.exit_code == 0
    assert pub.to_stdout and pub.diagnosis == []


def test_an_ended_run_counts_only_its_own_agents_ranks(tmp_path):
    write_trace(tmp_path, 0, ok=True)
    write_trace(tmp_path, 1, ok=False, raised="OSError")  # another job's, left in a reused directory
    assert "OSError" in compose(evidence(tmp_path, ENDED, command="distcheck run", agent=AGENT)).report.findings[0].message
    others = compose(evidence(tmp_path, ENDED, command="distcheck run", agent=AGENT + 1)).report
    assert not any("OSError" in f.message for f in others.findings)


def test_a_report_so_far_keeps_what_completed_with_the_diagnosis_instead_of_the_interrupted_check(tmp_path):
    interrupted = Finding("rank_failure", [0], "check replicas was interrupted", {"check": "replicas"})
    kept = Finding("env_mismatch", [1], "rank 1 runs another torch", {})
    publish(Report("distcheck consistency", 2, [interrupted, kept],
                        [CheckResult("replicas", False, 0.0, note="interrupted")]), tmp_path)
    report = compose(evidence(tmp_path, RANK0_DIED, note="rank 0 ended before writing the report",
                              findings=[hang([0])], running=set())).report
    assert [f.message for f in report.findings] == [kept.message, hang([0]).message]
    assert report.checks[-1] == CheckResult("report", False, 0.0, note="rank 0 ended before writing the report")


def test_node_0_gone_reports_only_this_nodes_ranks_in_its_own_folder(tmp_path):
    mine = tmp_path / "node-b"
    mine.mkdir()
    for rank in (0, 1, 2, 3):
        write_trace(tmp_path, rank, ok=None)
    e = Evidence(NODE0_GONE, tmp_path, mine, 4, 30.0, 5.0, 0.0, note="no progress for 30s",
                 findings=[hang([2, 3])], local_ranks={2, 3})
    pub = compose(e)
    assert pub.out_dir == mine
    assert sorted(pub.report.data["ranks"]) == ["2", "3"]
    assert pub.report.checks[-1].name == "ranks_completed"  # the run report's, with the watchdog's note
    assert deliver(pub) == 1 and (mine / files.REPORT_JSON).exists() and not (tmp_path / files.REPORT_JSON).exists()


def test_a_restarted_job_lists_every_attempt_and_writes_the_missing_one(tmp_path, capsys):
    first = tmp_path / "attempt-0"
    first.mkdir()
    write_trace(first, 0, ok=True)
    write_trace(first, 1, ok=False, raised="OSError")
    write_trace(tmp_path, 0, ok=True)
    write_trace(tmp_path, 1, ok=True)
    pub = compose(evidence(tmp_path, ENDED, command="distcheck run -- train.py", agent=AGENT))
    assert [(row["attempt"], row["ok"]) for row in pub.report.data["attempts"]] == [(0, False), (1, True)]
    # compose writes nothing, not even the Perfetto traces its reports list
    assert list(pub.earlier_attempts) == [first] and not (first / files.REPORT_JSON).exists()
    assert files.CHROME_TRACE in pub.report.artifacts and not list(tmp_path.rglob(files.CHROME_TRACE))
    assert deliver(pub) == 0
    assert (first / files.REPORT_JSON).exists() and "distcheck PASSED" in capsys.readouterr().out
    assert (first / files.CHROME_TRACE).exists() and (tmp_path / files.CHROME_TRACE).exists()
