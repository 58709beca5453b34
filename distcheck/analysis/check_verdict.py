"""What one zero-code check's states tell the report: the shape of an entry of analysis/check_table.py.

    python -m distcheck run --nproc 2 -- train.py      # the report turns each check's states into a Verdict

An entry is a pure function ``(states, runs, facts) -> Verdict``: ``states`` is ``{rank: that check's state}`` for
the ranks whose ``autocheck-rank<R>.json`` holds one, ``runs`` every rank's run-level fields
(contract/autocheck_file.RunFields), ``facts`` what the entries before it established (a frozen model, a model
that differed before parallelizing) and that changes how this one judges.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from distcheck.contract.autocheck_file import RunFields
from distcheck.contract.findings import CheckResult, Finding, Note


@dataclass
class Verdict:
    findings: list[Finding] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)  # report.json "checks" entries
    notes: list[Note] = field(default_factory=list)  # report.json "warnings"
    facts: dict[str, Any] = field(default_factory=dict)  # for the later entries and the callers (compare)


Judge = Callable[[Mapping[int, Any], Mapping[int, RunFields], Mapping[str, Any]], Verdict]


def notes_in(states: Mapping[int, list[dict[str, Any]] | None]) -> list[Note]:
    """The report.json warnings the ranks wrote (Note documents), rank by rank; an unreadable one is skipped."""
    out = []
    for rank in sorted(states):
        for data in states[rank] or []:
            try:
                out.append(Note.from_json(data))
            except (KeyError, TypeError, ValueError):
                continue
    return out


def notes_verdict(states: Mapping[int, list[dict[str, Any]]], runs: Mapping[int, RunFields],
                  facts: Mapping[str, Any]) -> Verdict:
    """A check whose state is the warnings it wrote (dp_inputs: ranks fed the same batch)."""
    return Verdict(notes=notes_in(states))
