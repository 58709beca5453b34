"""The stages of one pipeline must run the same schedule: class, n_microbatches, num_stages, one rank per stage.

    python -m distcheck run --nproc 2 -- fixtures/pp_microbatch_mismatch.py   # 4 microbatches on stage 0, 2 on 1

Each rank records the schedules it builds, and what their first ``step()`` splits, before torch runs it
(rank/autocheck/pipeline_schedule.py, the ``pipeline`` key of ``autocheck-rank<R>.json``). torch checks none of
this across ranks: a stage that splits its batch into other microbatches than its peers fails later inside
pipelining's shape inference or loss ("The size of tensor a (4) must match the size of tensor b (8)"), or waits for
a microbatch that is never sent. Here the k-th schedule each rank built for a pipeline (its ranks) is compared
across them; a disagreement is one ``collective_mismatch`` naming every stage's value and line, and
:func:`fold_consequences` keeps the failures it caused inside ``step()`` as its evidence, not as findings of their
own (as analysis/split_matrix.py does for a backend abort). Pure: plain JSON in, findings out.

Between the stages: a stage that expects (its PipelineStage's ``input_args``) other microbatch shapes or dtypes
than its predecessor sends (what it passed on at shape inference or its first forward, else its declared
``output_args``) is the same
finding, field ``inputs``, naming both stages, their values and the lines that built them: middle stages included,
whose input no batch or target shows.

The point-to-point pairs the stages exchange (count, shape and dtype per peer) are compared from the trace by
analysis/trace_align.find_p2p_mismatches: pipelining sends through the traced ``isend``/``irecv`` and
``batch_isend_irecv``.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from distcheck.analysis.check_verdict import Verdict
from distcheck.contract.autocheck_file import RunFields
from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract.site import file_line

CAUSE = "pipeline_schedule_mismatch"
PIPELINING = "/torch/distributed/pipelining/"

FIXES = {
    "schedule": "every stage of a pipeline must run the same schedule class",
    "n_microbatches": "every stage's schedule must split the batch into the same n_microbatches: take it from one "
                      "config on every rank",
    "num_stages": "every PipelineStage of a pipeline must be built with the same num_stages",
    "stages": "each stage index 0..num_stages-1 must be held by exactly one rank of the pipeline",
    "rows": "the first stage's batch and the last stage's targets must have the same number of rows: each "
            "microbatch's loss compares the last stage's output with the target microbatch of the same index",
    "inputs": "a stage's input_args must have the shape and dtype of a microbatch of what the stage before it "
              "outputs (torch receives into buffers of that shape, or checks what it infers against it): build "
              "both stages' modules and example tensors from one config",
}
WHAT = {"schedule": "the schedule class", "n_microbatches": "n_microbatches", "num_stages": "num_stages",
        "stages": "which rank holds which stage", "rows": "the rows of each microbatch",
        "inputs": "what a stage receives"}


@dataclass
class StageSchedule:
    """One schedule a rank built, as recorded (rank/autocheck/pipeline_schedule.PipelineWatch)."""

    rank: int
    index: int  # the index-th schedule this rank built
    schedule: str
    n_microbatches: int
    stages: list[int]
    num_stages: int
    group: tuple[int, ...]  # the pipeline's ranks (the stages' process group)
    file: str | None = None
    line: int | None = None
    stepped: bool = False
    step_file: str | None = None
    step_line: int | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)  # {"name", "shape", "dim", "dtype"}
    target: dict[str, Any] | None = None
    # per stage of the schedule: {"stage", "inputs", "outputs" (its input_args / output_args metadata, None when
    # not given), "sent" (what it passed on), "file", "line" (its PipelineStage)}
    io: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, rank: int, data: Mapping[str, Any]) -> StageSchedule:
        return cls(rank, int(data.get("index", 0)), str(data["schedule"]), int(data["n_microbatches"]),
                   [int(s) for s in data.get("stages") or []], int(data["num_stages"]),
                   tuple(int(r) for r in data.get("group") or []), data.get("file"), data.get("line"),
                   bool(data.get("stepped")), data.get("step_file"), data.get("step_line"),
                   list(data.get("inputs") or []), data.get("target"), list(data.get("io") or []))

    @property
    def site(self) -> str | None:
        return file_line(self.file, self.line)

    def splits(self) -> list[tuple[str, int]]:
        """What the first step split and its rows on the split dim: ("batch", 16) for the first stage's first
        tensor input, ("targets", 16) for the last stage's target; none for a middle stage."""
        out = []
        batch = next((rows for rows in map(rows_of, self.inputs) if rows is not None), None)
        if batch is not None:
            out.append(("batch", batch))
        target = rows_of(self.target) if self.target is not None else None
        if target is not None:
            out.append(("targets", target))
        return out

    def split(self) -> tuple[str, int] | None:
        """The first of :meth:`splits` (the batch where a rank holds the first stage), or None."""
        return next(iter(self.splits()), None)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "schedule": self.schedule, "n_microbatches": self.n_microbatches,
                "stages": self.stages, "num_stages": self.num_stages, "file": self.file, "line": self.line,
                "step_file": self.step_file, "step_line": self.step_line, "inputs": self.inputs,
                "target": self.target}


