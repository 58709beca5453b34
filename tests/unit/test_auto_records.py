"""Zero-code compare, in this process: autocheck's hooks on a plain CPU training loop (no process group) record
the loss per backward() and the parameters per optimizer.step(); read back from the files (real ranks:
tests/integration/test_zero_code_compare.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distcheck.analysis.record_values import load_rank
from distcheck.rank import autocheck, records


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
    losses, grads = [], []
    for _ in range(3):  # K = 2: the third step is not recorded
        for half in (x[:2], x[2:]):  # gradient accumulation: two backward() calls per step
            loss = nn.functional.mse_loss(model(half), y[:2])
            losses.append(loss.item())
            loss.backward()  # LOSS LINE
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()  # STEP LINE
        opt.zero_grad()
    got = load_rank(out, 0)
    src = open(__file__).read().splitlines()
    loss_line = next(i for i, t in enumerate(src, 1) if t.strip() == "loss.backward()  # LOSS LINE")
    step_line = next(i for i, t in enumerate(src, 1) if t.strip() == "opt.step()  # STEP LINE")
    # the gradients once, at the first step only (Adam hides a scale of them from the parameters); the parameters
    # once before the first update (where both runs start)
    assert [(r.name, r.step) for r in got] == [("auto/loss", 0), ("auto/loss", 0), ("auto/init", 0),
                                              ("auto/grads", 0), ("auto/params", 0), ("auto/loss", 1),
                                              ("auto/loss", 1), ("auto/params", 1)]
    assert all(r.auto for r in got) and check.checks["auto_records"].count == 8
    assert {(r.file, r.line) for r in got if r.name == "auto/loss"} == {(__file__, loss_line)}
    assert {(r.file, r.line) for r in got if r.name in ("auto/params", "auto/grads")} == {(__file__, step_line)}
    (recorded_grads,) = [r for r in got if r.name == "auto/grads"]
    assert [(p.key, p.role) for p in recorded_grads.parts] == [
        (k, "gradient") for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    # both accumulated halves, as the step used them (read before zero_grad())
    assert all(torch.equal(p.value, g) for p, g in zip(recorded_grads.parts, grads[0]))
    assert [float(r.parts[0].value) for r in got if r.name == "auto/loss"] == pytest.approx(losses[:4])
    assert all(r.replicated is False for r in got if r.name == "auto/loss")  # per-rank values: compared as a mean
    params = [r for r in got if r.name == "auto/params"]
    assert [p.key for p in params[0].parts] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # the values after each update: step 0's differ from the initial weights and from step 1's
    first, second = params[0].parts[0].value, params[1].parts[0].value
    assert not torch.equal(first, before) and not torch.equal(first, second)
    # the forward hook that names the parameters is gone after the first step
    assert check.checks["auto_records"]._naming is None


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
        records_check = check.checks["auto_records"]
        assert records_check.steps == 0 and records_check._naming is None and records_check.count == 0
    finally:
        autocheck.uninstall()
        records.reset()
    assert load_rank(tmp_path, 0) == [] and not list(tmp_path.glob("records-rank*"))


def test_a_warning_from_a_wrapped_torch_call_points_at_the_users_line():
    """torch warns with a stacklevel meant for the user's call; through distcheck's wrapper it would name the
    wrapper (distcheck/rank/autocheck/patches.py) instead."""
    import inspect
    import warnings

    from distcheck.rank.autocheck.patches import as_user

    def torch_like_init():
        warnings.warn("this argument is deprecated", FutureWarning, stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        as_user(torch_like_init)
    (w,) = caught
    assert w.filename == __file__ and w.lineno == line and w.category is FutureWarning


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_data_parallel_coordinate_comes_from_the_wrapper(one_rank_group, auto_recording):
    """The loss records carry (index, size) of the rank's fully_shard/DDP group: the analysis sums over those."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from distcheck.rank.autocheck.module_summaries import DataParallel, data_parallel

    out, check = auto_recording
    assert data_parallel([nn.Linear(2, 2)]) is None  # nothing says: the analysis infers from shapes alone
    sharded = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    fully_shard(sharded[0])
    fully_shard(sharded)
    assert data_parallel([sharded]) == DataParallel(0, 1, frozenset({0}))
    model = DistributedDataParallel(nn.Linear(3, 1))
    assert data_parallel([model]) == DataParallel(0, 1, frozenset({0}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 1)).backward()
    opt.step()
    loss = next(r for r in load_rank(out, 0) if r.name == "auto/loss")
    assert loss.dp == (0, 1)
    rows = check.checks["modules"].state()  # DDP and its module (one name): both rows carry the coordinate
    assert rows and all(row["dp"] == [0, 1] for row in rows)


def test_gradients_of_a_closure_step_are_recorded_and_unused_parameters_skipped(auto_recording):
    """optimizer.step(closure) computes the gradients inside the step: they are read after it; a parameter no loss
    reached has no gradient and no part."""
    out, check = auto_recording
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 1), "unused": nn.Linear(3, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    seen = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model["used"](x), y)
        loss.backward()
        seen.append([p.grad.clone() for p in model["used"].parameters()])
        return loss

    for _ in range(2):
        opt.step(closure)
    got = load_rank(out, 0)
    # the closure runs inside step(): the initial parameters are recorded before its loss
    assert [(r.name, r.step) for r in got] == [("auto/init", 0), ("auto/loss", 0), ("auto/grads", 0),
                                              ("auto/params", 0), ("auto/loss", 1), ("auto/params", 1)]
    (grads,) = [r for r in got if r.name == "auto/grads"]
    assert [p.key for p in grads.parts] == ["weight", "bias"]  # named from the module that ran forward
    assert all(torch.equal(p.value, g) for p, g in zip(grads.parts, seen[0]))
