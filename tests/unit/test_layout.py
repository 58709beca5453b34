"""The layout's rules (README "Layout"): no import cycle, pure analysis, every module in its process's package."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "distcheck"


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle(capsys):
    assert _tool().main() == 0, capsys.readouterr().out


def test_the_cycle_finder_finds_a_cycle():
    assert _tool().cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_analysis_is_pure():
    """No process group, no CLI: analysis/ is unit-testable without launching anything."""
    for path in (PKG / "analysis").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("torch.distributed", "argparse", "subprocess", "distcheck.rank",
                                            "distcheck.supervise", "distcheck.commands", "distcheck.errors")), \
                    f"{path.name} imports {name}"


def test_every_module_lives_in_the_package_of_its_process():
    top = {p.name for p in PKG.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "__main__.py", "cli.py", "errors.py", "options.py", "processes.py", "records.py"}, top
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == {"analysis", "checks", "commands", "contract", "rank", "supervise", "testing"}, packages


def test_documented_paths_still_import():
    import distcheck.records

    assert callable(distcheck.records.record) and callable(distcheck.records.tolerance)
    assert "distcheck.testing.pytest_plugin" in (ROOT / "pyproject.toml").read_text()
    assert sys.modules["distcheck.records"].record is sys.modules["distcheck.rank.records"].record
