"""``distcheck.check_model`` on real torchrun ranks: the cross-rank part (merged ranks, drift, live mesh checks).
The placement dump and coverage rules on torch's fake process group are in tests/unit/test_placement.py."""
from __future__ import annotations

from distcheck.rank import sink
from launch_helpers import FIXTURES, torchrun


def test_check_model_under_torchrun_unwrapped_root(tmp_path):
    res = torchrun([str(FIXTURES / "placement_unwrapped_root.py")], nproc=2, timeout=150,
                   env={"DISTCHECK_REPORT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.output
    found = sink.collect(tmp_path)
    uncovered = [(f.detail["params"], f.ranks) for f in found if f.kind == "uncovered_param"]
    assert uncovered == [(["scale", "head.weight", "head.bias"], [0, 1])]  # one cause, merged over the ranks
    drifted = {f.detail.get("name", f.message.split("'")[1]) for f in found if f.kind == "tensor_divergence"}
    assert {"scale", "head.weight", "head.bias"} <= drifted
    assert not any(f.kind == "tensor_divergence" and "blocks" in f.message for f in found)


def test_check_model_under_torchrun_fsdp_tp_4_ranks(tmp_path):
    res = torchrun([str(FIXTURES / "placement_fsdp_tp_ok.py")], nproc=4, timeout=180,
                   env={"DISTCHECK_REPORT_DIR": str(tmp_path)})
    assert res.returncode == 0, res.output
    assert "0 findings" in res.stdout and sink.collect(tmp_path) == []