def rows_of(entry: Mapping[str, Any]) -> int | None:
    shape, dim = entry.get("shape") or [], entry.get("dim")
    if dim is None or not -len(shape) <= dim < len(shape):
        return None
    return int(shape[dim])


def microbatch_rows(rows: int, n: int) -> list[int]:
    """The rows of each microbatch: torch.tensor_split's sizes (pipelining/microbatch.py splits that way)."""
    q, rem = divmod(rows, n)
    return [q + (1 if i < rem else 0) for i in range(n)]


def _rows_phrase(rows: int, n: int, short: bool = False) -> str:
    """`` of 4 rows`` (`` of 4`` when short), `` of 2-3 rows`` for a batch that does not divide evenly."""
    sizes = microbatch_rows(rows, n) if n > 0 else []
    if not sizes:
        return ""
    lo, hi = min(sizes), max(sizes)
    unit = "" if short else f" row{'s' if hi != 1 else ''}"
    return f" of {lo}{unit}" if lo == hi else f" of {lo}-{hi}{unit}"


def schedules_of(states: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[int, list[StageSchedule]]:
    """``{rank: [StageSchedule]}`` from ``{rank: the pipeline check's records}`` (an unreadable record is
    skipped)."""
    out: dict[int, list[StageSchedule]] = {}
    for rank, records in states.items():
        for data in records or []:
            try:
                out.setdefault(int(rank), []).append(StageSchedule.from_json(int(rank), data))
            except (KeyError, TypeError, ValueError):
                continue
    return out


def _odd(values: Mapping[int, Any]) -> list[int]:
    """The ranks whose value differs from a majority's; every rank when no value has one (2 ranks that differ)."""
    counts = Counter(values.values())
    (top, n), = counts.most_common(1)
    if n * 2 <= len(values):
        return sorted(values)
    return sorted(r for r, v in values.items() if v != top)


def disagreements(schedules: Sequence[StageSchedule]) -> list[tuple[str, list[int]]]:
    """What the schedules of one pipeline disagree on, with the ranks to blame, most telling first."""
    out: list[tuple[str, list[int]]] = []
    for name in ("schedule", "n_microbatches", "num_stages"):
        values = {s.rank: getattr(s, name) for s in schedules}
        if len(set(values.values())) > 1:
            out.append((name, _odd(values)))
    if not any(name == "num_stages" for name, _ in out):
        holders: dict[int, list[int]] = {}
        for s in schedules:
            for index in s.stages:
                holders.setdefault(index, []).append(s.rank)
        doubled = sorted({r for rs in holders.values() if len(rs) > 1 for r in rs})
        wanted = set(range(schedules[0].num_stages))
        if doubled or (len(schedules) == len(schedules[0].group) and set(holders) != wanted):
            out.append(("stages", doubled or sorted(s.rank for s in schedules)))
    mismatched = input_mismatches(schedules)
    if mismatched:
        out.append(("inputs", sorted({r for m in mismatched for r in (m.sender_rank, m.rank)})))
    if not out:  # same n_microbatches: the batch and the targets must still have the same rows
        # Every split, not one per rank: a V-shaped schedule's rank holds the first and the last stage both.
        rows = {(s.rank, what): n for s in schedules for what, n in s.splits()}
        if len(set(rows.values())) > 1:
            out.append(("rows", sorted({r for r, _ in rows})))
    return out


def _metas_text(metas: Sequence[Any]) -> str:
    """``[4, 16] float32``; several inputs joined by ``, ``."""
    return ", ".join(f"{list(m['shape'])} {m['dtype']}" if m else "None" for m in metas) or "nothing"


@dataclass
class StageInput:
    """What stage ``stage`` expects as input and what the stage before it sends, for :func:`input_mismatches`."""

    stage: int
    rank: int
    expects: list[Any]
    site: str | None
    line: int | None
    sender: int
    sender_rank: int
    sends: list[Any]
    sender_site: str | None
    sent: bool  # what the sender really passed on (else its declared output_args)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "rank": self.rank, "expects": self.expects, "site": self.site,
                "line": self.line, "from_stage": self.sender, "from_rank": self.sender_rank, "sends": self.sends,
                "from_site": self.sender_site, "measured": self.sent}


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return [None if m is None else (list(m["shape"]), m["dtype"]) for m in a] == \
        [None if m is None else (list(m["shape"]), m["dtype"]) for m in b]


