"""FSDP1 (``FullyShardedDataParallel``) seen through its original parameters, without launching ranks.

Real FSDP1 models on torch's fake process group (rank R of 4: collectives return at once): what each rank holds
(analysis/flat_shards.py against torch's own shard metadata), the placement rows and table (rank/checks/placement.py),
the names and shapes records take (rank/checks/fsdp1.py, rank/records.py), the replica keys, and what the
FullyShardedDataParallel hook compares before torch shards (rank/autocheck/patches.py). The values of an
all-gather are not real on the fake group: the sharded strategies' records are checked by name and shape here and
by value in tests/integration/test_fsdp1.py; NO_SHARD needs no collective and is checked by value.

    .venv/bin/python -m pytest -q tests/unit/test_fsdp1_flat_params.py
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distcheck.analysis.flat_shards import chunk_bounds, held_numels, holdings_text
from distcheck.analysis.placement import PlacementRow, coverage_findings, flat_label, render_placement_table
from distcheck.analysis.replica_drift import drift_finding, fingerprint_row
from distcheck.rank.checks.fingerprint import fingerprint


@pytest.fixture
def world():
    """init(rank, world_size) on the fake process group; torn down afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")

    def init(rank: int, size: int = 4) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def build(strategy: str = "FULL_SHARD", orig: bool = True, ignore_gate: bool = False, mesh=None):
    """fixtures/fsdp1_ignored_module_drift.py's model, one unit per Block; (the plain model, the FSDP1 one)."""
    from fsdp1_ignored_module_drift import Block, Model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    net = Model()
    plain = {n: p.detach().clone() for n, p in net.named_parameters()}
    import warnings

    with warnings.catch_warnings():  # torch deprecates NO_SHARD ("use DistributedDataParallel"); still supported
        warnings.filterwarnings("ignore", "The `NO_SHARD` sharding strategy is deprecated", FutureWarning)
        model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy],
                     device_id=torch.device("cpu"), use_orig_params=orig, device_mesh=mesh,
                     ignored_modules=[net.gate] if ignore_gate else None)
    return plain, model


# -- what each rank holds (pure) --------------------------------------------------------------------------------------

@pytest.mark.parametrize("total,world", [(322, 2), (5, 4), (3, 4), (0, 2), (1120, 4), (7, 3)])
def test_chunks_are_torchs_chunk(total, world):
    chunks = torch.arange(total).chunk(world) if total else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    bounds = chunk_bounds(total, world)
    assert len(bounds) == world and [b for b in bounds if b[1] > b[0]] == expected


def test_held_numels_split_parameters_at_chunk_boundaries_and_skip_padding():
    # the root unit of 2 ranks with use_orig_params=True: inp.weight, inp.bias, head.weight, head.bias, 1 pad
    held = held_numels([256, 32, 32, 1, 1], [False, False, False, False, True], 2)
    assert held == [[161, 95], [0, 32], [0, 32], [0, 1]]
    assert holdings_text(held[0]) == "161|95"
    with pytest.raises(ValueError):
        held_numels([1, 2], [False], 2)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_each_ranks_count_is_torchs_own_shard_metadata(world, rank):
    """What rank R holds by the pure chunking equals torch's _shard_param_infos on rank R, for every rank."""
    from distcheck.rank.checks.fsdp1 import original_params, units

    world(rank)
    for orig in (True, False):
        _, model = build(orig=orig)
        for unit in units(model):
            infos = unit.handle.flat_param._shard_param_infos
            for op, info in zip(original_params(unit), infos):
                assert op.held[rank] == (info.numel_in_shard if info.in_shard else 0) == op.here
                assert sum(op.held) == torch.Size(op.shape).numel() and len(op.held) == 4


# -- the placement rows and table -------------------------------------------------------------------------------------

@pytest.mark.parametrize("orig", [True, False])
def test_rows_are_the_original_parameters_with_what_each_rank_holds(world, orig):
    from distcheck.rank.checks.placement import describe_model

    world(2)
    plain, model = build(orig=orig, ignore_gate=True)
    rows = describe_model(model)
    params = {r.name: r for r in rows if r.role == "parameter"}
    assert set(params) == set(plain)  # no _fsdp_wrapped_module., no _flat_param: the unwrapped model's names
    for name, r in params.items():
        assert r.global_shape == list(plain[name].shape), name
    fc = params["blocks.0.fc.weight"]
    assert (fc.fsdp, fc.fsdp1, fc.mesh_dim_names, fc.mesh_shape, fc.mesh_ranks) == (
        "blocks.0", "FULL_SHARD", ["shard"], [4], "0..3")
    assert fc.local_shape == [fc.flat_shard[2]] and fc.bytes_per_rank == 4 * fc.flat_shard[2]
    assert fc.module == "blocks.0.fc" and fc.module_type == "Linear"
    gate = params["gate.weight"]
    assert gate.fsdp is None and gate.fsdp_ignored and gate.local_shape == [1, 16]
    assert params["inp.weight"].fsdp == "<root>" and params["inp.weight"].line is not None
    assert coverage_findings(rows, ["<root>", "blocks.0", "blocks.1"], [2]) == []
    table = render_placement_table(rows)
    assert f"flat {holdings_text(fc.flat_shard)}" in table and "fsdp1:blocks.0 FULL_SHARD" in table
    assert "managed by FSDP1 (units: <root>, blocks.0, blocks.1; FULL_SHARD); 2 ignored by FSDP" in table
    assert next(line for line in table.splitlines() if line.startswith("gate.weight ")).endswith(" ignored")
    assert [PlacementRow.from_json(r.to_json()) for r in rows] == rows


