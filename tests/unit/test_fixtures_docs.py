"""The fixtures gallery is documented: each fixture's docstring says the bug, the symptom and distcheck's finding.

Fast, launches nothing. ``tools/gallery.py`` runs the documented commands by hand and prints the README table.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted((ROOT / "fixtures").glob("*.py"))
KINDS = ("Bug:", "No bug:", "Bad input:")
COMMAND_STARTS = ("python -m distcheck", "torchrun", "distcheck")


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


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_fixture_is_in_the_readme_table(path):
    readme = (ROOT / "README.md").read_text()
    assert path.name in readme, (
        f"{path.name} is missing from README.md's fixtures table (expected until the gallery table is added: "
        f"generate it with `.venv/bin/python tools/gallery.py > /tmp/gallery.md`)")
