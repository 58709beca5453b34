"""The corpus of correct programs (fixtures/ok/): distcheck finds nothing in any of them, on real gloo ranks.

Each program is one idiom taken from public code (pytorch/examples, torchtitan, Lightning, the PyTorch tutorials)
and is correct by torch's semantics: a finding on one of them is a false positive. Its docstring's header says how
to launch it: ``nproc: N`` (2, or 4 for 2-D meshes) and ``compare: yes|no`` (yes where the program keeps the global
batch fixed, so that its 1-rank and N-rank runs train the same model).

A ``compare: yes`` program is launched with ``compare`` only: compare's N-rank run is a ``distcheck run`` with the
same automatic checks, whose findings compare reports (prefixed "2-rank run:"), so a separate ``run`` would only
repeat it; the others are launched with ``run``.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launch_helpers import FIXTURES, distcheck, load_report

from distcheck.analysis.trace_events import load_traces

OK = FIXTURES / "ok"


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def header(path: Path) -> dict[str, str]:
    """The ``key: value`` lines of the docstring (``nproc``, ``compare``)."""
    return dict(re.findall(r"^(nproc|compare): *(\S+) *$", docstring(path), re.MULTILINE))


def ddp_buckets_at_the_backward_line(out: Path, path: Path) -> None:
    """Compiled DDP: the Reducer's bucket all-reduces (C++, behind Dynamo's DDPOptimizer) are in the trace, one per
    step, at the user's ``loss.backward()`` line."""
    backward = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "loss.backward()" in line)
    buckets = [e for e in load_traces(out)[0].events if e.extra.get("via") == "DDP gradient bucket all-reduce"]
    assert len(buckets) == 3 and {e.line for e in buckets} == {backward}, [(e.op, e.line) for e in buckets]


# What a program's trace must show beyond silence, where no other test launches the same idiom again for it.
TRACE_CHECKS = {"ddp_compile.py": ddp_buckets_at_the_backward_line}


def slow_first(path: Path) -> tuple:
    # xdist hands tests out in this order: the longest (4 ranks, Dynamo compiling in each rank) start first
    # rather than being the last ones running while the other workers idle.
    slow = header(path).get("nproc") == "4" or "torch.compile(" in path.read_text()
    return (not slow, path.name)


PROGRAMS = sorted(OK.glob("*.py"), key=slow_first)


def test_the_corpus_is_large_and_every_program_says_how_to_launch_it():
    assert len(PROGRAMS) >= 25, [p.name for p in PROGRAMS]
    for path in PROGRAMS:
        doc, fields = docstring(path), header(path)
        assert fields.get("nproc") in ("2", "4"), f"{path.name}: no 'nproc: 2|4' line in its docstring"
        assert fields.get("compare") in ("yes", "no"), f"{path.name}: no 'compare: yes|no' line in its docstring"
        assert doc.startswith("No bug: "), f"{path.name}: the docstring must start with 'No bug: '"
        assert "Symptom without distcheck: none" in doc and "distcheck reports no finding." in doc, path.name
        commands = [line.strip() for line in doc.splitlines() if line.startswith("    python -m distcheck ")]
        run = f"python -m distcheck run --nproc {fields['nproc']} -- fixtures/ok/{path.name}"
        assert run in commands, f"{path.name}: the docstring does not show {run!r}: {commands}"
        assert (run.replace(" run ", " compare ") in commands) == (fields["compare"] == "yes"), \
            f"{path.name}: the compare command is shown if and only if 'compare: yes': {commands}"
    assert sum(header(p)["compare"] == "yes" for p in PROGRAMS) >= 10


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_distcheck_finds_nothing(tmp_path, path):
    fields = header(path)
    command = "compare" if fields["compare"] == "yes" else "run"
    out = tmp_path / "report"
    res = distcheck([command, "--nproc", fields["nproc"], "--timeout", "60", "--report-dir", str(out), "--",
                     str(path)], timeout=300)
    report = load_report(out) if (out / "report.json").exists() else {}
    found = "\n".join(f"  {f['kind']} (ranks {f['ranks']}): {f['message']}" for f in report.get("findings", []))
    assert res.returncode == 0 and report.get("findings") == [], (
        f"distcheck {command} --nproc {fields['nproc']} -- fixtures/ok/{path.name}: exit {res.returncode}, "
        f"findings:\n{found or '  (no report)'}\n--- output tail ---\n{res.output[-3000:]}")
    assert report["ok"] and report["world_size"] == int(fields["nproc"])
    # Warnings too (same batches, async work, precision): a correct program gets none. A straggler is the
    # exception: it measures this machine's load as much as the program.
    warned = [w for w in report.get("warnings", []) if w["kind"] != "straggler"]
    assert not warned, f"fixtures/ok/{path.name}: {warned}"
    if path.name in TRACE_CHECKS:
        TRACE_CHECKS[path.name](out, path)
