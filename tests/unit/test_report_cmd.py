"""``distcheck report DIR [DIR ...] [--format text|json|github]``: printing, annotations, merging per-node stacks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distcheck.analysis.stack_groups import Frame, RankStack, ThreadStack
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, publish
from distcheck.supervise.stacks import DumpError, write_stack_artifacts

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def make_dir(path: Path, findings: list[Finding], ok_check: bool = True, command: str = "distcheck run") -> Path:
    path.mkdir(parents=True)
    publish(Report(command=command, world_size=2, findings=findings,
                        checks=[CheckResult("collectives", ok_check, 0.5)]), path)
    return path


def test_text_and_json_of_one_dir(tmp_path, cli):
    d = make_dir(tmp_path / "r", [Finding("collective_mismatch", [1], "rank 1 issued all_gather (a.py:3)",
                                          {"file": str(tmp_path / "a.py"), "line": 3})])
    res = cli(["report", str(d)])
    assert res.returncode == 1
    assert res.stdout.startswith("distcheck FAILED (1 finding)")
    assert "[collective_mismatch] rank 1: rank 1 issued all_gather (a.py:3)" in res.stdout
    res = cli(["report", str(d), "--format", "json"])
    data = json.loads(res.stdout)
    assert res.returncode == 1 and data["findings"][0]["detail"]["line"] == 3 and data["ok"] is False
    ok = make_dir(tmp_path / "ok", [])
    assert cli(["report", str(ok)]).returncode == 0


def test_github_annotations(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    d = make_dir(tmp_path / "r", [
        Finding("hang", [1], "rank 1 is in load_shard (train.py:41) while rank 0 waits in all_reduce #2",
                {"file": str(tmp_path / "src" / "train.py"), "line": 41}),
        Finding("env_mismatch", [0, 1], "torch differs: 100% sure\nsecond line", {}),
        Finding("bad_values", [0], "NaN in w", {"file": "/elsewhere/a,b:c.py", "line": 7}),
    ])
    res = cli(["report", str(d), "--format", "github"])
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        "::error file=src/train.py,line=41::[hang] rank 1 is in load_shard (train.py:41) while rank 0 waits in "
        "all_reduce #2",
        "::error::[env_mismatch] torch differs: 100%25 sure%0Asecond line",
        "::error file=/elsewhere/a%2Cb%3Ac.py,line=7::[bad_values] NaN in w",
    ]
    failed_check = make_dir(tmp_path / "c", [], ok_check=False)
    assert cli(["report", str(failed_check), "--format", "github"]).stdout == "::error::check collectives failed\n"


def node_dir(root: Path, name: str, host: str, where: dict[int, tuple[str, int]], world_size: int = 4) -> Path:
    """A per-node `distcheck stacks --report-dir` output: ranks in all_reduce at train.py:88 unless told otherwise."""
    d = root / name
    d.mkdir()
    stacks = []
    for rank, (func, line) in where.items():
        frames = [Frame(func, "/p/train.py", line), Frame("main", "/p/train.py", 120), Frame("<module>", "/p/train.py", 130)]
        if func == "train_step":
            frames.insert(0, Frame("all_reduce", TORCH, 2806))
        stacks.append(RankStack(rank, 100 + rank, host, "py-spy", [ThreadStack(str(100 + rank), "MainThread", frames, True)],
                                world_size=world_size))
    errors = [DumpError(999, "no_such_process", "pid 999: no such process (it is not running)")]
    artifacts = write_stack_artifacts(d, stacks, errors, title=f"distcheck stacks on {host}")
    publish(Report(command=f"distcheck stacks (on {host})", world_size=4, artifacts=artifacts), d)
    return d


def test_merge_per_node_stacks_finds_the_odd_rank_across_nodes(tmp_path, cli):
    # On its own node rank 3 ties with rank 2 (nothing singled out); across the job it is the odd one.
    a = node_dir(tmp_path, "node-a", "a", {0: ("train_step", 88), 1: ("train_step", 88)})
    b = node_dir(tmp_path, "node-b", "b", {2: ("train_step", 88), 3: ("load_shard", 41)})
    res = cli(["report", str(a), str(b), "--format", "json"])
    assert res.returncode == 1, res.output
    merged = json.loads(res.stdout)
    (f,) = merged["findings"]
    assert f["kind"] == "hang" and f["ranks"] == [3]
    assert f["message"] == "rank 3 is in load_shard (train.py:41) while ranks 0-2 wait in all_reduce (train.py:88)"
    assert f["detail"]["file"] == "/p/train.py" and f["detail"]["line"] == 41
    assert f["detail"]["merged_from"] == [str(a), str(b)] and merged["world_size"] == 4
    assert sorted(f["detail"]["stacks"]) == ["0", "1", "2", "3"]
    assert {s["host"] for s in f["detail"]["stacks"].values()} == {"a", "b"}
    text = cli(["report", str(a), str(b)]).stdout
    assert "merged stacks of 2 node(s): a, b" in text and "!! rank 3 (1)" in text
    gh = cli(["report", str(a), str(b), "--format", "github"]).stdout
    assert gh.startswith("::error file=/p/train.py,line=41::[hang] rank 3 is in load_shard")


def test_merge_of_nodes_all_in_one_place_passes(tmp_path, cli):
    a = node_dir(tmp_path, "a", "a", {0: ("train_step", 88)})
    b = node_dir(tmp_path, "b", "b", {1: ("train_step", 88)})
    res = cli(["report", str(a), str(b)])
    assert res.returncode == 0, res.output
    assert "distcheck PASSED" in res.stdout


def test_bad_input_exits_2_with_one_line(tmp_path, cli):
    res = cli(["report", str(tmp_path / "missing")])
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "is neither a directory nor a prefix" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = cli(["report", str(empty)])
    assert res.returncode == 2 and "holds neither report.json nor Flight Recorder dumps" in res.stderr
    ok = make_dir(tmp_path / "ok", [])
    res = cli(["report", str(ok), "--format", "xml"])
    assert res.returncode == 2 and res.stderr.strip() == (
        "distcheck: error: --format 'xml' is not supported: use one of text, json, github")
    a = node_dir(tmp_path, "na", "a", {0: ("train_step", 88)})
    b = node_dir(tmp_path, "nb", "b", {1: ("train_step", 88)})
    (b / "stacks.json").write_text(json.dumps({"format": "something-else"}))
    res = cli(["report", str(a), str(b)])
    assert res.returncode == 2 and "is not a valid stack dump" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("document,problem", [
    ({}, "'tool' must be \"distcheck\""),
    ([1, 2], "the top level must be an object, not list"),
    ({"tool": "distcheck", "version": "0", "command": "c", "ok": True, "world_size": 2, "findings": "x",
      "checks": [], "artifacts": {}}, "'findings' must be list, not str"),
    ({"tool": "distcheck", "version": "0", "command": "c", "ok": True, "world_size": 2,
      "findings": [{"kind": "oops", "ranks": [0], "message": "m", "detail": {}}], "checks": [], "artifacts": {}},
     "findings[0].kind 'oops' is not one of the contract's kinds"),
    ({"tool": "distcheck", "version": "0", "command": "c", "ok": True, "world_size": 2,
      "findings": [{"kind": "hang", "ranks": [0], "message": "m", "detail": {}}], "checks": [], "artifacts": {}},
     "'ok' is true although it holds findings"),
    ({"tool": "distcheck", "version": "0", "command": "c", "ok": True, "world_size": 2, "findings": [],
      "checks": [{"name": "x"}], "artifacts": {}}, "checks[0] must be an object with 'name'"),
])
def test_a_report_json_off_the_contract_is_exit_2_naming_the_field_never_passed(tmp_path, cli, document, problem):
    (tmp_path / "report.json").write_text(json.dumps(document))
    res = cli(["report", str(tmp_path)])
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "PASSED" not in res.stdout
    assert "is not a distcheck report: " + problem in res.stderr and "Traceback" not in res.stderr


def partial_node_report(root: Path, host: str, rank: int, other: int, func: str, line: int,
                        extra: list[Finding] = ()) -> Path:
    """What each node wrote on its own before the exchange (issue 26): its rank's stacks, the hang seen from there,
    and a rank_failure for the other node's rank, whose files it could not see ("ended without finishing")."""
    d = node_dir(root, f"node-{host}", host, {rank: (func, line)}, world_size=2)
    report = json.loads((d / "report.json").read_text())
    report["command"] = "distcheck run --timeout 8 -- train.py"
    report["world_size"] = 2
    report["ok"] = False
    report["findings"] = [
        Finding("rank_failure", [other], f"rank {other} ended without finishing its script: os._exit or a signal "
                f"(exit code None)", {"exit_code": None, "signal": None}).to_json(),
        Finding("hang", [rank], f"no progress for 8s: rank {rank} is in {func}; rank {other} not found", {}).to_json(),
        *[f.to_json() for f in extra]]
    report["checks"] = [{"name": "collective_order", "ok": True, "seconds": 8.9},
                        {"name": "ranks_completed", "ok": False, "seconds": 0.0, "note": "no progress for 8s"}]
    report["artifacts"][f"trace-rank{rank}"] = f"trace-rank{rank}.jsonl"
    report["ranks"] = {str(rank): {"state": "hung", "exit_code": None, "signal": None},
                       str(other): {"state": "died", "exit_code": None, "signal": None}}
    (d / "report.json").write_text(json.dumps(report))
    return d


