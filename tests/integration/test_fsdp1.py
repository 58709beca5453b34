"""FSDP1 (``FullyShardedDataParallel``) understood like FSDP2, on real gloo ranks (issue 48, item 1).

``compare`` records FSDP1's parameters and gradients as the full original tensors under the unwrapped model's
names, whatever the sharding strategy and ``use_orig_params`` (it compared the flat shards before: "shape [161] vs
reference [32, 8]"); ``run`` names a rank-dependent init that ``sync_module_states=False`` keeps, and a trainable
module of ``ignored_modules`` whose gradient nobody reduces. The correct twins (fixtures/ok/fsdp1_*.py) are silent
in tests/integration/test_correct_corpus.py; what each rank holds, the placement table and the hook's decisions
are unit-tested in tests/unit/test_fsdp1_flat_params.py.

    .venv/bin/python -m pytest -q tests/integration/test_fsdp1.py
"""
from __future__ import annotations

import pytest
from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.contract import records_file

AUTO_WRAP = FIXTURES / "ok" / "fsdp1_auto_wrap.py"


def run_fixture(tmp_path, fixture: str, nproc: int = 2):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", str(nproc), "--timeout", "90", "--report-dir", str(out), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out)


def shapes(report_dir) -> dict[tuple[str, int], dict[str, list[int]]]:
    """(record name, step) -> {tensor key: shape} of rank 0's records in ``report_dir``."""
    return {(r.entry.name, r.entry.step): {p.key: list(p.shape) for p in r.entry.parts}
            for r in records_file.read(report_dir, 0) if r.entry.kind == "module"}


@pytest.mark.parametrize("nproc,args", [
    (2, []),  # the program: FULL_SHARD, use_orig_params=True
    (2, ["--flat-params"]),  # the optimizer holds the flat parameters
    (2, ["--strategy", "SHARD_GRAD_OP"]),
    (2, ["--strategy", "NO_SHARD", "--flat-params"]),
    (4, ["--strategy", "HYBRID_SHARD"]),  # a (replicate, shard) mesh of 2 x 2
    (2, ["--flat-params", "--record-model"]),  # distcheck.record("model", model): parameters, buffers, gradients
], ids=lambda v: "-".join(v) if isinstance(v, list) else str(v))
def test_compare_records_fsdp1_as_the_full_original_parameters(tmp_path, nproc, args):
    out = tmp_path / "report"
    res = distcheck(["compare", "--nproc", str(nproc), "--timeout", "90", "--report-dir", str(out), "--",
                     str(AUTO_WRAP), *args], timeout=400)
    report = load_report(out)
    assert res.returncode == 0 and report["findings"] == [], res.output[-3000:]
    reference, ranks = shapes(out / "reference"), shapes(out / f"nproc{nproc}")
    assert reference and ranks == reference  # the same names and full shapes as the 1-rank run, record by record
    names = {key for parts in ranks.values() for key in parts}
    assert "blocks.1.fc2.weight" in names and not any("_flat_param" in k or "_fsdp_wrapped" in k for k in names)
    recorded = {name for name, _ in ranks}  # the automatic records are taken, and dropped, beside the script's own
    assert {"auto/params", "auto/grads"} <= recorded and ("model" in recorded) == ("--record-model" in args)
    if "--record-model" in args:
        assert ranks[("model", 0)]["blocks.0.fc1.weight.grad"] == [32, 16]


def test_rank_seeded_init_before_fsdp1_is_one_finding_naming_the_seed_line(line_of, tmp_path):
    fixture = "zc_rank_seeded_fsdp1.py"
    res, report = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    [f] = report["findings"]
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "rank_seeded"
    assert f["detail"]["params"] == ["0.fc.weight", "0.fc.bias", "1.fc.weight", "1.fc.bias", "2.weight", "2.bias"]
    seed = line_of(fixture, "torch.manual_seed(1234 + dist.get_rank())")
    assert f["detail"]["line"] == seed and f"{fixture}:{seed}" in f["message"]
    wrap = line_of(fixture, "model = FSDP(")
    assert f"FullyShardedDataParallel(...) at {fixture}:{wrap}" in f["message"]
    assert "broadcasts nothing without sync_module_states=True" in f["message"]


def test_a_trainable_ignored_module_is_named_at_the_line_that_wrapped_the_model(line_of, tmp_path):
    fixture = "fsdp1_ignored_module_drift.py"
    res, report = run_fixture(tmp_path, fixture)
    assert res.returncode == 1, res.output
    [f] = report["findings"]
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1] and f["detail"]["cause"] == "fsdp1_ignored"
    assert f["detail"]["params"] == ["gate.weight", "gate.bias"] and f["detail"]["step"] == 0
    wrap = line_of(fixture, "model = FSDP(")
    assert f["detail"]["line"] == wrap and f"ignored_modules of FullyShardedDataParallel(...) at {fixture}:{wrap}" \
        in f["message"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model_check"]["ok"]  # the model was found and checked; only the gate drifted


CONSISTENT = '''
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from fsdp1_ignored_module_drift import Block, Model
import distcheck

dist.init_process_group("gloo")
for strategy in ("FULL_SHARD", "NO_SHARD"):
    torch.manual_seed(0)
    model = FSDP(Model(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy[strategy], use_orig_params=strategy == "FULL_SHARD")
    assert distcheck.check_consistent(strategy, model) == [], strategy  # shards are not replicas
    if dist.get_rank() == 1:
        with torch.no_grad():
            model._handle.flat_param[:3] += 1  # the root unit's first parameter, on rank 1 only
    found = distcheck.check_consistent(strategy, model)
    assert bool(found) == (strategy == "NO_SHARD"), (strategy, found)
dist.destroy_process_group()
'''


def test_check_consistent_compares_fsdp1_chunks_only_where_ranks_hold_the_same(tmp_path):
    script = tmp_path / "consistent.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(FIXTURES)!r})\n" + CONSISTENT)
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "90", "--report-dir", str(out), "--", str(script)],
                    timeout=240)
    report = load_report(out)
    assert res.returncode == 1, res.output  # the assert in the script held on both ranks: only the finding fails
    [f] = report["findings"]
    # two ranks, no majority: both are named; the original parameter, not the flat one
    assert f["kind"] == "tensor_divergence" and f["ranks"] == [0, 1] and "'inp.weight'" in f["message"]
    assert "check_consistent 'NO_SHARD'" in f["message"]
