"""DCP's checks (rank/autocheck/dcp_roundtrip.py): the pure findings, then the hooks in this process (DCP saves and
loads without a process group) on real checkpoints in tmp_path: a partial load that loaded nothing, a resume whose
values do not reach the model or come back rounded; correct resumes and partial loads by design stay silent."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch import nn

from distcheck.rank.autocheck.dcp_roundtrip import (checkpoint_key, not_resumed_finding, partial_load_finding,
                                                    region, roundtrip_finding)
from distcheck.rank.usersite import Site

LOAD, SAVE = Site("/w/resume.py", 40), Site("/w/resume.py", 30)


# -- pure --------------------------------------------------------------------------------------------------------

def test_a_partial_load_of_a_ddp_checkpoint_names_the_prefix_and_the_dcp_call():
    f = partial_load_finding(["model.weight", "model.bias"], ["model.module.weight", "model.module.bias"], LOAD)
    assert f.kind == "bad_values" and f.detail["cause"] == "state_dict_not_loaded" and f.detail["why"] == "prefix"
    assert f.detail["missing"] == ["model.weight", "model.bias"] and (f.detail["file"], f.detail["line"]) == \
        ("/w/resume.py", 40)
    assert f.message.startswith("dcp.load(allow_partial_load=True) at resume.py:40 left 2 of the state dict's 2 "
                                "entries unloaded: 'model.weight', 'model.bias'; the checkpoint has them under the "
                                "prefix 'module.' ('model.weight' is 'model.module.weight' there)")


def test_a_partial_load_of_nothing_is_named_and_one_by_design_is_not():
    f = partial_load_finding(["model.weight", "model.bias"], ["encoder.w"], LOAD)
    assert f.detail["why"] == "nothing_loaded" and "'encoder.w'" in f.message
    # The checkpoint predates the EMA weights the resumed job keeps: they stay at their initial values, on purpose.
    assert partial_load_finding(["model.w", "model.b", "ema.w"], ["model.w", "model.b"], LOAD) is None
    assert partial_load_finding(["model.w"], ["model.w", "optim.lr"], LOAD) is None


def test_the_round_trip_findings_name_the_keys_both_lines_and_the_cause():
    f = roundtrip_finding([("model.w", "float32", "bfloat16")], LOAD, SAVE)
    assert f.detail["why"] == "roundtrip_cast" and f.detail["save"] == {"file": "/w/resume.py", "line": 30}
    assert f.message.startswith("dcp.load at resume.py:40 read back other values than dcp.save at resume.py:30 "
                                "wrote to the same checkpoint: 'model.w'; the checkpoint holds float32 and they "
                                "were loaded into bfloat16 tensors")
    assert roundtrip_finding([("a", "float32", "float32")], LOAD, SAVE).detail["why"] == "roundtrip_values"
    f = not_resumed_finding(["m.a", "m.b", "m.c", "m.d"], 4, LOAD, SAVE)
    assert f.detail["why"] == "not_in_model" and f.detail["line"] == 40 and "(+1 more)" in f.message
    assert "read the checkpoint dcp.save at resume.py:30 wrote into a state dict the model no longer uses" in f.message


def test_checkpoint_ids_and_regions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_key("ckpt") == checkpoint_key(tmp_path / "ckpt") == str(tmp_path / "ckpt")
    assert checkpoint_key(None) is None and checkpoint_key("") is None and checkpoint_key("s3://b/c") == "s3://b/c"
    assert region(torch.zeros(2, 3)) == ("tensor", (2, 3)) != region(torch.zeros(3, 2))


# -- the hooks, in this process ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _installed(tmp_path):
    """autocheck installed as in a rank; the findings DCP's checks emit, and torch.distributed.checkpoint."""
    from distcheck.rank import autocheck

    check = autocheck.install(tmp_path / "report", 0)
    found: list = []
    check.emit = found.extend  # what the checks emit at once
    import torch.distributed.checkpoint as dcp
    try:
        yield dcp, found, check
    finally:
        autocheck.uninstall()


