"""Wrappers found by what happens to the model, not by how it was called (issue 48, items 2 and 3a).

    .venv/bin/python -m pytest -q tests/integration/test_wrappers_by_effect.py

A DDP model whose training step calls ``model.module(x)`` never runs DDP's own forward: it is checked at the first
optimizer.step(), its replicas drift, and the finding names the bypassing line. An optimizer built before the call
that replaced its parameters is named with both lines. Their correct twins are in fixtures/ok/ (the corpus test).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_helpers import FIXTURES, distcheck, load_report


def run_fixture(tmp_path: Path, fixture: str, *args: str) -> tuple:
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "30", "--report-dir", str(out), "--",
                     str(FIXTURES / fixture), *args], timeout=150)
    return res, load_report(out)


def only(report: dict, kind: str) -> dict:
    assert [f["kind"] for f in report["findings"]] == [kind], json.dumps(report["findings"], indent=1)
    return report["findings"][0]


def test_a_step_around_ddp_drifts_and_names_the_bypassing_line(line_of, tmp_path):
    """model.module(x) in the training step: PASSED before ("no model passed to ... DDP"); now found and named."""
    res, report = run_fixture(tmp_path, "ddp_module_bypassed.py")
    assert res.returncode == 1, res.output
    f = only(report, "tensor_divergence")
    bug, step = line_of("ddp_module_bypassed.py", "# BUG"), line_of("ddp_module_bypassed.py", "# STEP")
    assert f["ranks"] == [0, 1] and f["detail"]["cause"] == "ddp_bypassed" and f["detail"]["step"] == 0
    assert f["detail"]["file"].endswith("ddp_module_bypassed.py") and f["detail"]["line"] == bug
    assert f["detail"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert f"after the first optimizer.step() (ddp_module_bypassed.py:{step})" in f["message"]
    assert f"called the wrapped module directly at ddp_module_bypassed.py:{bug}" in f["message"]
    assert "call model(x), not model.module(x)" in f["message"].lower()
    check = next(c for c in report["checks"] if c["name"] == "model_check")
    assert "DistributedDataParallel(Sequential) (at the first optimizer.step())" in check["note"]


@pytest.mark.parametrize("variant,call", [("", "fully_shard(...)"), ("--fsdp1", "FullyShardedDataParallel(...)"),
                                          ("--tp", "parallelize_module(...)")])
def test_an_optimizer_built_before_its_parameters_were_replaced_names_both_lines(line_of, tmp_path, variant, call):
    """Was: "every gradient was None ... or an optimizer over another model's parameters" at the step's line."""
    fixture = "optimizer_before_fully_shard.py"
    res, report = run_fixture(tmp_path, fixture, *([variant] if variant else []))
    assert res.returncode == 1, res.output
    f = only(report, "bad_values")
    built = line_of(fixture, "# BUG")
    wrapped = line_of(fixture, f"# WRAP {(variant or '--fsdp2').removeprefix('--')}")
    assert f["ranks"] == [0, 1] and f["detail"]["cause"] == "built_before_wrap"
    assert f["detail"]["file"].endswith(fixture) and f["detail"]["line"] == built
    assert f["detail"]["wrap_call"] == call and f["detail"]["wrap_site"][1] == wrapped
    assert (f"the optimizer was built at {fixture}:{built}, before {call} at {fixture}:{wrapped} replaced"
            in f["message"]), f["message"]
    assert "another model's parameters" not in f["message"]