def test_hybrid_and_no_shard_rows_say_who_replicates(world):
    from torch.distributed.device_mesh import init_device_mesh

    from distcheck.rank.checks.placement import describe_model

    world(3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _, hybrid = build("HYBRID_SHARD", mesh=mesh)
    row = next(r for r in describe_model(hybrid) if r.name == "blocks.1.fc.weight")
    assert (row.mesh_dim_names, row.mesh_shape, row.mesh_ranks, len(row.flat_shard)) == (
        ["replicate", "shard"], [2, 2], "0..3", 2)
    assert flat_label(row) == f"R,flat {holdings_text(row.flat_shard)}" and row.local_shape == [row.flat_shard[1]]
    _, whole = build("NO_SHARD")
    row = next(r for r in describe_model(whole) if r.name == "blocks.1.fc.weight")
    assert (row.mesh_dim_names, row.flat_shard, row.local_shape, flat_label(row)) == (["replicate"], [256], [256], "R")


def test_blocks_wrapped_without_the_root_is_uncovered_in_fsdp1_words(world):
    from fsdp1_ignored_module_drift import Model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from distcheck.rank.checks import fsdp1
    from distcheck.rank.checks.placement import describe_model

    world(0)
    net = Model()
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FSDP(block, device_id=torch.device("cpu"), use_orig_params=True)
    rows = describe_model(net)
    found = coverage_findings(rows, [u.label for u in fsdp1.units(net)], [0])
    [f] = found
    assert (f.kind, f.detail["reason"]) == ("uncovered_param", "not_wrapped")
    assert f.detail["params"] == ["inp.weight", "inp.bias", "gate.weight", "gate.bias", "out.weight", "out.bias"]
    assert "not managed by FSDP1" in f.message and "FullyShardedDataParallel(model)" in f.message
    assert "fully_shard" not in f.message


# -- records: full tensors under the unwrapped names ------------------------------------------------------------------

@pytest.mark.parametrize("orig", [True, False])
def test_records_are_full_tensors_named_like_the_unwrapped_model(world, orig):
    from distcheck.rank.checks.fsdp1 import full_tensors

    world(1)
    plain, model = build(orig=orig)
    got = dict(full_tensors(list(model.named_parameters()), [model]))
    # records normalize the names (rank/records.normalize_key); the full shapes come back, never a flat shard
    from distcheck.rank.records import normalize_key

    assert {normalize_key(n): list(t.shape) for n, t in got.items()} == {n: list(t.shape) for n, t in plain.items()}


@pytest.mark.parametrize("orig", [True, False])
def test_no_shard_records_hold_the_values_and_gradients(world, orig):
    from distcheck.rank.checks.fsdp1 import full_tensors
    from distcheck.rank.records import _module_parts, normalize_key

    world(2)
    plain, model = build("NO_SHARD", orig=orig)
    got = {normalize_key(n): t for n, t in full_tensors(list(model.named_parameters()), [model])}
    assert set(got) == set(plain) and all(torch.equal(got[n], plain[n]) for n in plain)
    assert list(full_tensors(list(model.named_parameters()), [model], gradients=True)) == []  # no backward yet
    flat = model._handle.flat_param  # the root unit's: FSDP1 reads gradients from it, whatever the views hold
    flat.grad = torch.arange(flat.numel(), dtype=flat.dtype)
    grads = {normalize_key(n): g for n, g in full_tensors(list(model.named_parameters()), [model], gradients=True)}
    first = model._handle.flat_param._fqns[0]  # the root unit's first parameter starts the flat gradient
    assert torch.equal(grads[first].reshape(-1), torch.arange(grads[first].numel(), dtype=flat.dtype))
    keys = [meta.key for meta, _ in _module_parts(model)]
    assert f"{first}.grad" in keys and "inp.weight" in keys and not any("_flat_param" in k for k in keys)


# -- replicas ---------------------------------------------------------------------------------------------------------

def test_replica_keys_compare_only_ranks_holding_the_same_chunk(world):
    from torch.distributed.device_mesh import init_device_mesh

    from distcheck.rank.checks import fsdp1
    from distcheck.rank.checks.replicas import named_tensors, replica_key

    world(3)
    _, sharded = build()
    items, key = fsdp1.replica_items(sharded, named_tensors("model", sharded), replica_key)
    names = [n for n, role, _ in items if role == "parameter"]
    assert len(names) == len(set(names)) == 10 and "blocks.0.fc.weight" in names
    assert {key(t) for n, role, t in items if n.startswith("blocks.0.")} == {("fsdp1", "blocks.0", 3)}
    assert fsdp1.replicated(fsdp1.units(sharded)[0]) is None  # FULL_SHARD: no other rank holds this chunk
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _, hybrid = build("HYBRID_SHARD", mesh=mesh)
    unit = fsdp1.units(hybrid)[1]
    assert fsdp1.shard_key(unit) == ("fsdp1", "blocks.0", 1) and fsdp1.replicated(unit) == [1, 3]
    assert fsdp1.data_parallel_ranks(hybrid) == [0, 1, 2, 3] and fsdp1.data_parallel_index(hybrid) == (3, 4)
    _, whole = build("NO_SHARD")
    assert fsdp1.shard_key(fsdp1.units(whole)[0])[2] == 0 and fsdp1.replicated(fsdp1.units(whole)[0]) == [0, 1, 2, 3]


def test_drift_of_an_ignored_module_names_the_wrapping_line():
    key = ["fsdp1_ignored", [0, 1], ["/w/train.py", 51]]
    site = {"file": "/w/train.py", "line": 60}

    def row(step, gate):
        out = {"step": step, "params": [fingerprint_row("gate.weight", key, fingerprint(gate))]}
        return out if step < 0 else dict(out, backwards=1, unsynced=0, site=site, no_sync_site=None)

    same = torch.ones(1, 16)
    states = {r: {"checked": [row(-1, same), row(0, same * (r + 2))]} for r in (0, 1)}  # the replica_drift states
    finding, _ = drift_finding(states)
    assert (finding.kind, finding.ranks, finding.detail["params"]) == ("tensor_divergence", [0, 1], ["gate.weight"])
    detail = finding.detail
    assert (detail["cause"], detail["file"], detail["line"]) == ("fsdp1_ignored", "/w/train.py", 51)
    assert "ignored_modules of FullyShardedDataParallel(...) at train.py:51" in finding.message
    assert "after the first optimizer.step() (train.py:60)" in finding.message


# -- before torch shards ----------------------------------------------------------------------------------------------

def test_what_fsdp1_leaves_per_rank_decides_what_is_compared(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from distcheck.rank.autocheck.patches import fsdp1_prewrap

    world(0)

    def bind(**kwargs):
        return inspect.signature(FSDP.__init__).bind(None, nn.Linear(2, 2), **kwargs).arguments

    assert fsdp1_prewrap(bind(), 4) == (None, True)  # each rank shards its own copy: values count
    assert fsdp1_prewrap(bind(sync_module_states=True), 4) == (None, False)  # rank 0's broadcast: structure only
    pair = dist.new_group([0, 1])
    assert fsdp1_prewrap(bind(process_group=pair), 4) == ([0, 1], True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    assert fsdp1_prewrap(bind(device_mesh=mesh), 4) == ([0, 1, 2, 3], True)
    assert fsdp1_prewrap(bind(process_group=(mesh.get_group(1), mesh.get_group(0))), 4) == (None, True)
    alone = dist.new_group([0])
    assert fsdp1_prewrap(bind(process_group=(pair, alone)), 4) is None  # 2 x 1 ranks do not tile the 4: unknown


def test_a_non_finite_flat_gradient_is_named_by_the_original_parameter_that_holds_it(world):
    """use_orig_params=False: the optimizer only sees FlatParameters; the NaN watch names the parameter inside, by
    torch's own shard metadata (rank 3 of 4 holds the end of blocks.0's flat parameter: fc.weight's tail, fc.bias)."""
    from distcheck.rank.autocheck.discovery import user_name
    from distcheck.rank.autocheck.nan_watch import bad_flat_parts

    world(3)
    _, model = build(orig=False)
    name, flat = next((n, p) for n, p in model.named_parameters() if "blocks.0" in n)
    held = [(fqn, info) for fqn, info in zip(flat._fqns, flat._shard_param_infos) if info.in_shard]
    assert [fqn for fqn, _ in held] == ["fc.weight", "fc.bias"]
    for fqn, info in held:
        grad = torch.zeros_like(flat)
        grad[info.offset_in_shard + info.numel_in_shard - 1] = float("inf")
        assert bad_flat_parts(user_name(name), flat, grad) == [f"blocks.0.{fqn}"]
    assert bad_flat_parts(user_name(name), flat, torch.zeros_like(flat)) is None
