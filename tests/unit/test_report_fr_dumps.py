"""``distcheck report DUMPS``: a folder or prefix of torch's Flight Recorder dumps gives the same report.txt,
report.json and ``--format github`` as every report, exit 1 on a finding, 0 when clean, 2 on bad input with one
line naming the problem and the fix.

    .venv/bin/python -m pytest -q tests/unit/test_report_fr_dumps.py
"""
from __future__ import annotations

import json

import pytest

from fr_dump_builder import Ring, world, write

from distcheck.contract.report import contract_problem


def hung_job(folder, n=3):
    """Ranks 0-1 wait in all_reduce #3 at train.py:12; rank 2 never issued it."""
    for rank in range(n):
        ring = Ring(rank, world(n))
        ring.coll("all_reduce", line=10)
        ring.coll("all_reduce", line=10)
        if rank < n - 1:
            ring.coll("all_reduce", line=12, state="started")
        write(folder, ring)
    return folder


def test_a_hung_job_gives_a_report_and_exit_1(tmp_path, cli):
    dumps = hung_job(tmp_path / "dumps")
    res = cli(["report", str(dumps / "rank_"), "--report-dir", str(tmp_path / "out")])
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith("distcheck FAILED (1 finding)")
    assert "[hang] rank 2: ranks 0-1 wait in all_reduce #3" in res.stdout
    assert f"report: {tmp_path / 'out' / 'report.json'}" in res.stdout
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert contract_problem(data) is None and data["ok"] is False and data["world_size"] == 3
    assert data["findings"][0]["kind"] == "hang" and data["findings"][0]["ranks"] == [2]
    assert data["findings"][0]["detail"]["line"] == 10
    assert data["flight_recorder"]["dumps"] == 3 and data["command"].startswith("distcheck report ")
    assert (tmp_path / "out" / "report.txt").read_text() == res.stdout


def test_json_and_github_formats(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    dumps = hung_job(tmp_path / "dumps")
    res = cli(["report", str(dumps), "--format", "json", "--report-dir", str(tmp_path / "j")])
    assert res.returncode == 1 and json.loads(res.stdout)["findings"][0]["ranks"] == [2]
    res = cli(["report", str(dumps), "--format", "github", "--report-dir", str(tmp_path / "g")])
    assert res.returncode == 1
    assert res.stdout.startswith("::error file=/job/train.py,line=10::[hang] ranks 0-1 wait in all_reduce #3")


def test_a_clean_job_exits_0_and_the_default_report_dir_is_a_new_one_here(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for rank in range(2):
        ring = Ring(rank, world(2))
        ring.coll("all_reduce", line=10)
        write(tmp_path / "dumps", ring)
    res = cli(["report", "dumps/"])
    assert res.returncode == 0 and res.stdout.startswith("distcheck PASSED"), res.stdout
    made = list(tmp_path.glob("distcheck-report-*/report.json"))
    assert len(made) == 1 and json.loads(made[0].read_text())["ok"] is True
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["rank_0", "rank_1"]  # left as it was


@pytest.mark.parametrize("target, says", [
    ("nothere/rank_", "is neither a directory nor a prefix of Flight Recorder dumps"),
    ("dumps/other_", "is neither a directory nor a prefix of Flight Recorder dumps"),
    ("empty", "holds neither report.json nor Flight Recorder dumps"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, cli, monkeypatch, target, says):
    monkeypatch.chdir(tmp_path)
    hung_job(tmp_path / "dumps")
    (tmp_path / "empty").mkdir()
    res = cli(["report", target])
    assert res.returncode == 2 and says in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not list(tmp_path.glob("distcheck-report-*"))  # nothing written for bad input


def test_dumps_and_report_dirs_are_not_mixed(tmp_path, cli):
    from distcheck.contract.report import Report, publish

    (tmp_path / "rep").mkdir()
    publish(Report(command="distcheck run", world_size=2), tmp_path / "rep")
    dumps = hung_job(tmp_path / "dumps")
    res = cli(["report", str(tmp_path / "rep"), str(dumps)])
    assert res.returncode == 2 and "not both" in res.stderr


def test_the_folders_of_several_nodes_are_one_job(tmp_path, cli):
    dumps = hung_job(tmp_path / "all")
    (tmp_path / "nodeB").mkdir()
    (dumps / "rank_2").rename(tmp_path / "nodeB" / "rank_2")
    res = cli(["report", str(dumps), str(tmp_path / "nodeB"), "--report-dir", str(tmp_path / "out")])
    assert res.returncode == 1 and "[hang] rank 2:" in res.stdout
    res = cli(["report", str(dumps), str(dumps), "--report-dir", str(tmp_path / "out2")])  # read once
    assert res.returncode == 1 and "2 ring(s)" in res.stdout and "rank 2 left no dump" in res.stdout
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "rank_0").write_bytes((dumps / "rank_0").read_bytes())
    res = cli(["report", str(dumps), str(tmp_path / "again"), "--report-dir", str(tmp_path / "out3")])
    assert res.returncode == 2 and "rank 0 has dumps in both" in res.stderr
