"""torch's distributed errors translated into parameter names and fixes, and one finding per cause across ranks."""
from __future__ import annotations

import json

from distcheck.analysis.torch_errors import translate
from distcheck.analysis.trace_align import STATE_ERROR, RankOutcome, analyze_run
from distcheck.analysis.trace_events import parse_lines
from distcheck.contract import files

# torch 2.13's text (reducer.cpp), as a rank raises it with TORCH_DISTRIBUTED_DEBUG unset.
DDP_UNUSED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates that "
    "your module has parameters that were not used in producing loss. You can enable unused parameter detection by "
    "passing the keyword argument `find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and "
    "by \nmaking sure all `forward` function outputs participate in calculating loss. \nIf you already have done the "
    "above, then the distributed data parallel module wasn't able to locate the output tensors in the return value "
    "of your module's `forward` function. Please include the loss function and the structure of the return value of "
    "`forward` of your module when reporting this issue (e.g. list, dict, iterable).\nParameter indices which did not "
    "receive grad for rank {rank}: 2 3\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to "
    "either INFO or DETAIL to print out information about which particular parameters did not receive gradient on "
    "this rank as part of this error")
ORDER = ["body.weight", "body.bias", "aux_head.weight", "aux_head.bias"]


def test_ddp_unused_parameter_indices_become_names_lines_and_fixes():
    out = translate("RuntimeError", DDP_UNUSED.format(rank=0),
                    {"ddp_params": ORDER, "param_sites": {"aux_head.weight": "model.py:23", "aux_head.bias": "model.py:23"}})
    assert out["detail"]["unused_params"] == ["aux_head.weight", "aux_head.bias"]
    assert "2 parameters got no gradient" in out["message"] and "'aux_head.weight', 'aux_head.bias'" in out["message"]
    assert "(created at model.py:23)" in out["message"] and "find_unused_parameters=True" in out["message"]
    assert "requires_grad_(False)" in out["message"] and "indices" not in out["message"]


def test_ddp_names_under_debug_detail_need_no_model():
    text = DDP_UNUSED.format(rank=1).replace("Parameter indices which did not receive grad for rank 1: 2 3",
                                             "Parameters which did not receive grad for rank 1: aux_head.bias, aux_head.weight")
    assert translate("RuntimeError", text)["detail"]["unused_params"] == ["aux_head.bias", "aux_head.weight"]


def test_other_errors_are_not_translated():
    assert translate("RuntimeError", "Connection closed by peer [127.0.0.1]:1234") is None
    assert translate("ValueError", "bad batch") is None


def _failed_rank(rank: int, message: str, translated: dict | None) -> tuple:
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": rank}),
             json.dumps({"ev": "error", "exc_type": "RuntimeError", "message": message, "traceback": "",
                         "site": "train.py:35", "file": "/src/train.py", "line": 35, "t": 1.0,
                         "translated": translated})]
    trace = parse_lines(lines, rank)
    return trace, RankOutcome(rank, STATE_ERROR, exit_code=1, error=trace.errors[0])


def test_the_same_error_on_every_rank_is_one_finding():
    traces, outcomes = {}, {}
    for rank in (0, 1):
        message = DDP_UNUSED.format(rank=rank)
        traces[rank], outcomes[rank] = _failed_rank(rank, message, translate("RuntimeError", message,
                                                                             {"ddp_params": ORDER}))
    [f] = analyze_run(traces, outcomes, world_size=2)
    assert f.kind == "rank_failure" and f.ranks == [0, 1] and f.detail["line"] == 35
    assert f.message.startswith("ranks 0-1 raised RuntimeError at train.py:35: DDP: 2 parameters got no gradient")
    assert set(f.detail["errors"]) == {0, 1} and "Parameter indices" in f.detail["error"]  # torch's text kept


def test_different_errors_stay_separate_findings():
    traces, outcomes = {}, {}
    for rank, message in ((0, "CUDA out of memory"), (1, "bad batch on this rank")):
        traces[rank], outcomes[rank] = _failed_rank(rank, message, None)
    assert [f.ranks for f in analyze_run(traces, outcomes, world_size=2)] == [[0], [1]]
