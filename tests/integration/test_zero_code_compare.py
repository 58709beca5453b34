"""Zero-code compare: ``distcheck compare`` on scripts with no ``distcheck.record`` call, on real gloo ranks (1,
then 2) on the zc_cmp_* fixtures (the hooks in-process: tests/unit/test_auto_records.py)."""
from __future__ import annotations

import pytest
from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.analysis.records import load_rank


def compare(tmp_path, fixture: str, extra: list[str] | None = None):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), *(extra or []), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out), out


def test_unmodified_fsdp2_script_compares_equal(line_of, tmp_path):
    res, report, out = compare(tmp_path, "zc_cmp_fsdp2_ok.py")
    assert res.returncode == 0, res.output
    assert report["ok"] and report["findings"] == []
    rows = report["records"]["2"]
    # 4 training steps, the default K = 3 recorded
    assert [(r["name"], r["step"]) for r in rows] == [(n, s) for s in range(3) for n in ("auto/loss", "auto/params")]
    assert all(r["status"] == "ok" and r["auto"] and r["recorded"] == "recorded automatically" for r in rows)
    backward, step = line_of("zc_cmp_fsdp2_ok.py", "loss.backward()"), line_of("zc_cmp_fsdp2_ok.py", "opt.step()")
    assert {r["site"] for r in rows if r["name"] == "auto/loss"} == {f"zc_cmp_fsdp2_ok.py:{backward}"}
    assert {r["site"] for r in rows if r["name"] == "auto/params"} == {f"zc_cmp_fsdp2_ok.py:{step}"}
    assert {r["mode"] for r in rows if r["name"] == "auto/loss"} == {"mean of 2 ranks"}  # each rank's own loss
    assert report["recorded_automatically"] == {"2": ["auto/loss", "auto/params"]}
    # Parameters are FSDP2 shards in the ranks: recorded gathered to full tensors, under the model's names.
    for rank in (0, 1):
        params = [r for r in load_rank(out / "nproc2", rank) if r.name == "auto/params"]
        assert [r.step for r in params] == [0, 1, 2] and all(r.auto for r in params)
        assert [(p.key, tuple(p.value.shape)) for p in params[0].parts] == [
            ("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (1, 16)), ("2.bias", (1,))]
    text = (out / "report.txt").read_text()
    assert "auto/loss = the loss passed to backward()" in text and "recorded automatically" in text
    assert "the script recorded nothing" not in text and "nothing was recorded" not in text


def test_loss_summed_over_local_batch_is_reference_mismatch(line_of, tmp_path):
    res, report, out = compare(tmp_path, "zc_cmp_loss_sum.py", ["--steps", "2"])
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    line = line_of("zc_cmp_loss_sum.py", "loss.backward()")
    assert f["kind"] == "reference_mismatch" and f["ranks"] == [0, 1]
    detail = f["detail"]
    assert detail["name"] == "auto/loss" and detail["step"] == 0 and detail["auto"] is True
    assert detail["line"] == line and detail["file"].endswith("zc_cmp_loss_sum.py")
    assert f["message"].startswith(f"step 0: the loss passed to backward() at zc_cmp_loss_sum.py:{line} "
                                   f"(recorded automatically as 'auto/loss') differs")
    assert "the loss is 1/2 of the reference" in f["message"] and detail["rel_err"] == pytest.approx(0.5, rel=1e-3)
    rows = report["records"]["2"]
    assert [(r["name"], r["step"]) for r in rows] == [(n, s) for s in range(2) for n in ("auto/loss", "auto/params")]
    params = [r for r in rows if r["name"] == "auto/params"]
    step = line_of("zc_cmp_loss_sum.py", "opt.step()")
    assert [r["status"] for r in params] == ["MISMATCH"] * 2 and params[0]["site"] == f"zc_cmp_loss_sum.py:{step}"
    assert "reference_mismatch" in res.stdout