def input_mismatches(schedules: Sequence[StageSchedule]) -> list[StageInput]:
    """Each stage whose input_args are not what the stage before it sends (what it passed on, or its output_args
    where it has passed on nothing yet), where both are known; stage order."""
    expects: dict[int, tuple[StageSchedule, dict[str, Any]]] = {}
    sends: dict[int, tuple[StageSchedule, dict[str, Any], list[Any], bool]] = {}
    for s in schedules:
        for entry in s.io:
            stage = int(entry.get("stage", -1))
            if entry.get("inputs") is not None:
                expects[stage] = (s, entry)
            out, measured = (entry["sent"], True) if entry.get("sent") is not None else (entry.get("outputs"), False)
            if out is not None:
                sends[stage] = (s, entry, out, measured)
    found = []
    for stage in sorted(expects):
        if stage == 0 or stage - 1 not in sends:
            continue
        (s, entry), (p, pentry, out, measured) = expects[stage], sends[stage - 1]
        if not _same(entry["inputs"], out):
            found.append(StageInput(stage, s.rank, entry["inputs"], file_line(entry.get("file"), entry.get("line")),
                                    entry.get("line"), stage - 1, p.rank, out,
                                    file_line(pentry.get("file"), pentry.get("line")), measured))
    return found


def describe_inputs(found: Sequence[StageInput]) -> str:
    """``stage 2 expects [4, 16] float32 (input_args of its PipelineStage at pp.py:40); stage 1 sends [4, 8]
    float32 (its output; PipelineStage at pp.py:40)``, per mismatch."""
    parts = []
    for m in found:
        how = "its output" if m.sent else "its output_args"
        parts.append(f"stage {m.stage} (rank {m.rank}) expects {_metas_text(m.expects)} (input_args of its "
                     f"PipelineStage at {m.site or 'an unknown line'}); stage {m.sender} (rank {m.sender_rank}) sends "
                     f"{_metas_text(m.sends)} ({how}; PipelineStage at {m.sender_site or 'an unknown line'})")
    return "; ".join(parts)


