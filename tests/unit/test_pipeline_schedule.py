"""The stages of a pipeline compared from their recorded schedules (analysis/pipeline_schedule.py): pure, no ranks.

    .venv/bin/python -m pytest -q tests/unit/test_pipeline_schedule.py
"""
from __future__ import annotations

from distcheck.analysis.pipeline_schedule import (CAUSE, fold_consequences, microbatch_rows, pipeline_findings,
                                                  schedules_of)
from distcheck.contract.findings import Finding

FILE = "/job/pp.py"


def record(stages, n=4, schedule="ScheduleGPipe", num_stages=2, group=(0, 1), batch=None, target=None, line=18,
           index=0, step_line=24):
    """One rank's record as rank/autocheck/pipeline_schedule.PipelineWatch writes it."""
    return {"index": index, "schedule": schedule, "n_microbatches": n, "stages": list(stages),
            "num_stages": num_stages, "group": list(group), "file": FILE, "line": line, "stepped": True,
            "step_file": FILE, "step_line": step_line,
            "inputs": [{"name": "arg 0", "shape": [batch, 16], "dim": 0, "dtype": "float32"}] if batch else [],
            "target": {"name": "target", "shape": [target, 1], "dim": 0, "dtype": "float32"} if target else None}


def findings_of(*per_rank):
    return pipeline_findings(schedules_of(dict(enumerate(per_rank))))


def test_stages_that_split_into_different_microbatch_counts_are_one_finding_naming_both():
    (f,) = findings_of([record([0], n=4, batch=16)], [record([1], n=2, target=16)])
    assert f.kind == "collective_mismatch" and f.ranks == [0, 1]
    assert ("stage 0 splits the batch into 4 microbatches of 4 rows (ScheduleGPipe at pp.py:18); "
            "stage 1 the targets into 2 of 8 (:18)") in f.message
    assert f.detail["cause"] == CAUSE and f.detail["fields"] == ["n_microbatches"]
    assert f.detail["line"] == 18 and f.detail["steps"] == {"0": [FILE, 24], "1": [FILE, 24]}
    assert "same n_microbatches" in f.message


def test_correct_gpipe_and_interleaved_schedules_agree():
    assert findings_of([record([0], batch=8)], [record([1], target=8)]) == []
    interleaved = dict(schedule="ScheduleInterleaved1F1B", num_stages=4)
    assert findings_of([record([0, 2], batch=8, **interleaved)], [record([1, 3], target=8, **interleaved)]) == []
    # a middle stage splits nothing: only its count is compared
    assert findings_of([record([0], num_stages=3, group=(0, 1, 2), batch=8)],
                       [record([1], num_stages=3, group=(0, 1, 2))],
                       [record([2], num_stages=3, group=(0, 1, 2), target=8)]) == []


def test_the_odd_stage_of_a_longer_pipeline_is_blamed_alone():
    four = dict(num_stages=4, group=(0, 1, 2, 3))
    (f,) = findings_of([record([0], batch=8, **four)], [record([1], **four)], [record([2], n=8, **four)],
                       [record([3], target=8, **four)])
    assert f.ranks == [2] and "stage 2 into 8 (:18)" in f.message


def test_schedule_class_num_stages_and_stage_ownership_are_compared():
    (f,) = findings_of([record([0], batch=8)], [record([1], schedule="Schedule1F1B", target=8, line=20)])
    assert f.detail["fields"] == ["schedule"] and "(Schedule1F1B at :20)" in f.message
    (f,) = findings_of([record([0], batch=8)], [record([1], num_stages=3, target=8)])
    assert f.detail["fields"] == ["num_stages"] and "stage 1 of 3" in f.message
    (f,) = findings_of([record([0], batch=8)], [record([0], batch=8)])  # both ranks built stage 0
    assert f.detail["fields"] == ["stages"] and f.ranks == [0, 1] and "stage 0 (rank 1)" in f.message


