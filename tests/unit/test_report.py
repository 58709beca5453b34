"""report.json / report.txt contract and atomic writing."""
import json
from pathlib import Path

import pytest

from distcheck.errors import UsageError
from distcheck.contract.findings import (
    CheckResult, Finding, format_ranks, parse_rank_ranges, per_rank, rank_ranges, ranks_keyed,
)
from distcheck.contract.report import Report, load_report, prepare_report_dir, render_text, publish


def make_report():
    return Report("distcheck consistency", 2,
                  [Finding("tensor_divergence", [1], "parameter 'w' differs", {"name": "w", "x": (1, 2)})],
                  [CheckResult("model_consistency", False, 0.1234), CheckResult("environment", True, 0.01)])


def test_json_contract(tmp_path):
    report = make_report()
    publish(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert set(data) >= {"tool", "version", "command", "ok", "world_size", "findings", "checks", "artifacts"}
    assert data["tool"] == "distcheck" and data["ok"] is False and data["world_size"] == 2
    assert data["findings"][0] == {"kind": "tensor_divergence", "ranks": [1], "message": "parameter 'w' differs",
                                   "detail": {"name": "w", "x": [1, 2]}}
    assert data["checks"][0] == {"name": "model_consistency", "ok": False, "seconds": 0.1234}
    assert data["artifacts"]["report.txt"] == "report.txt"
    assert load_report(tmp_path).findings[0].ranks == [1]
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind


def test_text_has_verdict_checks_findings():
    text = render_text(make_report())
    assert text.startswith("distcheck FAILED (1 finding)")
    assert "FAIL model_consistency" in text and "[tensor_divergence] rank 1: parameter 'w' differs" in text
    assert render_text(Report("x", 1)).startswith("distcheck PASSED")


def test_unknown_kind_rejected_and_rank_formatting():
    with pytest.raises(ValueError):
        Finding("not_a_kind", [0], "m")
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"
    assert format_ranks([3]) == "rank 3"


def test_rank_ranges_round_trip_and_big_per_rank_maps_share_keys():
    assert rank_ranges([5, 0, 1, 2, 7, 8, 2]) == "0-2,5,7-8" and rank_ranges([]) == ""
    assert parse_rank_ranges("0-2,5,7-8") == [0, 1, 2, 5, 7, 8] and parse_rank_ranges("3") == [3]
    # Up to SMALL_WORLD ranks a per-rank map keeps one key per rank (what report.json always had).
    assert ranks_keyed({1: "a", 0: "a"}, str) == {"0": "a", "1": "a"}
    # Above, ranks with the same value share one entry, keyed by their rank ranges, in order of their first rank.
    values = {r: ("slow" if r in (3, 4, 90) else "ok") for r in range(100)}
    keyed = ranks_keyed(values, lambda v: {"state": v})
    assert keyed == {"0-2,5-89,91-99": {"state": "ok"}, "3-4,90": {"state": "slow"}}
    assert per_rank(keyed) == {r: {"state": v} for r, v in values.items()}
    assert per_rank({"0": 1, "1": 2}) == {0: 1, 1: 2}


def test_unwritable_report_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="not writable.*--report-dir"):
        prepare_report_dir(blocker / "sub")
    assert prepare_report_dir(tmp_path / "new" / "dir").is_dir()


def test_nan_in_detail_stays_valid_json(tmp_path):
    report = Report("x", 1, [Finding("bad_values", [0], "nan", {"v": float("nan")})])
    publish(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["findings"][0]["detail"]["v"] == "nan"


def test_report_files_follow_the_umask_and_default_dirs_are_unique(tmp_path, monkeypatch):
    import os
    import stat

    from distcheck.contract.report import Report, default_report_dir, publish

    publish(Report("distcheck run", 2), tmp_path)
    mask = os.umask(0)
    os.umask(mask)
    for name in ("report.json", "report.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask
    monkeypatch.chdir(tmp_path)
    assert default_report_dir(0.0) != default_report_dir(0.0, suffix=1)  # same second, two commands
    assert default_report_dir(0.0).name.endswith(f"-{os.getpid()}")


def test_clear_shared_removes_only_distchecks_earlier_report(tmp_path):
    from distcheck.contract import files

    for name in ("report.json", "report.txt", "trace.json", "stacks.txt", "stacks.json", "notes.txt", "model.pt"):
        (tmp_path / name).write_text("x")
    files.clear_shared(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "notes.txt"]


def test_a_full_report_disk_is_bad_input_and_leaves_no_probe_file(tmp_path, monkeypatch):
    """On a full file system the probe file is created and its write then fails (ENOSPC): the refusal names the
    fix, and the empty probe is not left in the user's directory."""
    import errno
    from pathlib import Path

    def full(self, *args, **kwargs):
        self.touch()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(UsageError, match="No space left on device.*--report-dir"):
        prepare_report_dir(tmp_path / "full")
    assert list((tmp_path / "full").iterdir()) == []


def test_every_report_leaves_through_publish():
    """One report path: contract/report.publish is the only caller of the writer, and no module outside contract/
    deletes report.json or report.txt itself (remove_report, files.clear_shared)."""
    import ast

    pkg = Path(__file__).resolve().parents[2] / "distcheck"
    wrong = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                calls = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
                         for n in ast.walk(node) if isinstance(n, ast.Call)}
                names = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)} | \
                    {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if "_write_files" in calls and (rel, node.name) != ("contract/report.py", "publish"):
                    wrong.append(f"{rel}: {node.name} calls the report writer")
                if "unlink" in calls and names & {"report.json", "report.txt", "REPORT_JSON", "REPORT_TXT"} \
                        and not rel.startswith("contract/"):
                    wrong.append(f"{rel}: {node.name} deletes report files")
    assert not wrong, "\n".join(wrong)


def test_publish_writes_prints_and_can_print_only(tmp_path):
    import io

    from distcheck.contract.report import publish, remove_report

    out = io.StringIO()
    assert publish(Report("distcheck run", 2), tmp_path, echo=out) == tmp_path / "report.json"
    assert (tmp_path / "report.txt").read_text() == out.getvalue() and "PASSED" in out.getvalue()
    again = io.StringIO()
    report = Report("distcheck run", 2, [Finding("hang", [1], "stuck")])
    assert publish(report, tmp_path, echo=again, write=False) is None  # printed, the files are the first report
    assert "FAILED" in again.getvalue() and "PASSED" in (tmp_path / "report.txt").read_text()
    remove_report(tmp_path)
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "report.txt").exists()