def test_merge_of_per_node_reports_lists_each_check_once_and_drops_contradicted_failures(tmp_path, cli):
    a = partial_node_report(tmp_path, "a", 0, 1, "train_step", 88)
    b = partial_node_report(tmp_path, "b", 1, 0, "load_shard", 41)
    res = cli(["report", str(a), str(b), "--format", "json"])
    assert res.returncode == 1, res.output
    merged = json.loads(res.stdout)
    assert [c["name"] for c in merged["checks"]] == ["collective_order", "ranks_completed"]
    assert [c["ok"] for c in merged["checks"]] == [True, False]
    (hang,) = merged["findings"]  # both nodes' "rank N ended without finishing" are contradicted: both were dumped
    assert hang["kind"] == "hang" and hang["ranks"] == [1]
    assert hang["message"] == "rank 1 is in load_shard (train.py:41) while rank 0 waits in all_reduce (train.py:88)"
    text = cli(["report", str(a), str(b)]).stdout
    assert text.count("ranks_completed") == 1 and "rank_failure" not in text and "not found" not in text


def test_merge_keeps_a_failure_the_merged_view_confirms(tmp_path, cli):
    # Rank 1 raised on its own node (a traceback, first-hand): kept, whatever the other node saw.
    raised = Finding("rank_failure", [1], "rank 1 raised ValueError: bad sample at train.py:41",
                     {"exception": "ValueError", "file": "/p/train.py", "line": 41})
    a = partial_node_report(tmp_path, "a", 0, 1, "train_step", 88)
    b = partial_node_report(tmp_path, "b", 1, 0, "load_shard", 41, extra=[raised])
    kinds = [(f["kind"], f["ranks"]) for f in json.loads(cli(["report", str(a), str(b), "--format", "json"]).stdout)
             ["findings"]]
    assert kinds == [("hang", [1]), ("rank_failure", [1])]
    # Rank 1 died on its own node (its report holds its trace and says died, and no dump shows it): kept.
    c = make_dir(tmp_path / "c", [Finding("rank_failure", [1], "rank 1 died from SIGKILL", {"signal": "SIGKILL"})])
    report = json.loads((c / "report.json").read_text())
    report["artifacts"]["trace-rank1"] = "trace-rank1.jsonl"
    report["ranks"] = {"1": {"state": "died", "exit_code": -9, "signal": "SIGKILL"}}
    (c / "report.json").write_text(json.dumps(report))
    d = make_dir(tmp_path / "d", [Finding("rank_failure", [1], "rank 1 ended without finishing its script", {})])
    merged = json.loads(cli(["report", str(c), str(d), "--format", "json"]).stdout)
    assert [f["message"] for f in merged["findings"]] == ["rank 1 died from SIGKILL",
                                                          "rank 1 ended without finishing its script"]
