"""contract/trace_lines.py: the JSON half of a rank's trace, written by the tracer and read by the analysis."""
from __future__ import annotations

from distcheck.analysis.rank_trace import parse_lines
from distcheck.contract import files, trace_lines


def test_what_the_writer_writes_the_reader_reads_and_a_cut_last_line_is_skipped(tmp_path):
    path = files.rank_file(tmp_path, "trace", 0)
    writer = trace_lines.LineWriter(path)
    writer.write({"ev": trace_lines.META, files.FORMAT_KEY: files.FORMAT, "rank": 0, "t": 1.0})
    writer.write({"ev": trace_lines.EXIT, "ok": True, "code": 0})
    writer.close()
    with open(path, "a") as fh:
        fh.write('{"ev": "error", "message": "cut sh')  # a rank killed mid-write
    lines = path.read_text().splitlines()
    assert [r["ev"] for r in trace_lines.read_records(lines + ["", "[1, 2]"])] == ["meta", "exit"]
    trace = parse_lines(lines, 0)
    assert trace.meta["rank"] == 0 and trace.errors == [] and trace.finished["ok"] is True
