"""A rank that ended before its script could raise into the trace (an import in distcheck's start-up, a broken
environment): the rank_failure names the exception its stderr ends with."""
from __future__ import annotations

from distcheck.analysis.rank_outcomes import UNFINISHED
from distcheck.contract import files
from distcheck.contract.findings import Finding
from distcheck.supervise.run_report import add_stderr_tails, last_exception

TAIL = ["Traceback (most recent call last):", '  File "/x/distcheck/rank/entry.py", line 31, in <module>',
        "ImportError: cannot import name 'report_done_marker' from 'distcheck.supervise.torchrun_monitor'"]


def test_the_exception_a_rank_printed_is_named(tmp_path):
    files.rank_file(tmp_path, "stderr", 1).write_text("\n".join(TAIL) + "\n")
    finding = Finding("rank_failure", [1], f"rank 1 {UNFINISHED} (exit code 1)", {})
    add_stderr_tails(tmp_path, [finding])
    assert finding.message.endswith("; its stderr ends with: ImportError: cannot import name 'report_done_marker' "
                                    "from 'distcheck.supervise.torchrun_monitor'")
    assert finding.detail["stderr_exception"].startswith("ImportError")


def test_no_traceback_no_exception_named():
    assert last_exception(["some log line", "ValueError: not from a traceback"]) is None
    assert last_exception(TAIL[:2] + ["torch.distributed.DistBackendError: NCCL error", "  more"]) == \
        "torch.distributed.DistBackendError: NCCL error"
