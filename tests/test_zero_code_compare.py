"""Zero-code compare: ``distcheck compare`` on scripts with no ``distcheck.record`` call.

The two integration tests launch real gloo ranks (1, then 2) on the zc_cmp_* fixtures; the in-process tests run
autocheck's hooks on a plain CPU training loop (no process group) and read back what they recorded.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.rank import autocheck

from distcheck.rank import records
from distcheck.analysis.records import load_rank


def line_of(fixture: str, code: str) -> int:
    """The line of ``code`` as a statement (docstrings mention the same calls)."""
    lines = (FIXTURES / fixture).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.strip().startswith(code))


def compare(tmp_path, fixture: str, extra: list[str] | None = None):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), *(extra or []), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out), out


def test_unmodified_fsdp2_script_compares_equal(tmp_path):
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


def test_loss_summed_over_local_batch_is_reference_mismatch(tmp_path):
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


# -- the hooks in this process (no process group) ----------------------------------------------------------------

@pytest.fixture
def auto_recording(tmp_path, monkeypatch):
    """autocheck installed as in a rank of `distcheck compare` with K = 2, writing records into tmp_path."""
    monkeypatch.setenv("DISTCHECK_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("DISTCHECK_AUTOCHECK", "1")
    monkeypatch.setenv(records.ENV_AUTO_STEPS, "2")
    records.reset()
    check = autocheck.install(tmp_path, 0)
    try:
        yield tmp_path, check
    finally:
        autocheck.uninstall()
        records.reset()


class Wrapper(nn.Module):
    """Stands in for DDP: a wrapper only at some world sizes, whose ``module.`` prefix must not reach the names."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_hooks_record_loss_per_backward_and_params_per_step(auto_recording):
    out, check = auto_recording
    torch.manual_seed(0)
    model = Wrapper(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    before = model.module[0].weight.detach().clone()
    losses = []
    for _ in range(3):  # K = 2: the third step is not recorded
        for half in (x[:2], x[2:]):  # gradient accumulation: two backward() calls per step
            loss = nn.functional.mse_loss(model(half), y[:2])
            losses.append(loss.item())
            loss.backward()  # LOSS LINE
        opt.step()  # STEP LINE
        opt.zero_grad()
    got = load_rank(out, 0)
    src = open(__file__).read().splitlines()
    loss_line = next(i for i, t in enumerate(src, 1) if t.strip() == "loss.backward()  # LOSS LINE")
    step_line = next(i for i, t in enumerate(src, 1) if t.strip() == "opt.step()  # STEP LINE")
    assert [(r.name, r.step) for r in got] == [("auto/loss", 0), ("auto/loss", 0), ("auto/params", 0),
                                              ("auto/loss", 1), ("auto/loss", 1), ("auto/params", 1)]
    assert all(r.auto for r in got) and check.auto_records == 6
    assert {(r.file, r.line) for r in got if r.name == "auto/loss"} == {(__file__, loss_line)}
    assert {(r.file, r.line) for r in got if r.name == "auto/params"} == {(__file__, step_line)}
    assert [float(r.parts[0].value) for r in got if r.name == "auto/loss"] == pytest.approx(losses[:4])
    assert all(r.replicated is False for r in got if r.name == "auto/loss")  # per-rank values: compared as a mean
    params = [r for r in got if r.name == "auto/params"]
    assert [p.key for p in params[0].parts] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # the values after each update: step 0's differ from the initial weights and from step 1's
    first, second = params[0].parts[0].value, params[1].parts[0].value
    assert not torch.equal(first, before) and not torch.equal(first, second)
    assert check._naming is None  # the forward hook that names the parameters is gone after the first step


def test_nothing_recorded_outside_compare(tmp_path, monkeypatch):
    # `distcheck run` sets DISTCHECK_REPORT_DIR but not the step count: it must not pay for recording.
    monkeypatch.setenv("DISTCHECK_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("DISTCHECK_AUTOCHECK", "1")
    monkeypatch.delenv(records.ENV_AUTO_STEPS, raising=False)
    records.reset()
    check = autocheck.install(tmp_path, 0)
    try:
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert check.record_steps == 0 and check._naming is None and check.auto_records == 0
    finally:
        autocheck.uninstall()
        records.reset()
    assert load_rank(tmp_path, 0) == [] and not list(tmp_path.glob("records-rank*"))
