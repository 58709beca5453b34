"""torch's distributed errors translated into parameter names and fixes, and one finding per cause across ranks."""
from __future__ import annotations

import json

from distcheck.analysis.torch_errors import translate
from distcheck.analysis.rank_outcomes import STATE_ERROR, RankOutcome
from distcheck.analysis.trace_align import analyze_run
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
    assert translate("ValueError", "bad batch") is None
    assert translate("RuntimeError", "shape '[-1, 3]' is invalid for input of size 16") is None


# torch 2.13's texts, as ranks raised them on gloo/CPU (the fixtures raise the same).
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13192: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "3000ms for recv operation to complete")
MIXED_MESH = ("All operands in aten.stack.default must have the same mesh, but got DeviceMesh((rep=2, shard=1), 'cpu', "
              "stride=(1, ())) and DeviceMesh((2,), 'cpu', stride=(1,)).")
CROSS_MESH = ("DTensor does not support cross-mesh operation on aten.add.Tensor! Got meshes: DeviceMesh((2,), 'cpu', "
              "stride=(1,)) DeviceMesh((dp=1, tp=2), 'cpu', stride=(2, 1)). Please make sure all the arguments have "
              "the same DeviceMesh.")
FSDP_META = ("FSDP parameters should be materialized from meta device before training, but the following were still "
             "on meta device: ['0.weight', '0.bias', '2.weight', '2.bias', '4.weight']\nFor example, call "
             "module.to_empty(device) to materialize to device and call module.reset_parameters() on each module to "
             "initialize values.")
SHARDING = ("shape '[-1, 3]' is invalid for input of size 16\n\nSharding propagation failed for "
            "aten.view.default(Spec(f32[4, 4](S(0))), [-1, 3]) on DeviceMesh((2,), 'cpu', stride=(1,)))")


def _ended(*errors) -> list:
    """all_reduce #1, #2, ... at train.py:12 on rank 0, each ended with the given error (None: completed)."""
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": 0})]
    for i, error in enumerate(errors, start=1):
        lines.append(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0,1", "op": "all_reduce",
                                 "site": "train.py:12", "file": "/w/train.py", "line": 12, "t": i}))
        lines.append(json.dumps({"ev": "end", "id": i, "t": i + 0.5, **({"error": error} if error else {})}))
    return parse_lines(lines, 0).events


def test_gloo_peer_and_timeout_point_at_the_collective():
    events = _ended(None, "RuntimeError: ...")
    out = translate("RuntimeError", GLOO_RESET, {"events": events})
    assert out["detail"]["translated"] == "gloo_peer_closed" and (out["detail"]["seq"], out["detail"]["line"]) == (2, 12)
    assert out["message"].startswith("gloo lost its connection to another rank in all_reduce #2 at train.py:12")
    assert "pair.cc" not in out["message"]
    out = translate("RuntimeError", GLOO_TIMEOUT, {"events": events})
    assert out["detail"]["timeout_s"] == 3 and "gloo's timeout (3s, from init_process_group) expired in all_reduce #2" \
        in out["message"] and "init_process_group(timeout=...)" in out["message"]
    assert translate("RuntimeError", "Connection closed by peer [127.0.0.1]:1234")["detail"]["translated"] == \
        "gloo_peer_closed"  # no trace at hand: still the meaning, without the collective


def test_mixed_meshes_name_both_and_the_fix():
    out = translate("RuntimeError", MIXED_MESH)
    assert out["detail"]["translated"] == "mixed_meshes" and out["detail"]["meshes"] == ["(rep=2, shard=1)", "(2,)"]
    assert out["message"].startswith("aten.stack.default (clip_grad_norm_ or a foreach optimizer over all parameters) "
                                     "got DTensors on two different device meshes, (rep=2, shard=1) and (2,)")
    assert "same mesh" in out["message"] and "init_device_mesh" in out["message"]
    assert translate("RuntimeError", CROSS_MESH)["detail"]["meshes"] == ["(2,)", "(dp=1, tp=2)"]


def test_dtensor_redistribute_and_placement_errors():
    assert "only changes placements on the DTensor's own mesh" in translate(
        "NotImplementedError", "Cross device mesh comm not supported yet!")["message"]
    out = translate("ValueError", "`placements` must have the same length as `device_mesh.ndim`! Found placements "
                                  "length: 2, and device_mesh.ndim: 1.")
    assert out["message"].startswith("2 placements given for a 1-D device mesh")
    out = translate("RuntimeError", "Can not redistribute from S(0) to P(sum), redistributing to Partial is for "
                                    "internal use only!")
    assert out["message"].startswith("redistribute() from S(0) to P(sum) is not allowed")
    out = translate("RuntimeError", SHARDING)
    assert out["detail"]["aten_op"] == "aten.view.default" and out["detail"]["placements"] == ["S(0)"]
    assert out["message"].startswith("aten.view.default cannot run on its DTensor input with placements S(0): "
                                     "shape '[-1, 3]' is invalid")