@pytest.fixture
def dcp_check(tmp_path):
    with _installed(tmp_path) as installed:
        yield installed


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _line(marker: str) -> int:
    source, start = inspect.getsourcelines(inspect.currentframe().f_back.f_code)
    return start + next(i for i, text in enumerate(source) if marker in text)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_partial_load_into_the_bare_model_is_found_at_the_load_line(dcp_check, tmp_path):
    dcp, found, _ = dcp_check
    from torch.distributed.checkpoint import DefaultLoadPlanner

    model, _ = _trained()
    dcp.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=tmp_path / "c")
    bare = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    state = {"model": bare.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "c", planner=DefaultLoadPlanner(allow_partial_load=True))  # LOAD
    (f,) = found
    assert f.ranks == [0] and f.detail["why"] == "prefix" and f.detail["line"] == _line("# LOAD")
    assert f.detail["missing"] == ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    assert "under the prefix 'module.'" in f.message


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_correct_resume_and_a_partial_load_by_design_are_silent(dcp_check, tmp_path):
    dcp, found, _ = dcp_check
    from torch.distributed.checkpoint import DefaultLoadPlanner

    model, opt = _trained()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "c")
    model, opt = _trained(seed=1)  # the restart: the state dict is built from the new model
    ema = nn.Linear(2, 2)
    dcp.load({"model": model.state_dict(), "ema": ema.state_dict()}, checkpoint_id=tmp_path / "c",
             planner=DefaultLoadPlanner(allow_partial_load=True))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert found == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_load_into_the_old_models_state_dict_is_found_at_the_next_step(dcp_check, tmp_path):
    dcp, found, _ = dcp_check
    model, opt = _trained()
    state = {"model": model.state_dict()}  # the first model's tensors
    dcp.save(state, checkpoint_id=tmp_path / "c")  # SAVE
    model, opt = _trained(seed=1)
    dcp.load(state, checkpoint_id=tmp_path / "c")  # LOAD
    assert found == []  # the state dict did get the checkpoint's values
    head = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    head.step()  # another optimizer, over parameters the checkpoint never held: not this check's business
    assert found == []
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.step()
    (f,) = found
    assert f.detail["why"] == "not_in_model" and f.detail["line"] == _line("# LOAD")
    assert f.detail["save"]["line"] == _line("# SAVE")
    assert f.detail["keys"] == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_resume_into_a_bf16_model_rounds_the_checkpoint(dcp_check, tmp_path):
    dcp, found, check = dcp_check
    model, _ = _trained()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "c")
    resumed = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    dcp.load({"model": resumed.state_dict()}, checkpoint_id=tmp_path / "c")  # LOAD
    (f,) = found
    assert f.detail["why"] == "roundtrip_cast" and f.detail["line"] == _line("# LOAD")
    assert "the checkpoint holds float32 and they were loaded into bfloat16 tensors" in f.message
    # A checkpoint this run did not save (another directory, a pretrained model) is not compared.
    found.clear()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "d")
    check.checks["dcp_roundtrip"].saved.pop(checkpoint_key(tmp_path / "d"))  # as if another job had saved it
    dcp.load({"model": resumed.state_dict()}, checkpoint_id=tmp_path / "d")
    assert found == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failing_check_never_breaks_the_users_save_or_load(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from distcheck.rank.autocheck.dcp_roundtrip import DcpWatch

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in distcheck")

    for name in ("on_dcp_save_plan", "on_dcp_load_plan", "on_dcp_load_end", "on_dcp_step"):
        monkeypatch.setattr(DcpWatch, name, broken)  # before the core binds its handlers
    with _installed(tmp_path) as (dcp, found, _):
        model, opt = _trained()
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "c")
        resumed = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        dcp.load({"model": resumed.state_dict()}, checkpoint_id=tmp_path / "c",
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(resumed[0].weight, model[0].weight)
        opt.step()
        assert found == []
        # torch's own error still reaches the user unchanged (DCP wraps each rank's error in a CheckpointException)
        with pytest.raises(dcp.CheckpointException, match="Missing key in checkpoint state_dict: model.extra"):
            dcp.load({"model": {**resumed.state_dict(), "extra": torch.zeros(1)}}, checkpoint_id=tmp_path / "c")


def test_the_fingerprints_kept_are_bounded(dcp_check, tmp_path):
    from distcheck.rank.autocheck import dcp_roundtrip

    _, _, check = dcp_check
    watch = check.checks["dcp_roundtrip"]
    for i in range(dcp_roundtrip.MAX_CHECKPOINTS + 3):
        watch.on_dcp_save_plan({"w": torch.zeros(2)}, tmp_path / str(i), SAVE)
    assert len(watch.saved) == dcp_roundtrip.MAX_CHECKPOINTS
    assert checkpoint_key(tmp_path / "0") not in watch.saved
    assert checkpoint_key(tmp_path / str(dcp_roundtrip.MAX_CHECKPOINTS + 2)) in watch.saved


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_empty_parameter_does_not_pass_for_a_resumed_one(dcp_check, tmp_path):
    """FSDP2 gives a rank an empty shard of a tensor smaller than the world: every empty tensor has the same
    fingerprint, so it must not count as a parameter that holds the checkpoint's values."""
    dcp, found, _ = dcp_check

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, _ = _trained(seed)
        model.register_parameter("shard", nn.Parameter(torch.zeros(0)))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = build(0)
    opt.step()
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=tmp_path / "c")
    model, opt = build(1)
    dcp.load(state, checkpoint_id=tmp_path / "c")
    opt.step()
    (f,) = found
    assert f.detail["why"] == "not_in_model" and "model.shard" in f.detail["keys"]
