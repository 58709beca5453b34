"""The non-strict load check (rank/autocheck/checkpoint_load.py): a wrapper's prefix and a load of nothing are
findings; a partial load by design is not."""
from __future__ import annotations

import torch
from torch import nn

from distcheck.rank.autocheck.checkpoint_load import load_finding
from distcheck.rank.usersite import Site

AT = Site("/w/resume.py", 40)


def test_a_checkpoint_saved_from_the_ddp_wrapper_is_named_with_its_prefix_and_fix():
    model = nn.Linear(4, 2)
    result = model.load_state_dict({f"module.{k}": v for k, v in model.state_dict().items()}, strict=False)
    f = load_finding("Linear", 2, result.missing_keys, result.unexpected_keys, AT)
    assert f.kind == "bad_values" and f.detail["cause"] == "state_dict_not_loaded" and f.detail["why"] == "prefix"
    assert (f.detail["file"], f.detail["line"]) == ("/w/resume.py", 40)
    assert f.message.startswith("load_state_dict(strict=False) at resume.py:40 left 2 of Linear's 2 parameters and "
                                "buffers unloaded: 'weight', 'bias'; the checkpoint has them under the prefix "
                                "'module.' ('weight' is 'module.weight' there)")
    assert "save model.module.state_dict()" in f.message


def test_compiled_and_nested_wrappers_and_the_reverse_direction():
    bare = {"0.weight": torch.zeros(1), "0.bias": torch.zeros(1)}
    f = load_finding("Sequential", 2, ["0.weight", "0.bias"], [f"_orig_mod.{k}" for k in bare], AT)
    assert "'_orig_mod.'" in f.message and "torch.compile" in f.message
    # A bare checkpoint loaded into the DDP wrapper: the model's keys carry the prefix.
    f = load_finding("DistributedDataParallel", 2, [f"module.{k}" for k in bare], list(bare), AT)
    assert f.detail["why"] == "prefix" and "loaded into the wrapper" in f.message
    # A prefix in the middle (an activation-checkpointed block inside the model).
    f = load_finding("Net", 1, ["blocks.0.mlp.weight"], ["blocks.0._checkpoint_wrapped_module.mlp.weight"], AT)
    assert f is not None and "'_checkpoint_wrapped_module.'" in f.message


def test_nothing_loaded_is_named_and_a_partial_load_by_design_is_not():
    f = load_finding("Linear", 2, ["weight", "bias"], ["encoder.w", "encoder.b"], AT)
    assert f.detail["why"] == "nothing_loaded" and "renamed keys" in f.message and "'encoder.w'" in f.message
    assert "the state dict was empty" in load_finding("Linear", 2, ["weight", "bias"], [], AT).message
    assert load_finding("Net", 6, ["head.weight", "head.bias"], [], AT) is None  # a new head on a backbone
    assert load_finding("Net", 6, [], ["extra"], AT) is None


def test_set_model_state_dict_with_strict_false_is_seen_at_the_users_line(tmp_path):
    """torch's own caller of ``load_state_dict`` (DCP's state_dict API) goes through the patched method: the
    finding names the user's ``set_model_state_dict`` line, not torch's."""
    import inspect

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from distcheck.rank import autocheck

    check = autocheck.install(tmp_path, 0)
    found: list = []
    check.emit = found.extend  # what the checks emit at once
    try:
        model = nn.Linear(4, 2)
        checkpoint = {f"module.{k}": v.clone() for k, v in model.state_dict().items()}
        line = inspect.currentframe().f_lineno + 1
        set_model_state_dict(model, checkpoint, options=StateDictOptions(strict=False))
    finally:
        autocheck.uninstall()
    (f,) = found
    assert f.detail["cause"] == "state_dict_not_loaded" and f.detail["why"] == "prefix" and f.ranks == [0]
    assert f.detail["line"] == line and f.detail["file"] == __file__
    assert f.detail["missing"] == ["weight", "bias"]
