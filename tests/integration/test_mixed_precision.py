"""Issue 30: compare's tolerances follow the precision the model computes in. Correct bf16/fp16 programs pass with
the default flags (SGD and AdamW), and a summed loss or a missing gradient all-reduce still fails at bf16."""
from __future__ import annotations

import pytest

from launch_helpers import FIXTURES, distcheck, load_report

FIXTURE = "cmp_mixed_precision.py"


def compare(tmp_path, args: list[str]):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), "--",
                     str(FIXTURES / FIXTURE), *args], timeout=240)
    return res, load_report(out)


# fixtures/ok/ compares ddp_autocast with SGD and the two FSDP2 policies with AdamW: the other optimizer here.
@pytest.mark.parametrize("args,dtype,source", [
    (["--setup", "ddp_autocast", "--opt", "adamw"], "bfloat16", "torch.autocast(cpu, bfloat16)"),
    (["--setup", "fsdp2_bf16", "--opt", "sgd"], "bfloat16", "MixedPrecisionPolicy(param_dtype=bfloat16)"),
    (["--setup", "fsdp2_bf16_fp32_reduce", "--opt", "sgd"], "bfloat16", "MixedPrecisionPolicy(param_dtype=bfloat16)"),
    (["--setup", "ddp_autocast", "--dtype", "float16", "--opt", "adamw"], "float16", "torch.autocast(cpu, float16)"),
    (["--setup", "ddp_fp16_hook", "--opt", "sgd"], "float16", "DDP comm hook fp16_compress_hook"),
    (["--setup", "ddp_bf16_params", "--opt", "adamw"], "bfloat16", "parameters stored in bfloat16")],
    ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_correct_mixed_precision_passes_and_says_which_tolerance(tmp_path, args, dtype, source):
    res, report = compare(tmp_path, args)
    assert res.returncode == 0, res.output
    assert report["findings"] == []
    rows = report["records"]["2"]
    assert rows and all(r["status"] == "ok" for r in rows)
    floats = [r["tolerance"] for r in rows]
    assert all(t["rule"] == "norm-wise" and t["rtol"] == (2e-2 if dtype == "bfloat16" else 4e-3) for t in floats)
    assert all(f"computed in {dtype}" in t["why"] and source in t["why"] for t in floats), floats
    assert f"tolerance: norm-wise rtol" in res.output and source in res.output


def test_loss_summed_instead_of_averaged_fails_at_bf16(line_of, tmp_path):
    res, report = compare(tmp_path, ["--bug", "loss_sum"])
    assert res.returncode == 1, res.output
    f = next(f for f in report["findings"] if f["kind"] == "reference_mismatch")
    line = line_of(FIXTURE, "loss.backward()")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line and f"{FIXTURE}:{line}" in f["message"]
    assert "norm-wise rel err 0.5 against norm-wise rtol 0.02" in f["message"]
    assert "1/2 of the reference" in f["message"]


def test_missing_gradient_allreduce_fails_at_bf16_and_names_no_factor(line_of, tmp_path):
    res, report = compare(tmp_path, ["--bug", "no_allreduce"])
    assert res.returncode == 1, res.output
    f = next(f for f in report["findings"] if f["kind"] == "reference_mismatch")
    line = line_of(FIXTURE, "opt.step()")
    assert f["ranks"] == [0, 1] and f["detail"]["line"] == line and f"{FIXTURE}:{line}" in f["message"]
    assert "gradient of parameter '0.weight'" in f["message"] and "norm-wise rtol 0.02" in f["message"]
    # the gradients are about 2x here by chance of the batch, not by a sum over 2 ranks: the ratio decides the words
    assert "not divided by 2" not in f["message"] or "they are 2x the reference" in f["message"]
    drift = [f for f in report["findings"] if f["kind"] == "tensor_divergence" and f["detail"].get("cause") == "no_sync"]
    assert drift and drift[0]["detail"]["line"] == line_of(FIXTURE, "with sync:")
