"""The fixtures gallery is documented: each fixture's docstring says the bug, the symptom and distcheck's finding.

Fast, launches nothing. docs/fixtures.md is generated from these docstrings by tools/fixtures_doc.py:

    .venv/bin/python tools/fixtures_doc.py --write
"""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted((ROOT / "fixtures").glob("*.py"))
KINDS = ("Bug:", "No bug:", "Bad input:")
COMMAND_STARTS = ("python -m distcheck", "torchrun", "distcheck")


def fixtures_doc():
    """tools/fixtures_doc.py, imported (tools/ is no package): the page it renders, in this process."""
    spec = importlib.util.spec_from_file_location("fixtures_doc", ROOT / "tools" / "fixtures_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def test_there_are_fixtures():
    assert len(FIXTURES) > 10


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_fixture_docstring_has_bug_symptom_finding_and_command(path):
    doc = docstring(path)
    assert doc.strip(), f"{path.name} has no module docstring"
    first = doc.strip().splitlines()[0]
    assert first.startswith(KINDS), f"{path.name}: the docstring's first line must start with one of {KINDS}: {first!r}"
    assert "Symptom without distcheck" in doc, f"{path.name}: no 'Symptom without distcheck' paragraph"
    assert "distcheck reports" in doc, f"{path.name}: no 'distcheck reports' paragraph"
    commands = [line for line in doc.splitlines()
                if line.startswith("    ") and line.strip().startswith(COMMAND_STARTS)]
    assert commands, f"{path.name}: no command indented by 4 spaces starting with one of {COMMAND_STARTS}"
    assert any(f"fixtures/{path.name}" in c for c in commands), \
        f"{path.name}: the documented command does not name the fixture: {commands}"


def test_docs_fixtures_md_is_generated_from_the_docstrings():
    """docs/fixtures.md is tools/fixtures_doc.py's output: a changed or new fixture docstring regenerates it."""
    page = ROOT / "docs" / "fixtures.md"
    tool = fixtures_doc()
    current = page.read_text().splitlines() if page.exists() else ["(missing)"]
    expected = tool.render().splitlines()
    differ = next((i for i, (a, b) in enumerate(zip(current, expected)) if a != b), min(len(current), len(expected)))
    stale = current != expected
    assert not stale, (
        f"docs/fixtures.md is stale (first difference at its line {differ + 1}): regenerate it with "
        f"`{tool.REGENERATE}`")
