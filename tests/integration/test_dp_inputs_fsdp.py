"""FSDP2's data-parallel ranks fed the same batches: a same_batches warning over the data-parallel dims of the mesh
only (rank/autocheck/dp_inputs.py), on real gloo ranks.

    .venv/bin/python -m pytest -q tests/integration/test_dp_inputs_fsdp.py

The correct twin (fixtures/ok/fsdp_tp_sharded_loader.py, a DistributedSampler over the dp dim) runs in the corpus
of correct programs (test_correct_corpus.py).
"""
from __future__ import annotations

from pathlib import Path

from launch_helpers import FIXTURES, distcheck, load_report


def run_fixture(tmp_path: Path, fixture: str, nproc: int):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", str(nproc), "--timeout", "60", "--report-dir", str(out), "--",
                     str(FIXTURES / fixture)], timeout=240)
    return res, load_report(out)


def same_batches(res, report) -> dict:
    # a warning, never a finding: the verdict stays PASSED
    assert res.returncode == 0 and report["ok"] and report["findings"] == [], res.output
    (note,) = [w for w in report["warnings"] if w["kind"] == "same_batches"]
    return note


def test_fsdp2_ranks_reading_one_loader_get_the_same_batches_warning(line_of, tmp_path):
    note = same_batches(*run_fixture(tmp_path, "fsdp2_same_batches.py", nproc=2))
    call, loader = line_of("fsdp2_same_batches.py", "model(x)"), line_of("fsdp2_same_batches.py", "DataLoader(data")
    assert note["ranks"] == [0, 1] and note["detail"]["groups"] == [[0, 1]]
    # the line that called the root module (not a layer's call inside Sequential), and the loader's
    assert note["detail"]["line"] == call and note["detail"]["file"].endswith("fsdp2_same_batches.py")
    assert note["detail"]["loader"][1] == loader
    assert note["message"].startswith(f"ranks 0-1 (data parallel) fed the same batch at their first forward at "
                                      f"fsdp2_same_batches.py:{call}: every rank trains on the same data")
    assert f"the DataLoader built at fsdp2_same_batches.py:{loader} has no DistributedSampler: give it " \
           f"DistributedSampler(dataset)" in note["message"]


def test_a_2d_mesh_compares_within_each_dp_group_and_never_across_tp_peers(line_of, tmp_path):
    note = same_batches(*run_fixture(tmp_path, "fsdp_tp_same_batches.py", nproc=4))
    name = "fsdp_tp_same_batches.py"
    call, loader = line_of(name, "model(x)"), line_of(name, "DataLoader(data")
    # (dp, tp) = 2 x 2: ranks 0,2 and 1,3 must differ; the TP peers 0-1 and 2-3 share a batch and are no group
    assert note["ranks"] == [0, 1, 2, 3] and note["detail"]["groups"] == [[0, 2], [1, 3]]
    assert note["detail"]["line"] == call and note["detail"]["loader"][1] == loader
    assert note["message"].startswith(f"ranks 0,2 and ranks 1,3 (data parallel: one group per position on the "
                                      f"mesh's other dims, whose ranks rightly share a batch) fed the same batch at "
                                      f"their first forward at {name}:{call}")
    assert f"the DataLoader built at {name}:{loader} has no DistributedSampler: give it DistributedSampler(dataset, " \
           f"num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank())" in note["message"]