def test_fsdp_meta_and_unsharded_parameters():
    out = translate("RuntimeError", FSDP_META)
    assert out["detail"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight"]
    assert out["message"].startswith("FSDP2: 5 parameters still on the meta device at the first forward, never given "
                                     "real storage: '0.weight', '0.bias', '2.weight', '2.bias' (+1 more)")
    out = translate("RuntimeError", "aten.stack.default: got mixed torch.Tensor and DTensor, need to convert all "
                                    "torch.Tensor to DTensor before calling distributed operators!")
    assert out["detail"]["translated"] == "fsdp_unsharded_params" and "fully_shard(model) on the root" in out["message"]
    out = translate("RuntimeError", "aten.add.Tensor: got mixed torch.Tensor and DTensor, need to convert all")
    assert out["detail"]["translated"] == "dtensor_mixed_tensor"


def _failed_rank(rank: int, message: str, context: dict | None) -> tuple:
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": rank}),
             json.dumps({"ev": "error", "exc_type": "RuntimeError", "message": message, "traceback": "",
                         "site": "train.py:35", "file": "/src/train.py", "line": 35, "t": 1.0,
                         "context": context})]
    trace = parse_lines(lines, rank)
    return trace, RankOutcome(rank, STATE_ERROR, exit_code=1, error=trace.errors[0])


def test_the_same_error_on_every_rank_is_one_finding():
    traces, outcomes = {}, {}
    for rank in (0, 1):
        message = DDP_UNUSED.format(rank=rank)
        traces[rank], outcomes[rank] = _failed_rank(rank, message, {"ddp_params": ORDER})
    [f] = analyze_run(traces, outcomes, world_size=2)
    assert f.kind == "rank_failure" and f.ranks == [0, 1] and f.detail["line"] == 35
    assert f.message.startswith("ranks 0-1 raised RuntimeError at train.py:35: DDP: 2 parameters got no gradient")
    assert set(f.detail["errors"]) == {0, 1} and "Parameter indices" in f.detail["error"]  # torch's text kept


def test_different_errors_stay_separate_findings():
    traces, outcomes = {}, {}
    for rank, message in ((0, "CUDA out of memory"), (1, "bad batch on this rank")):
        traces[rank], outcomes[rank] = _failed_rank(rank, message, None)
    assert [f.ranks for f in analyze_run(traces, outcomes, world_size=2)] == [[0], [1]]


# Real texts, as ranks printed them (NVIDIA/Megatron-LM#1207, XPixelGroup/BasicSR#737, NCCL's init check).
WATCHDOG = ("[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600013 "
            "milliseconds before timing out.\n[rank1]:[E626 06:24:44.906457629 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG "
            "GUID 0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at work: 5, last "
            "enqueued NCCL work: 6, last completed NCCL work: 4.")
DUPLICATE = ("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
             "version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
             "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")


def _events(*ops: str) -> list:
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": 1})]
    for i, op in enumerate(ops, start=1):
        lines.append(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0,1", "pg_name": "0", "op": op,
                                 "site": f"train.py:{10 + i}", "file": "/src/train.py", "line": 10 + i, "t": i}))
    return parse_lines(lines, 1).events


def test_nccl_watchdog_points_at_the_traced_collective_with_that_number():
    out = translate("", WATCHDOG, {"events": _events("broadcast", "all_reduce", "all_reduce", "all_reduce",
                                                     "all_reduce")})
    assert out["detail"]["nccl_seq"] == 5 and out["detail"]["nccl_op"] == "ALLREDUCE"
    assert out["detail"]["line"] == 15 and out["detail"]["timeout_s"] == 600
    assert out["message"].startswith("NCCL's watchdog timed out collective #5 (ALLREDUCE on group default_pg) after "
                                     "600.013s (timeout 600s): the traced all_reduce #5 at train.py:15")


def test_nccl_watchdog_does_not_name_a_collective_of_another_op():
    out = translate("", WATCHDOG, {"events": _events("broadcast", "all_reduce", "all_reduce", "all_reduce", "barrier")})
    assert "line" not in out["detail"] and "the traced collective #5 is barrier at train.py:15" in out["message"]
    assert "only a guess" in out["message"]
    assert "line" not in translate("", WATCHDOG, {"events": []})["detail"]


def test_duplicate_gpu_names_both_ranks_and_the_fix():
    out = translate("DistBackendError", DUPLICATE)
    assert out["detail"]["gpu_ranks"] == [0, 1] and out["detail"]["bus_id"] == "1a000"
    assert out["message"].startswith("ranks 0 and 1 both use the GPU with bus id 1a000")
    assert "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in out["message"]


