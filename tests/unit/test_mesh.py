"""distcheck mesh: pure mesh arithmetic, torch's DeviceMesh on the fake process group, the CLI, torch's errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from distcheck.analysis.mesh import (LiveMeshView, MeshSpec, coordinate, dim_groups, group_of, live_mesh_findings,
                                     mesh_findings, model_findings, plan_mesh, shard_sizes)
from distcheck.commands.mesh import parse_names, parse_shape
from distcheck.errors import UsageError



@pytest.fixture
def no_pg():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- pure


def test_parse_shape_and_names():
    assert parse_shape("64,8,8", 4096) == ((64, 8, 8), [])
    assert parse_shape("-1,8,8", 4096) == ((64, 8, 8), [])
    shape, found = parse_shape("7,-1", 100)
    assert shape == (7, 0) and found[0].kind == "mesh_mismatch" and found[0].ranks == list(range(100))
    for bad in ("", "8,,2", "8,x", "0,4", "-1,-1", "-3,2"):
        with pytest.raises(UsageError):
            parse_shape(bad, 64)
    assert parse_names("dp,tp", 2) == ("dp", "tp")
    for bad in ("dp", "dp,dp", "dp,"):
        with pytest.raises(UsageError):
            parse_names(bad, 2)


def test_coordinates_and_groups_at_4096():
    shape = (64, 8, 8)
    assert coordinate(shape, 600) == (9, 3, 0)
    assert group_of(shape, 1, 600) == [576, 584, 592, 600, 608, 616, 624, 632]
    assert group_of(shape, 2, 600) == list(range(600, 608))
    assert group_of(shape, 0, 600)[:3] == [24, 88, 152] and len(group_of(shape, 0, 600)) == 64
    groups = dim_groups(shape, 0)
    assert tuple(groups.shape) == (64, 64)
    plan = plan_mesh(MeshSpec(4096, shape, ("dp", "tp", "pp")))
    assert [d.num_groups for d in plan.dims] == [64, 512, 512] and plan.uncovered is None
    assert not mesh_findings(MeshSpec(4096, shape))


def test_mesh_smaller_and_bigger_than_world():
    small = mesh_findings(MeshSpec(1024, (8, 8, 8)))
    assert [f.kind for f in small] == ["mesh_mismatch"] and small[0].ranks == list(range(512, 1024))
    assert coordinate((8, 8, 8), 600) is None
    big = mesh_findings(MeshSpec(2, (2, 2), ("dp", "tp")))
    assert big[0].ranks == [0, 1] and "needs 2*2=4 ranks" in big[0].message


def test_shard_sizes_follow_torch_chunk():
    assert shard_sizes(10, 4) == [3, 3, 3, 1]
    assert shard_sizes(32, 64)[:32] == [1] * 32 and shard_sizes(32, 64)[32:] == [0] * 32
    assert shard_sizes(5, 4) == [2, 2, 1, 0]  # torch.chunk: ceil-sized, the last ranks get nothing


def test_model_findings_heads_and_uneven_linear():
    import mesh_model_heads
    from distcheck.rank.checks.mesh import build_meta_model, model_shapes

    params, attrs, layers = model_shapes(build_meta_model(mesh_model_heads.build))
    bad = model_findings(MeshSpec(64, (8, 8), ("dp", "tp")), params, attrs, layers)
    assert [f.kind for f in bad.findings] == ["mesh_mismatch"] and bad.findings[0].detail["value"] == 12
    ok = model_findings(MeshSpec(64, (16, 4), ("dp", "tp")), params, attrs, layers)
    assert ok.findings == []
    assert ok.params["0.fc1.weight"]["shards"]["tp"]["sizes"] == [768, 768]
    # A Linear that divides by tp on neither dim, and more pipeline stages than layers.
    from distcheck.analysis.mesh import ParamShape
    odd = model_findings(MeshSpec(48, (3, 16), ("tp", "pp")), [ParamShape("w", (10, 20), "Linear")], [],
                         {"layers": 4})
    assert sorted(f.detail.get("param", f.detail.get("container")) for f in odd.findings) == ["layers", "w"]


def test_live_mesh_findings():
    def view(rank, shape=(2, 2), groups=None):
        mesh = (0, 1, 2, 3)
        coord = coordinate(shape, rank)
        g = groups if groups is not None else [group_of(shape, d, rank) for d in range(len(shape))]
        return LiveMeshView(rank, 4, shape, ("dp", "tp"), mesh, coord, g)

    good = {r: view(r) for r in range(4)}
    assert live_mesh_findings(good) == []
    odd_shape = dict(good)
    odd_shape[3] = LiveMeshView(3, 4, (4, 1), ("dp", "tp"), (0, 1, 2, 3), (3, 0), [[0, 1, 2, 3], [3]])
    f = live_mesh_findings(odd_shape)
    assert len(f) == 1 and f[0].ranks == [3] and f[0].kind == "mesh_mismatch"
    bad_group = dict(good)
    bad_group[1] = view(1, groups=[[1, 3], [0, 1, 2]])
    f = live_mesh_findings(bad_group)
    assert f and all(x.kind == "mesh_mismatch" for x in f) and 1 in f[0].ranks
    partial = {r: LiveMeshView(r, 8, (2, 2), None, (0, 1, 2, 3), coordinate((2, 2), r) if r < 4 else None,
                               [group_of((2, 2), d, r) for d in range(2)] if r < 4 else [None, None])
               for r in range(8)}
    f = live_mesh_findings(partial)
    assert [x.ranks for x in f] == [[4, 5, 6, 7]]


# ------------------------------------------------------------------------------------ torch on the fake pg


def test_torch_agrees_on_every_rank_of_a_small_world(no_pg):
    from distcheck.rank.checks.mesh import simulate_rank

    spec = MeshSpec(24, (2, 3, 4), ("dp", "cp", "tp"))
    views = [simulate_rank(spec, r) for r in range(24)]
    assert all(v.agrees and not v.error for v in views)
    assert views[17].coordinate == (1, 1, 1) and views[17].groups[2] == [16, 17, 18, 19]


def test_torch_is_silent_about_a_mesh_smaller_than_the_world(no_pg):
    from distcheck.rank.checks.mesh import simulate_rank

    spec = MeshSpec(1024, (8, 8, 8))
    v = simulate_rank(spec, 600)
    assert v.coordinate is None and v.error == ""  # what torch does not catch and distcheck does
    big = simulate_rank(MeshSpec(2, (2, 2)), 0)
    assert "bigger than default world size" in big.error


def _cli(args, capsys):
    from distcheck import cli

    code = cli.main(["mesh", *args])
    return code, capsys.readouterr()


def test_cli_4096_ok_and_1024_mismatch(no_pg, tmp_path, capsys):
    code, out = _cli(["--world-size", "4096", "--shape", "64,8,8", "--names", "dp,tp,pp", "--rank", "600",
                      "--report-dir", str(tmp_path / "a")], capsys)
    assert code == 0, out.out
    assert "rank 600: (dp=9, tp=3, pp=0)" in out.out
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    assert rep["ok"] and rep["mesh"]["dims"][1]["num_groups"] == 512
    assert rep["ranks"][0]["rank"] == 600 and rep["ranks"][0]["agrees_with_torch"]
    code, out = _cli(["--world-size", "1024", "--shape", "8,8,8", "--rank", "600",
                      "--report-dir", str(tmp_path / "b")], capsys)
    assert code == 1
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    assert [f["kind"] for f in rep["findings"]] == ["mesh_mismatch"]
    assert rep["findings"][0]["ranks"] == list(range(512, 1024))
    assert "rank 600: no coordinate" in out.out


def test_cli_model_heads(no_pg, tmp_path, capsys):
    import mesh_model_heads  # a fixture script (tests/conftest.py puts fixtures/ on sys.path)

    spec = f"{mesh_model_heads.__file__}:build"
    code, out = _cli(["--world-size", "64", "--shape", "8,8", "--names", "dp,tp", "--model", spec,
                      "--report-dir", str(tmp_path / "a")], capsys)
    assert code == 1 and "heads 12" in out.out
    code, out = _cli(["--world-size", "64", "--shape", "16,4", "--names", "dp,tp", "--model", spec,
                      "--report-dir", str(tmp_path / "b")], capsys)
    assert code == 0, out.out
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    shapes = {r["param"]: r["local_shape"] for r in rep["model"]["local_shapes"] if r["rank"] == 0}
    assert shapes["0.fc1.weight"] == [48, 768]  # 3072 / tp 4 / dp 16, as torch's DTensor computes it


@pytest.mark.parametrize("args, words", [
    (["--world-size", "8", "--shape", "2,x"], "'x' is not an integer"),
    (["--world-size", "8", "--shape", "2,4", "--names", "dp"], "1 names but --shape has 2 dims"),
    (["--world-size", "zero", "--shape", "2"], "not an integer"),
    (["--world-size", "8", "--shape", "2,4", "--rank", "8"], "outside the world"),
    (["--world-size", "8", "--shape", "2,4", "--model", "x.py:f"], "--model needs --names"),
])
def test_cli_bad_input_is_one_line_exit_2(args, words, capsys, tmp_path):
    code, out = _cli([*args, "--report-dir", str(tmp_path)], capsys)
    assert code == 2 and words in out.err and len(out.err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------- torch's own errors


def test_mesh_error_finding_points_at_the_users_line(no_pg):
    import mesh_2x2_on_2_ranks
    from distcheck.rank.checks.mesh import mesh_error_finding
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    with pytest.raises(RuntimeError) as info:
        mesh_2x2_on_2_ranks.main()
    f = mesh_error_finding(info.value, info.value.__traceback__)
    source = Path(mesh_2x2_on_2_ranks.__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(source, 1) if "init_device_mesh(device, (2, 2)" in t)
    assert f is not None and f.kind == "mesh_mismatch" and f.ranks == [1]
    assert f.detail["line"] == line and f.detail["file"].endswith("mesh_2x2_on_2_ranks.py")
    assert f"mesh_2x2_on_2_ranks.py:{line}" in f.message and "needs 4 ranks but the world has 2" in f.message
    assert f.detail["shape"] == [2, 2]
    try:
        raise ValueError("unrelated")
    except ValueError as exc:
        assert mesh_error_finding(exc, exc.__traceback__) is None