def _stage_label(s: StageSchedule, of: bool) -> str:
    """``stage 1``; ``stage 1 of 4`` where the stages disagree on num_stages; the rank where it is not the stage's
    index (``stages 0,2 (rank 0)`` for an interleaved schedule)."""
    what = f"stage {s.stages[0]}" if len(s.stages) == 1 else f"stages {','.join(map(str, s.stages)) or '?'}"
    what += f" of {s.num_stages}" if of else ""
    return what if s.stages == [s.rank] else f"{what} (rank {s.rank})"


def describe(schedules: Sequence[StageSchedule]) -> str:
    """``stage 0 splits the batch into 4 microbatches of 4 rows (ScheduleGPipe at pp.py:18); stage 1 the targets
    into 2 of 8 (:18)``: every stage in stage order, what its first step split (a middle stage splits nothing: only
    its count), and its schedule's line; the class and the file are repeated only where they change."""
    of = len({s.num_stages for s in schedules}) > 1
    parts = []
    prev: StageSchedule | None = None
    for s in sorted(schedules, key=lambda s: (min(s.stages, default=0), s.rank)):
        split, n = s.split(), s.n_microbatches
        if prev is None:
            what = (f"splits the {split[0]} into {n} microbatches{_rows_phrase(split[1], n)}" if split
                    else f"splits into {n} microbatches")
        else:
            what = f"the {split[0]} into {n}{_rows_phrase(split[1], n, short=True)}" if split else f"into {n}"
        if s.line is None:
            where = "an unknown line"
        elif prev is not None and prev.file == s.file:
            where = f":{s.line}"
        else:
            where = s.site or f":{s.line}"
        at = where if prev is not None and prev.schedule == s.schedule else f"{s.schedule} at {where}"
        parts.append(f"{_stage_label(s, of)} {what} ({at})")
        prev = s
    return "; ".join(parts)


def pipeline_findings(by_rank: Mapping[int, Sequence[StageSchedule]]) -> list[Finding]:
    """One ``collective_mismatch`` per pipeline whose stages' schedules disagree (the first schedule that does, when
    the script builds several)."""
    pipelines: dict[tuple[int, ...], dict[int, list[StageSchedule]]] = {}
    for rank, schedules in by_rank.items():
        for s in sorted(schedules, key=lambda s: s.index):
            pipelines.setdefault(s.group, {}).setdefault(rank, []).append(s)
    out: list[Finding] = []
    for group, per_rank in sorted(pipelines.items()):
        if len(per_rank) < 2:
            continue  # one rank's record (the others died before building theirs): nothing to compare
        for k in range(max(len(v) for v in per_rank.values())):
            schedules = [v[k] for _, v in sorted(per_rank.items()) if len(v) > k]
            if len(schedules) < 2:
                break
            found = disagreements(schedules)
            if found:
                out.append(_finding(group, schedules, found))
                break
    return out


def pipeline_verdict(states: Mapping[int, Sequence[Mapping[str, Any]]], runs: Mapping[int, RunFields],
                     facts: Mapping[str, Any]) -> Verdict:
    """The entry of analysis/check_table.py for the ``pipeline`` check: stages whose schedules disagree."""
    return Verdict(pipeline_findings(schedules_of(states)))


def _finding(group: tuple[int, ...], schedules: Sequence[StageSchedule],
             found: list[tuple[str, list[int]]]) -> Finding:
    names = [name for name, _ in found]
    ranks = sorted({r for _, rs in found for r in rs})
    first = min(schedules, key=lambda s: (s.rank not in ranks, s.rank))
    inputs = input_mismatches(schedules) if "inputs" in names else []
    described = "; ".join(filter(None, [describe(schedules) if names != ["inputs"] else "",
                                        describe_inputs(inputs)]))
    message = (f"the stages of the pipeline on {format_ranks(list(group))} built schedules that disagree on "
               f"{' and '.join(WHAT[n] for n in names)}: {described}. Fix: "
               f"{'; '.join(FIXES[n] for n in names)}")
    # The line to fix: the schedule's where the schedules disagree, else the receiving stage's PipelineStage.
    file, line = (first.file, first.line) if names != ["inputs"] else (
        next((e.get("file") for s in schedules for e in s.io if e.get("stage") == inputs[0].stage), None),
        inputs[0].line)
    detail: dict[str, Any] = {
        "cause": CAUSE, "fields": names, "group": list(group), "file": file, "line": line,
        "stage_inputs": [m.to_json() for m in inputs],
        "schedules": {str(s.rank): s.to_json() for s in schedules},
        "steps": {str(s.rank): [s.step_file, s.step_line] for s in schedules if s.stepped},
    }
    return Finding("collective_mismatch", ranks, message, detail)


