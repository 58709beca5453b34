"""Real Flight Recorder dumps of jobs distcheck never saw: plain ``torchrun --standalone`` gloo jobs that dump their
rings with torch's own call (fixtures/fr_dump_hang.py at its hang, fixtures/fr_dump_ok.py at its end), then
``distcheck report DUMPS`` in a process of its own. Every launch has a timeout and ends with its process group
killed (launch_helpers.run_python).

    .venv/bin/python -m pytest -q tests/integration/test_fr_postmortem_live.py
"""
from __future__ import annotations

import json

from launch_helpers import FIXTURES, FRESH, distcheck, run_python, torchrun


def job(tmp_path, fixture: str, timeout: float = 150):
    dumps = tmp_path / "dumps"
    res = torchrun([str(FIXTURES / fixture)], nproc=2, timeout=timeout, cwd=tmp_path,
                   env={**FRESH, "TORCH_FR_DUMP_TEMP_FILE": str(dumps / "rank_")})
    return res, dumps


def test_the_dumps_of_a_hung_job_name_both_lines(tmp_path, line_of):
    res, dumps = job(tmp_path, "fr_dump_hang.py")
    assert res.returncode != 0, res.output  # the job hung: gloo's timeout ended it
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"], res.output
    report = distcheck(["report", str(dumps), "--report-dir", str(tmp_path / "out"), "--format", "json"],
                       timeout=60)
    assert report.returncode == 1, report.output
    data = json.loads(report.stdout)
    assert data == json.loads((tmp_path / "out" / "report.json").read_text())
    [f] = data["findings"]
    line0 = line_of("fr_dump_hang.py", "BUG (rank 0 side)")
    line1 = line_of("fr_dump_hang.py", "BUG (rank 1 side)")
    assert f["kind"] == "collective_mismatch" and f["ranks"] == [0, 1], f
    assert f["detail"]["position"] == 4 and f["detail"]["fields"] == ["op"]
    assert f["detail"]["file"].endswith("fr_dump_hang.py") and f["detail"]["line"] == line0
    assert f"rank 0 issued all_reduce #4 [[16]] float32 at fr_dump_hang.py:{line0}" in f["message"]
    assert f"rank 1 issued broadcast #4 [[16]] float32 at fr_dump_hang.py:{line1}" in f["message"]
    # What torch's own analyzer makes of the same files (the fixture's "symptom without distcheck").
    torch_says = run_python(["-m", "torch.distributed.flight_recorder.fr_trace", str(dumps), "-p", "rank_"],
                            timeout=60)
    assert torch_says.returncode != 0 and "KeyError: ('0', 0)" in torch_says.stderr


def test_the_dumps_of_a_correct_job_give_no_finding(tmp_path):
    res, dumps = job(tmp_path, "fr_dump_ok.py")
    assert res.returncode == 0, res.output
    report = distcheck(["report", f"{dumps}/rank_", "--report-dir", str(tmp_path / "out")], timeout=60)
    assert report.returncode == 0, report.output
    assert report.stdout.startswith("distcheck PASSED") and "2 ring(s), 1 group(s), 32 entries" in report.stdout
