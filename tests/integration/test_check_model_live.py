"""``distcheck.check_model`` on real ranks: the cross-rank part (merged ranks, drift, live mesh checks).
The placement dump and coverage rules on torch's fake process group are in tests/unit/test_placement.py."""
from __future__ import annotations

from distcheck.contract import findings_file
from launch_helpers import FIXTURES, distcheck, load_report, plain_ranks
from test_mesh_live import findings_count


def test_check_model_in_plain_ranks_unwrapped_root(tmp_path):
    """distcheck.check_model called by the script, in ranks distcheck did not start (torchrun's environment)."""
    res = plain_ranks([str(FIXTURES / "placement_unwrapped_root.py")], nproc=2, timeout=150,
                      env={"DISTCHECK_REPORT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.output
    found = findings_file.collect(tmp_path)
    uncovered = [(f.detail["params"], f.ranks) for f in found if f.kind == "uncovered_param"]
    assert uncovered == [(["scale", "head.weight", "head.bias"], [0, 1])]  # one cause, merged over the ranks
    # One cause (the unwrapped root's parameters drift), one finding naming them all.
    [drift] = [f for f in found if f.kind == "tensor_divergence"]
    assert {"scale", "head.weight", "head.bias"} <= set(drift.detail["params"])
    assert drift.detail["count"] == len(drift.detail["params"])
    assert not any("blocks" in p for p in drift.detail["params"])


def test_check_model_on_a_2d_fsdp_tp_mesh_of_4_ranks_finds_nothing(tmp_path):
    """Under `distcheck run --nproc 4`, the fixture's own command: its ranks fork from the test session's zygote,
    where plain torchrun would import torch in 4 fresh interpreters (about 15 s of CPU); check_model's path in
    plain ranks is the test above's."""
    res = distcheck(["run", "--nproc", "4", "--timeout", "120", "--report-dir", str(tmp_path), "--",
                     str(FIXTURES / "placement_fsdp_tp_ok.py")], timeout=180)
    assert res.returncode == 0, res.output
    assert findings_count(res.stdout) == [0], res.output
    assert findings_file.collect(tmp_path) == [] and load_report(tmp_path)["findings"] == []
