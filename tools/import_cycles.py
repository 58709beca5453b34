"""Fail when distcheck's modules import each other in a cycle (module-level imports; lazy imports inside
functions are how a module defers a heavy or circular dependency, so they count too, as their own edges; and so does
``importlib.import_module("distcheck....")``/``find_spec`` with a literal name or an f-string's literal start, as
cli.py imports the command it dispatches to).

    python tools/import_cycles.py          # prints the cycles, exit 1 if any
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "distcheck"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def dynamic_import(node: ast.AST) -> str | None:
    """The module (or, for an f-string, the package its literal start names) that ``node`` imports by name:
    ``importlib.import_module(NAME)`` or ``importlib.util.find_spec(NAME)``; None for anything else."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name))):
        return None
    if (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) not in {"import_module", "find_spec"}:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def imports(path: Path, modules: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (dynamic := dynamic_import(node)) is not None:
            names = [dynamic]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main() -> int:
    paths = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    # A package's __init__ is not an edge target for its own submodules' "from pkg import sub" lines.
    graph = {}
    for p in paths:
        name = module_name(p)
        graph[name] = {m for m in imports(p, modules) if m != name and not name.startswith(m + ".")}
    found = cycles(graph)
    for comp in found:
        print("import cycle:", " <-> ".join(comp))
    if not found:
        print(f"no import cycle among {len(modules)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
