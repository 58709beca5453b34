"""Placement dump and FSDP2/TP coverage: the fixtures' models, parallelized in-process on torch's fake process
group (fully_shard and parallelize_module build the same state as on real ranks), plus two real torchrun runs of
``distcheck.check_model`` for the cross-rank part (merged ranks, drift, live mesh checks)."""
from __future__ import annotations

import importlib

import pytest
import torch.distributed as dist
import torch.nn as nn

from distcheck.analysis.placement import (PlacementRow, coverage_findings, merge_rank_findings, mixed_mesh_notes,
                                          render_placement_table, short_placement)
from distcheck.rank.checks.placement import check_model, describe_model, placement_json



@pytest.fixture
def fake_world():
    """init(world_size, rank, shape, names) -> DeviceMesh on the fake process group; torn down afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")

    def init(world: int, rank: int, shape: tuple[int, ...], names: tuple[str, ...]):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return init_device_mesh("cpu", shape, mesh_dim_names=names)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def analyse(model: nn.Module, rank: int = 0):
    from distcheck.rank.checks.placement import fsdp_modules

    rows = describe_model(model)
    return rows, coverage_findings(rows, [n for n, _ in fsdp_modules(model)], [rank])


def test_unwrapped_root(line_of, fake_world):
    fx = importlib.import_module("placement_unwrapped_root")
    rows, found = analyse(fx.setup(fake_world(2, 0, (2,), ("dp",))))
    # One cause (the root has no fully_shard), one finding naming all three parameters.
    [root] = found
    assert (root.kind, root.detail["reason"], root.detail["params"]) == (
        "uncovered_param", "not_wrapped", ["scale", "head.weight", "head.bias"])
    scale_line, head_line = line_of(fx, "self.scale = nn.Parameter"), line_of(fx, "self.head = nn.Linear")
    assert root.ranks == [0] and root.detail["param"] == "scale" and root.detail["line"] == scale_line
    assert root.message.startswith("3 parameters, ") and "'scale', 'head.weight', 'head.bias'" in root.message
    # head is torch's nn.Linear: the location is where the user's model assigns it.
    assert f"(defined at placement_unwrapped_root.py:{scale_line}, placement_unwrapped_root.py:{head_line})" \
        in root.message
    assert "never reduced across the data-parallel ranks" in root.message and "fully_shard(model)" in root.message
    assert [t["line"] for t in root.detail["tensors"]] == [scale_line, head_line, head_line]
    assert root.detail["tensors"][0]["shape"] == [16] and len(root.message.splitlines()) == 1
    managed = {r.name: r.fsdp for r in rows}
    assert managed["blocks.0.fc1.weight"] == "blocks.0" and managed["scale"] is None


def test_param_added_after_fully_shard(line_of, fake_world):
    fx = importlib.import_module("placement_param_after_shard")
    _, found = analyse(fx.setup(fake_world(2, 1, (2,), ("dp",))), rank=1)
    [f] = found
    assert (f.detail["params"], f.detail["reason"], f.detail["fsdp_ancestor"]) == (
        ["blocks.0.adapter.weight", "blocks.0.adapter.bias"], "added_after_fully_shard", "blocks.0")
    assert f.kind == "uncovered_param" and f.ranks == [1] and f.detail["count"] == 2
    assert f.detail["line"] == line_of(fx, "self.adapter: nn.Module | None = None")
    assert "added after fully_shard" in f.message


def test_tp_module_left_replicated(line_of, fake_world):
    fx = importlib.import_module("placement_tp_replicated")
    rows, found = analyse(fx.setup(fake_world(2, 0, (2,), ("tp",))))
    assert [(f.kind, f.detail["param"], f.detail["reason"], f.detail["style"]) for f in found] == [
        ("uncovered_param", "mlp.fc1.weight", "tp_replicated", "ColwiseParallel")]
    assert found[0].detail["line"] == line_of(fx, "self.fc1 = nn.Linear")
    by_name = {r.name: r for r in rows}
    assert by_name["mlp.fc1.bias"].placements == ["Shard(dim=0)"]  # the rest of the plan is intact
    assert by_name["mlp.fc2.weight"].tp_style == "RowwiseParallel"


def test_fsdp_alone_is_clean_and_dumped(fake_world):
    fx = importlib.import_module("placement_fsdp_ok")
    rows, found = analyse(fx.setup(fake_world(2, 1, (2,), ("dp",))), rank=1)
    assert found == []
    fc1 = next(r for r in rows if r.name == "blocks.0.fc1.weight")
    assert (fc1.cls, fc1.placements, fc1.global_shape, fc1.local_shape, fc1.bytes_per_rank, fc1.fsdp) == (
        "DTensor", ["Shard(dim=0)"], [32, 16], [16, 16], 16 * 16 * 4, "blocks.0")
    assert (fc1.mesh_shape, fc1.mesh_dim_names, fc1.mesh_ranks) == ([2], ["dp"], "0..1")
    assert next(r for r in rows if r.name == "scale").fsdp == "<root>"
    table = render_placement_table(rows)
    assert "blocks.0.fc1.weight" in table and "S(0)" in table and "fsdp:blocks.0" in table
    assert "managed by FSDP2 (fully_shard on: <root>, blocks.0, blocks.1)" in table
    again = [PlacementRow.from_json(d) for d in placement_json(rows)]
    assert again == rows


def test_fsdp_plus_tp_2d_is_clean(fake_world):
    fx = importlib.import_module("placement_fsdp_tp_ok")
    rows, found = analyse(fx.setup(fake_world(4, 3, (2, 2), ("dp", "tp"))), rank=3)
    assert found == []
    fc2 = next(r for r in rows if r.name == "blocks.0.fc2.weight")
    assert fc2.mesh_dim_names == ["dp", "tp"] and fc2.placements == ["Shard(dim=0)", "Shard(dim=1)"]
    assert fc2.local_shape == [8, 16] and fc2.tp_style == "RowwiseParallel" and fc2.fsdp == "blocks.0"


def test_buffers_and_plain_models():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    rows = describe_model(model)
    buf = next(r for r in rows if r.name == "1.running_mean")
    assert (buf.role, buf.cls, buf.bytes_per_rank, buf.placements) == ("buffer", "Tensor", 12, None)
    assert coverage_findings(rows, [], [0]) == []
    if not dist.is_initialized():
        assert check_model(model) == []  # no process group: the local part only, nothing to flag


def _row(name, mesh_ranks="0..3", placements=("Shard(dim=0)",), cls="DTensor", fsdp=None, **kw):
    return PlacementRow(name=name, role="parameter", cls=cls, dtype="torch.float32",
                        mesh_shape=[4] if cls == "DTensor" else None,
                        mesh_dim_names=["dp"] if cls == "DTensor" else None,
                        mesh_ranks=mesh_ranks if cls == "DTensor" else None,
                        placements=list(placements) if cls == "DTensor" else None,
                        global_shape=[8], local_shape=[2] if cls == "DTensor" else [8],
                        bytes_per_rank=8 if cls == "DTensor" else 32, requires_grad=True,
                        module=name.rpartition(".")[0], module_type="Linear", fsdp=fsdp, **kw)


def test_other_mesh_and_plain_in_tp_model_rules():
    rows = [_row("a.w"), _row("b.w"), _row("c.w", mesh_ranks="0..6/2"), _row("d.w", cls="Tensor")]
    # d.w: a plain replicated parameter in a TP-only model is PyTorch's TP recipe, not a coverage bug; c.w on another
    # mesh trains correctly: a warning (what clip_grad_norm_/foreach optimizers would do), not a finding.
    assert coverage_findings(rows, [], [0]) == []
    [note] = mixed_mesh_notes(rows, [0, 1])
    assert note.kind == "mixed_meshes" and note.ranks == [0, 1] and note.detail["params"] == ["c.w"]
    assert note.detail["mesh_ranks"] == "0..6/2" and "clip_grad_norm_" in note.message
    assert mixed_mesh_notes([r for r in rows if r.name != "c.w"], [0]) == []
    frozen = _row("e.w", cls="Tensor")
    frozen.requires_grad = False
    f = coverage_findings([_row("a.w", fsdp="<root>"), frozen], ["<root>"], [0])
    assert f[0].detail["param"] == "e.w" and "frozen" in f[0].message


def test_merge_rank_findings_unions_ranks():
    rows = [_row("a.w", fsdp="<root>"), _row("x", cls="Tensor")]
    per_rank = [[f.to_json() for f in coverage_findings(rows, ["<root>"], [r])] for r in (0, 1, 2)]
    merged = merge_rank_findings(per_rank, [0, 1, 2])
    assert len(merged) == 1 and merged[0].ranks == [0, 1, 2]


def test_short_placements():
    assert [short_placement(p) for p in ("Shard(dim=1)", "Replicate()", "_StridedShard(dim=0, sf=2)",
                                         "Partial(sum)")] == ["S(1)", "R", "SS(0,sf=2)", "P(sum)"]


def test_fully_shard_ignored_params_are_not_a_coverage_gap():
    """fully_shard(ignored_params=...) leaves a parameter out on purpose (the fully_shard hook marks it); one added
    after fully_shard beside it is still flagged."""
    rows = [_row("blocks.0.weight", fsdp="blocks.0"),
            _row("blocks.0.temperature", cls="Tensor", fsdp_ignored=True),
            _row("blocks.0.adapter", cls="Tensor")]
    found = coverage_findings(rows, ["blocks.0"], [0, 1])
    assert [f.detail["params"] for f in found] == [["blocks.0.adapter"]]
