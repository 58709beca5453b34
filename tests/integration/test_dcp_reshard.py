"""The DCP resume round trip under another sharding (rank/autocheck/dcp_roundtrip.py), on real gloo ranks: an
FSDP2 checkpoint read into a whole bf16 copy is named at the load, with the save's line. Its correct twin (both
directions, fp32) is fixtures/ok/dcp_reshard_eval.py in tests/integration/test_correct_corpus.py."""
from __future__ import annotations

from launch_helpers import FIXTURES, distcheck, load_report


def test_a_sharded_checkpoint_loaded_whole_into_bf16_names_the_load_the_save_and_the_cast(line_of, tmp_path):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "2", "--timeout", "60", "--report-dir", str(out), "--",
                     str(FIXTURES / "dcp_reshard_bf16.py")], timeout=150)
    report = load_report(out)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]
    load, save = line_of("dcp_reshard_bf16.py", "# the load"), line_of("dcp_reshard_bf16.py", "dcp.save(")
    assert f["kind"] == "bad_values" and f["ranks"] == [0, 1], f
    assert f["detail"]["why"] == "roundtrip_cast" and f["detail"]["line"] == load and f["detail"]["save"]["line"] == save
    # every parameter came back rounded, on both ranks, whichever rank's shard it was read from
    assert f["detail"]["keys"] == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    assert f["message"].startswith(f"dcp.load at dcp_reshard_bf16.py:{load} read back other values than dcp.save at "
                                   f"dcp_reshard_bf16.py:{save} wrote to the same checkpoint: 'model.0.bias'")
    assert "the checkpoint holds float32 and they were loaded into bfloat16 tensors" in f["message"]
