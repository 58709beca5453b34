"""A middle pipeline stage whose input_args are not what its predecessor sends (rank/autocheck/pipeline_schedule.py,
analysis/pipeline_schedule.input_mismatches), on 4 real gloo ranks. The correct twin
(fixtures/ok/pipeline_stage_inputs.py) is silent in tests/integration/test_correct_corpus.py."""
from __future__ import annotations

from launch_helpers import FIXTURES, distcheck, load_report


def test_a_middle_stage_expecting_another_width_names_both_stages_not_the_matmul_error(line_of, tmp_path):
    out = tmp_path / "report"
    res = distcheck(["run", "--nproc", "4", "--timeout", "60", "--report-dir", str(out), "--",
                     str(FIXTURES / "pp_stage_input_mismatch.py")], timeout=240)
    report = load_report(out)
    assert res.returncode == 1, res.output
    (f,) = report["findings"]  # torch's error and the peers' lost connections are its evidence
    line = line_of("pp_stage_input_mismatch.py", "stage = PipelineStage(")
    assert f["kind"] == "collective_mismatch" and f["ranks"] == [1, 2] and f["detail"]["fields"] == ["inputs"]
    assert f["detail"]["line"] == line and f["detail"]["file"].endswith("pp_stage_input_mismatch.py")
    assert (f"stage 2 (rank 2) expects [2, 16] float32 (input_args of its PipelineStage at "
            f"pp_stage_input_mismatch.py:{line}); stage 1 (rank 1) sends [2, 8] float32 (its output; PipelineStage "
            f"at pp_stage_input_mismatch.py:{line})") in f["message"], f["message"]
    assert "mat1 and mat2 shapes cannot be multiplied (2x8 and 16x8)" in f["detail"]["consequences"]["2"]
