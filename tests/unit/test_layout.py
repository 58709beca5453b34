"""The layout's rules (docs/architecture.md): no import cycle, pure analysis, every module in its process's package."""
from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "distcheck"


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a module, parsed and walked once for all the tests of this file that read it."""
    return tuple(ast.walk(_tree(path)))


def _tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle(capsys):
    assert _tool().main() == 0, capsys.readouterr().out


def test_the_cycle_finder_finds_a_cycle():
    assert _tool().cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_an_import_by_name_is_an_edge(tmp_path):
    """cli.py imports the command it dispatches to by name: such an import is a dependency like any other."""
    (tmp_path / "m.py").write_text("import importlib\n"
                                   "importlib.import_module(f'distcheck.commands.{name}')\n"
                                   "importlib.util.find_spec('distcheck.rank.entry')\n"
                                   "importlib.import_module(name)\n")
    modules = {"distcheck.commands", "distcheck.commands.run", "distcheck.rank", "distcheck.rank.entry"}
    assert _tool().imports(tmp_path / "m.py", modules) == {"distcheck.commands", "distcheck.rank.entry"}


def _package(module: str) -> str:
    """A module's node in the package graph: its top-level package (``distcheck.rank.checks.mesh`` is ``rank``),
    or a top-level module itself (``distcheck.cli`` is ``cli``; distcheck/__init__.py is ``distcheck``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_cycles(imports: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """The cycles among top-level packages that the module imports ``imports`` (module -> modules it imports)
    make, each with its package edges (one module import of each as an example); imports within a package are no
    edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    graph: dict[str, set[str]] = {}
    for module, targets in imports.items():
        graph.setdefault(_package(module), set())
        for target in sorted(targets):
            a, b = _package(module), _package(target)
            graph.setdefault(b, set())
            if a != b:
                graph[a].add(b)
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return [(comp, [f"{a} -> {b}: {lines[0]}" + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
                    for (a, b), lines in sorted(edges.items()) if a in comp and b in comp])
            for comp in _tool().cycles(graph)]


def test_no_package_cycle():
    """The path says which process runs a module and data flows one way (docs/architecture.md): no two top-level
    packages (nor top-level modules) import each other, even through others or inside functions."""
    tool = _tool()
    paths = sorted(PKG.rglob("*.py"))
    modules = {tool.module_name(p) for p in paths}
    found = _package_cycles({tool.module_name(p): tool.imports(p, modules) for p in paths})
    assert not found, "\n".join(f"package cycle {' <-> '.join(comp)}:\n  " + "\n  ".join(lines)
                                 for comp, lines in found)


def test_the_package_cycle_finder_finds_a_cycle():
    # the layout before issue 47: checks/ beside rank/, each importing the other (one import inside a function)
    before = {"distcheck.checks.mesh": {"distcheck.rank.runtime", "distcheck.checks.models"},
              "distcheck.checks.models": set(),
              "distcheck.rank.runtime": set(),
              "distcheck.rank.entry": {"distcheck.rank.runtime", "distcheck.checks.mesh"},
              "distcheck.cli": {"distcheck"},
              "distcheck": {"distcheck.rank.records"}}
    assert _package_cycles(before) == [(["checks", "rank"],
                                        ["checks -> rank: distcheck.checks.mesh -> distcheck.rank.runtime",
                                         "rank -> checks: distcheck.rank.entry -> distcheck.checks.mesh"])]
    # the same modules with checks/ inside rank/: what ran between them is now within one package
    after = {"distcheck.rank.checks.mesh": {"distcheck.rank.runtime", "distcheck.rank.checks.models"},
             "distcheck.rank.checks.models": set(),
             "distcheck.rank.runtime": set(),
             "distcheck.rank.entry": {"distcheck.rank.runtime", "distcheck.rank.checks.mesh"},
             "distcheck.cli": {"distcheck"},
             "distcheck": {"distcheck.rank.records"}}
    assert _package_cycles(after) == []
    # a cycle through the package's __init__ (a node of its own) counts too
    assert _package_cycles({**after, "distcheck.rank.records": {"distcheck"}})[0][0] == ["distcheck", "rank"]


def test_analysis_is_pure():
    """No process group, no CLI: analysis/ is unit-testable without launching anything."""
    for path in (PKG / "analysis").glob("*.py"):
        for node in _nodes(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("torch.distributed", "argparse", "subprocess", "distcheck.rank",
                                            "distcheck.supervise", "distcheck.commands", "distcheck.errors")), \
                    f"{path.name} imports {name}"
            # torch itself may do tensor math on loaded records (records, tolerances, meshes); never reach a
            # process group through it either
            assert not (isinstance(node, ast.Attribute) and node.attr == "distributed" and
                        isinstance(node.value, ast.Name) and node.value.id == "torch"), \
                f"{path.name}:{node.lineno} uses torch.distributed"


# What reads or lists the file system: analysis/ takes what contract/'s readers read (docs/architecture.md), so that
# every file a supervisor reads has one reader, next to its one writer. Module functions by their full name (an
# alias or a from-import resolved), and path methods by their name on any object (a Path or a file handle).
FILE_FUNCTIONS = frozenset({
    "open", "io.open", "os.open", "os.fdopen", "os.listdir", "os.scandir", "os.walk", "os.stat", "os.lstat",
    "os.path.exists", "os.path.lexists", "os.path.isfile", "os.path.isdir", "os.path.islink", "os.path.getsize",
    "os.path.getmtime", "os.path.realpath", "os.path.samefile", "glob.glob", "glob.iglob", "json.load",
    "pickle.load", "marshal.load", "torch.load", "numpy.load", "numpy.loadtxt", "numpy.genfromtxt",
    "numpy.fromfile", "numpy.memmap", "mmap.mmap", "shutil.copyfile", "shutil.copy", "shutil.rmtree",
    "tempfile.mkstemp", "tempfile.mkdtemp", "tempfile.NamedTemporaryFile", "tempfile.TemporaryDirectory"})
PATH_METHODS = frozenset({"read_text", "read_bytes", "write_text", "write_bytes", "open", "iterdir", "glob",
                          "rglob", "exists", "is_file", "is_dir", "stat", "lstat", "touch", "unlink", "mkdir",
                          "samefile"})
# Where analysis/ may still touch the file system, and why (each entry must still be needed: a stale one fails).
# frame_owner.py classifies a frame's file by the interpreter's installed package directories, which it lists
# (this process's own environment, never a report directory).
FILE_ACCESS_ALLOWED = {"frame_owner.py": {"os.listdir", "os.path.isfile", "os.path.realpath"}}


def _file_access(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, call) of every call in ``tree`` that reads, writes, lists or stats the file system."""
    aliases: dict[str, str] = {}  # local name -> full dotted name, from the module's imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(func: ast.expr) -> str | None:
        if isinstance(func, ast.Name):
            return aliases.get(func.id, func.id)
        if isinstance(func, ast.Attribute):
            base = dotted(func.value)
            return f"{base}.{func.attr}" if base is not None else None
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name in FILE_FUNCTIONS:
            found.append((node.lineno, name))
        elif isinstance(node.func, ast.Attribute) and node.func.attr in PATH_METHODS:
            found.append((node.lineno, f".{node.func.attr}()"))
    return sorted(found)


def test_analysis_opens_no_file():
    """analysis/ is pure functions of what contract/'s readers read: no module of it opens, lists or stats a file."""
    wrong, used = [], set()
    for path in sorted((PKG / "analysis").glob("*.py")):
        for line, call in _file_access(_tree(path)):
            if call in FILE_ACCESS_ALLOWED.get(path.name, ()):
                used.add((path.name, call))
            else:
                wrong.append(f"analysis/{path.name}:{line} calls {call}")
    assert not wrong, "\n".join(wrong) + "\n(read it in contract/, next to the file's writer)"
    stale = {(m, c) for m, calls in FILE_ACCESS_ALLOWED.items() for c in calls} - used
    assert not stale, f"FILE_ACCESS_ALLOWED no longer needed: {sorted(stale)}"


def test_the_file_access_finder_finds_file_access():
    source = """
import json, os.path
import numpy as np
from pathlib import Path
from os import listdir as ls
from torch import load

def bad(p, fh):
    open(p)
    Path(p).read_text()
    json.load(fh)
    np.load(p)
    ls(p)
    load(p)
    os.path.exists(p)
    p.glob("*.json")

def fine(text, progress):
    json.loads(text)
    progress.open.append(1)
    np.frombuffer(text, np.uint8)
    os.path.basename(text)
"""
    assert _file_access(ast.parse(source)) == [
        (9, "open"), (10, ".read_text()"), (11, "json.load"), (12, "numpy.load"), (13, "os.listdir"),
        (14, "torch.load"), (15, "os.path.exists"), (16, ".glob()")]


def test_every_module_lives_in_the_package_of_its_process():
    top = {p.name for p in PKG.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "__main__.py", "cli.py", "errors.py", "options.py", "processes.py", "records.py"}, top
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == {"analysis", "commands", "contract", "rank", "supervise", "testing"}, packages


def test_documented_paths_still_import():
    import distcheck.records

    assert callable(distcheck.records.record) and callable(distcheck.records.tolerance)
    assert "distcheck.testing.pytest_plugin" in (ROOT / "pyproject.toml").read_text()
    assert sys.modules["distcheck.records"].record is sys.modules["distcheck.rank.records"].record


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at its top or inside a function (a lazy import is a dependency too)."""
    names = []
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


# Which packages each package may not import: the path says which process runs a module (docs/architecture.md), and
# data flows one way, through the files and names in contract/. A rank never runs supervisor code, a supervisor
# never runs rank code, and what both need (file formats, environment names, /proc) is in contract/ or
# processes.py.
FORBIDDEN = {
    "supervise": ("distcheck.rank",),
    "rank": ("distcheck.supervise", "distcheck.commands", "distcheck.testing"),
    "contract": ("distcheck.rank", "distcheck.supervise", "distcheck.commands",
                 "distcheck.testing", "distcheck.analysis", "torch"),
    "analysis": ("distcheck.rank", "distcheck.supervise", "distcheck.commands",
                 "distcheck.testing", "torch.distributed"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_directions(package):
    wrong = [f"{path.relative_to(PKG)} imports {name}"
             for path in sorted((PKG / package).rglob("*.py"))
             for name in _imports(path) if name.startswith(FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_processes_and_env_names_import_nothing_but_the_contract():
    for path in (PKG / "processes.py", PKG / "contract" / "env.py"):
        assert all(not n.startswith("distcheck") or n.startswith("distcheck.contract") for n in _imports(path)), path


def test_environment_variable_names_are_written_only_in_contract_env():
    """A DISTCHECK_* name as a string anywhere else is a second definition (the copier's mirror aside, which
    tests/unit/test_rank_processes.py checks against contract/env.py)."""
    mirrors = {PKG / "contract" / "env.py", PKG / "contract" / "stderr_file.py", PKG / "rank" / "stderr_tee.py"}
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        if path in mirrors:
            continue
        for node in _nodes(path):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("DISTCHECK_") and node.value.isidentifier():
                wrong.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value}")
    assert not wrong, "\n".join(wrong)


# Where a rank's process starts (torchrun's `-m distcheck`, the launcher's rank entry, the pytest pool's worker):
# nothing a rank imports on its way in may load supervisor code. Function-level imports inside rank/
# are test_import_directions'; here the shared entry modules, whose supervisor imports sit in launcher-only
# branches.
RANK_ENTRY_MODULES = ("distcheck.__main__", "distcheck.cli", "distcheck.commands.run",
                      "distcheck.commands.consistency", "distcheck.rank.entry", "distcheck.rank.bootstrap",
                      "distcheck.testing.pool_worker")


def _module_path(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _unconditional_imports(path: Path) -> list[str]:
    """The modules ``path`` imports whenever it is imported: its top level, ``if __name__ == "__main__"`` and
    try blocks; not a function's body and not another ``if`` (a launcher-only branch)."""
    names: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.extend([node.module] + [f"{node.module}.{a.name}" for a in node.names])
            elif isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
                walk(node.body)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)

    walk(_tree(path).body)
    return names


def test_no_supervisor_module_is_loaded_on_a_ranks_way_in():
    seen, todo, chains = set(), list(RANK_ENTRY_MODULES), {m: m for m in RANK_ENTRY_MODULES}
    wrong = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("distcheck.supervise"):
            wrong.append(chains[name])
            continue
        path = _module_path(name)
        if path is None or not name.startswith("distcheck"):
            continue
        for imported in _unconditional_imports(path):
            if imported.startswith("distcheck") and imported not in seen:
                chains.setdefault(imported, f"{chains[name]} -> {imported}")
                todo.append(imported)
    assert not wrong, "\n".join(wrong)


def test_test_file_names_are_unique_across_the_tiers():
    """pytest imports test files by their base name (the test folders are not packages): a unit and an integration
    test of the same name is a collection error in a whole-suite run, though each tier passes alone."""
    tests = Path(__file__).resolve().parent.parent
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