def test_same_count_but_a_batch_and_targets_of_different_rows():
    (f,) = findings_of([record([0], batch=16)], [record([1], target=8)])
    assert f.detail["fields"] == ["rows"]
    assert "4 microbatches of 4 rows" in f.message and "the targets into 4 of 2" in f.message


def test_uneven_batches_split_like_tensor_split():
    assert microbatch_rows(10, 4) == [3, 3, 2, 2]
    (f,) = findings_of([record([0], n=4, batch=10)], [record([1], n=3, target=10)])
    assert "4 microbatches of 2-3 rows" in f.message and "the targets into 3 of 3-4" in f.message


def test_separate_pipelines_and_later_schedules_pair_by_group_and_order():
    # two pipelines (ranks 0,1 and 2,3) that each agree, but differ from each other: no finding
    assert findings_of([record([0], group=(0, 1), batch=8)], [record([1], group=(0, 1), target=8)],
                       [record([0], n=2, group=(2, 3), batch=8)], [record([1], n=2, group=(2, 3), target=8)]) == []
    # the second schedule (an eval one) disagrees: one finding, at its line
    (f,) = findings_of([record([0], batch=8), record([0], batch=8, index=1, line=40)],
                       [record([1], target=8), record([1], n=2, target=8, index=1, line=40)])
    assert f.detail["line"] == 40
    # one rank's record only (its peer died first): nothing to compare
    assert findings_of([record([0], batch=8)], []) == []


def test_failures_inside_step_become_evidence_and_others_stay():
    (pipe,) = findings_of([record([0], n=4, batch=16)], [record([1], n=2, target=16)])
    torch_error = Finding("rank_failure", [1], "rank 1 raised RuntimeError: The size of tensor a (4) ...",
                          {"exception": "RuntimeError", "error": "The size of tensor a (4) must match the size of "
                           "tensor b (8) at non-singleton dimension 0", "file": FILE, "line": 24,
                           "traceback": 'File "/v/torch/distributed/pipelining/stage.py", line 1, in _recv',
                           "consequences": {"0": "RuntimeError: Connection closed by peer"}})
    elsewhere = Finding("rank_failure", [2], "rank 2 raised ValueError at other.py:3",
                        {"exception": "ValueError", "error": "bad", "file": "/job/other.py", "line": 3})
    out = fold_consequences([pipe, torch_error, elsewhere])
    assert out == [pipe, elsewhere]
    assert pipe.detail["consequences"] == {"1": "RuntimeError: The size of tensor a (4) must match the size of "
                                                "tensor b (8) at non-singleton dimension 0",
                                           "0": "RuntimeError: Connection closed by peer"}
    assert ("Then, inside step() at pp.py:24, rank 1 failed with torch's RuntimeError: The size of tensor a (4) "
            "must match the size of tensor b (8) at non-singleton dimension 0 (rank 0 then lost its peer)"
            ) in pipe.message
    assert pipe.detail["failed"] == {"ranks": [1], "error": pipe.detail["consequences"]["1"], "file": FILE,
                                     "line": 24}  # the absorbed failure keeps its line


def test_a_signal_after_the_step_began_is_evidence_but_not_without_a_mismatch():
    (pipe,) = findings_of([record([0], n=4, batch=16)], [record([1], n=2, target=16)])
    abort = Finding("rank_failure", [0], "rank 0 died from SIGABRT", {"signal": "SIGABRT", "exit_code": -6})
    assert fold_consequences([pipe, abort]) == [pipe] and pipe.detail["consequences"] == {"0": "died from SIGABRT"}
    assert fold_consequences([abort]) == [abort]


def test_a_rank_holding_the_first_and_last_stage_compares_its_batch_with_its_targets():
    v = dict(schedule="ScheduleZBVZeroBubble", num_stages=4)
    both = record([0, 3], batch=8, **v)
    both["target"] = {"name": "target", "shape": [4, 1], "dim": 0, "dtype": "float32"}
    (f,) = findings_of([both], [record([1, 2], **v)])
    assert f.detail["fields"] == ["rows"] and f.ranks == [0]
    both["target"]["shape"] = [8, 1]
    assert findings_of([both], [record([1, 2], **v)]) == []
