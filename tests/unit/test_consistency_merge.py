"""Merging the per-rank results of the consistency checks (pure: no process group)."""
from __future__ import annotations

from distcheck.rank.checks import consistency
from distcheck.contract.findings import CheckResult, Finding


def test_merge_dedupes_and_marks_failed_checks():
    f = Finding("tensor_divergence", [1], "w differs")
    rank0 = [("environment", 0.1, []), ("model_consistency", 0.2, [f])]
    rank1 = [("environment", 0.1, []), ("model_consistency", 0.3, [Finding("tensor_divergence", [1], "w differs")])]
    checks, findings = consistency.merge([rank0, rank1], rank0, 2)
    assert findings == [f]
    assert [c.ok for c in checks][:2] == [True, False]
    assert all(isinstance(c, CheckResult) for c in checks)
    skipped = [c for c in checks if "skipped" in c.note]
    assert len(skipped) == 4