def test_a_rank_killed_by_the_watchdog_is_explained_from_its_stderr(tmp_path):
    from distcheck.contract.findings import Finding
    from distcheck.supervise.run_report import add_stderr_tails

    files.rank_file(tmp_path, "stderr", 1).write_text(WATCHDOG + "\nterminate called after throwing an instance\n")
    f = Finding("rank_failure", [1], "rank 1 died from SIGABRT (exit code -6)", {"signal": "SIGABRT"})
    trace = parse_lines([json.dumps({"ev": "meta", "format": files.FORMAT, "rank": 1})], 1)
    trace.events = _events("all_reduce", "all_reduce", "all_reduce", "all_reduce", "all_reduce")
    add_stderr_tails(tmp_path, [f], {1: trace})
    assert "its stderr says: NCCL's watchdog timed out collective #5" in f.message
    assert f.detail["nccl_seq"] == 5 and f.detail["line"] == 15


READY_TWICE = ("Expected to mark a variable ready only once. This error is caused by one of the following reasons: 1) "
               "Use of a module parameter outside the `forward` function. ... 2) Reused parameters in multiple "
               "reentrant backward passes. ...\nParameter at index 1 has been marked as ready twice. This means that "
               "multiple autograd engine  hooks have fired for this particular parameter during this iteration.")


def test_ddp_ready_twice_names_the_parameter_from_its_index():
    out = translate("RuntimeError", READY_TWICE, {"ddp_params": ORDER, "param_sites": {"body.bias": "model.py:7"}})
    assert out["detail"]["params"] == ["body.bias"]
    assert out["message"].startswith("DDP: parameter 'body.bias' (created at model.py:7) got its gradient twice")


def test_dtensor_mixed_tensor_names_the_op_and_both_fixes():
    out = translate("RuntimeError", "aten.mm.default: got mixed torch.Tensor and DTensor, need to convert all "
                                    "torch.Tensor to DTensor before calling distributed operators!")
    assert out["detail"]["aten_op"] == "aten.mm.default" and "full_tensor()" in out["message"]


def test_a_watchdog_error_raised_in_a_rank_points_at_its_traced_collective():
    """Translated where the trace is at hand: the raising rank's error record and its traced collectives."""
    lines = [json.dumps({"ev": "meta", "format": files.FORMAT, "rank": 1})]
    for i in range(1, 6):
        lines.append(json.dumps({"ev": "start", "id": i, "seq": i, "pg": "0,1", "pg_name": "0", "op": "all_reduce",
                                 "site": f"train.py:{10 + i}", "file": "/src/train.py", "line": 10 + i, "t": i}))
    lines.append(json.dumps({"ev": "error", "exc_type": "DistBackendError", "message": WATCHDOG, "traceback": "",
                             "site": "train.py:40", "file": "/src/train.py", "line": 40, "t": 9.0}))
    trace = parse_lines(lines, 1)
    outcome = RankOutcome(1, STATE_ERROR, exit_code=1, error=trace.errors[0])
    [f] = analyze_run({1: trace}, {1: outcome}, world_size=2)
    assert f.detail["nccl_seq"] == 5 and "the traced all_reduce #5 at train.py:15" in f.message


# torch 2.13's re-raised DataLoader worker error (torch/_utils.py ExceptionWrapper.reraise), as str(exc).
WORKER_RAISED = (
    "Caught IndexError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
    '  File "/v/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 374, in _worker_loop\n'
    "    data = fetcher.fetch(index)  # type: ignore[possibly-undefined]\n"
    '  File "/v/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", line 54, in <listcomp>\n'
    "    data = [self.dataset[idx] for idx in possibly_batched_index]\n"
    '  File "/home/u/job/data.py", line 40, in __getitem__\n    return self.load(i)\n'
    '  File "/home/u/job/data.py", line 31, in load\n    return self.rows[i]\n'
    "IndexError: list index out of range\n")


def test_a_dataloader_workers_error_is_read_from_the_re_raised_message():
    from distcheck.analysis.torch_errors import worker_error

    w = worker_error(WORKER_RAISED)
    assert (w.worker, w.exc_type, w.text, w.site, w.func) == (1, "IndexError", "list index out of range",
                                                              "data.py:31", "load")
    # a library dataset's own code only: which worker and what it raised, no user line
    library = WORKER_RAISED.replace("/home/u/job/data.py", "/v/lib/python3.11/site-packages/datasets/arrow.py")
    assert worker_error(library).file is None and worker_error(library).exc_type == "IndexError"
    assert worker_error("list index out of range") is None
    assert worker_error("Caught IndexError in DataLoader worker process 0.") is None  # no traceback: not torch's
