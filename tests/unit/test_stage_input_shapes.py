"""What passes between pipeline stages (analysis/pipeline_schedule.input_mismatches): a stage's declared input
against what the stage before it sends, middle stages included. Pure, no ranks; the real 4-stage pipelines are
tests/integration/test_pipeline_stage_inputs.py's and fixtures/ok/pipeline_stage_inputs.py's (corpus)."""
from __future__ import annotations

from distcheck.analysis.pipeline_schedule import CAUSE, pipeline_findings, schedules_of

FILE = "/job/pp.py"


def meta(*shape, dtype="float32"):
    return {"shape": list(shape), "dtype": dtype}


def record(stage, inputs=None, outputs=None, sent=None, num_stages=4, line=30):
    io = {"stage": stage, "inputs": inputs, "outputs": outputs, "file": FILE, "line": line}
    if sent is not None:
        io["sent"] = sent
    return {"index": 0, "schedule": "ScheduleGPipe", "n_microbatches": 4, "stages": [stage],
            "num_stages": num_stages, "group": list(range(num_stages)), "file": FILE, "line": 40, "stepped": True,
            "step_file": FILE, "step_line": 44, "inputs": [], "target": None, "io": [io]}


def findings_of(*records):
    return pipeline_findings(schedules_of({r: [rec] for r, rec in enumerate(records)}))


def test_a_middle_stage_expecting_another_width_than_its_predecessor_sends_names_both_stages_and_lines():
    (f,) = findings_of(record(0, [meta(2, 16)], sent=[meta(2, 16)]), record(1, [meta(2, 16)], sent=[meta(2, 8)]),
                       record(2, [meta(2, 16)], line=31), record(3, [meta(2, 8)]))
    assert f.kind == "collective_mismatch" and f.ranks == [1, 2] and f.detail["cause"] == CAUSE
    assert f.detail["fields"] == ["inputs"] and f.detail["line"] == 31 and f.detail["file"] == FILE
    assert ("disagree on what a stage receives: stage 2 (rank 2) expects [2, 16] float32 (input_args of its "
            "PipelineStage at pp.py:31); stage 1 (rank 1) sends [2, 8] float32 (its output; PipelineStage at "
            "pp.py:30)") in f.message
    assert f.detail["stage_inputs"][0]["from_stage"] == 1 and f.detail["stage_inputs"][0]["measured"]


def test_dtypes_and_declared_outputs_count_and_agreeing_or_unknown_shapes_are_silent():
    (f,) = findings_of(record(0, outputs=[meta(2, 16, dtype="bfloat16")]), record(1, [meta(2, 16)]), record(2), record(3))
    assert "stage 1 (rank 1) expects [2, 16] float32" in f.message and "sends [2, 16] bfloat16 (its output_args" \
        in f.message
    # what it really sent wins over what it declared
    assert findings_of(record(0, outputs=[meta(2, 8)], sent=[meta(2, 16)]), record(1, [meta(2, 16)]), record(2),
                       record(3)) == []
    # no input_args (torch infers them) or nothing known of the sender: nothing to compare
    assert findings_of(record(0, sent=[meta(2, 16)]), record(1, sent=[meta(2, 8)]), record(2), record(3)) == []
    assert findings_of(record(0), record(1, [meta(2, 16)]), record(2, [meta(2, 3)]), record(3)) == []