def _caused_by_step(f: Finding, pipeline: Finding) -> bool:
    """Whether a failure (or a mismatch of the pipeline's own sends) happened inside a step of the pipeline's
    schedules: its traceback runs through pipelining, or it is at a rank's step line, or the rank died by a signal
    after its step began."""
    group = set(pipeline.detail.get("group") or [])
    if not f.ranks or not set(f.ranks) <= group:
        return False
    steps = pipeline.detail.get("steps") or {}
    at_step = {(os.path.basename(v[0] or ""), v[1]) for v in steps.values()}
    if PIPELINING in str(f.detail.get("traceback") or "").replace("\\", "/"):
        return True
    if (os.path.basename(str(f.detail.get("file") or "")), f.detail.get("line")) in at_step:
        return True
    return f.kind == "rank_failure" and bool(f.detail.get("signal")) and all(str(r) in steps for r in f.ranks)


def _said(f: Finding) -> str:
    if f.kind != "rank_failure":
        return f.message
    error = f.detail.get("error")
    if error:
        return f"{f.detail.get('exception') or 'error'}: {str(error).strip().splitlines()[0][:200]}"
    if f.detail.get("signal"):
        return f"died from {f.detail['signal']}"
    return f.message[:200]


def fold_consequences(findings: list[Finding]) -> list[Finding]:
    """Each pipeline mismatch keeps the failures and p2p mismatches its stages met inside ``step()`` as evidence
    (``detail["consequences"]``, and torch's text in its message): the schedules' disagreement is the cause."""
    pipelines = [f for f in findings if f.kind == "collective_mismatch" and f.detail.get("cause") == CAUSE]
    if not pipelines:
        return findings
    out: list[Finding] = []
    for f in findings:
        if f in pipelines or f.kind not in ("rank_failure", "collective_mismatch"):
            out.append(f)
            continue
        cause = next((p for p in pipelines if _caused_by_step(f, p)), None)
        if cause is None:
            out.append(f)
            continue
        said = cause.detail.setdefault("consequences", {})
        if f.kind == "rank_failure":  # the first failure folded is the root; its peers' errors followed it
            # with its line: where the rank failed (its schedule.step(...)) is what the user looks at next
            cause.detail.setdefault("failed", {"ranks": list(f.ranks), "error": _said(f), "file": f.detail.get("file"),
                                               "line": f.detail.get("line")})
        for r in f.ranks:
            said.setdefault(str(r), _said(f))
        for r, text in (f.detail.get("consequences") or {}).items():  # the peers that lost the failed rank
            said.setdefault(str(r), str(text).splitlines()[0][:200] if text else "")
    for p in pipelines:
        failed, said = p.detail.get("failed"), p.detail.get("consequences") or {}
        if failed:
            # trace_align keeps as a failure's consequences the backend errors of the peers that lost it
            others = sorted(set(map(int, said)) - set(failed["ranks"]))
            lost = f" ({format_ranks(others)} then lost {'its peer' if len(others) == 1 else 'their peers'})"
            at = file_line(failed.get("file"), failed.get("line"))
            p.message += (f". Then, inside step(){f' at {at}' if at else ''}, {format_ranks(failed['ranks'])} failed "
                          f"with torch's {failed['error']}{lost if others else ''}")
        elif said:
            first = min(said, key=int)
            p.message += f". Then, inside step(), rank {first}: {said[first]}"
    return out
