"""Every command shown in README.md and docs/*.md stays true: it parses, and the files and targets it names exist.

Fast, launches nothing. A command is a line of a
fenced block, a line indented by 4 spaces, or an inline `code` span that starts with ``python -m distcheck``,
``.venv/bin/python -m distcheck``, ``distcheck``, ``torchrun ...``, ``make``, ``pytest`` / ``python -m pytest`` or
``python tools/...`` / ``python bench/...`` (a ``$ `` prompt and leading ``VAR=value`` assignments are skipped).
Not a command: a synopsis (``[--flag ...]`` brackets, as in docs/commands.md's block) and a line with a placeholder
(``SCRIPT``, ``PID``, ``N``, ``DIR``, any all-capitals word, ``...``, ``<name>``).

- distcheck: parsed by the real parser in this process (distcheck/cli.py: build_parser, as main() does); under
  torchrun, torchrun's own parser first, then what follows ``-m distcheck``.
- the files it names (the SCRIPT after ``--``, anything under fixtures/, tools/, bench/, tests/, docs/, launch/)
  exist, and the flags it passes to a script of this repository are in that script's source.
- ``make X``: the Makefile has target X. ``pytest``: the test files it names exist.

tests/integration/test_docs_commands.py runs the README's commands on their fixtures.

    .venv/bin/python -m pytest -q tests/unit/test_docs_commands.py
"""
from __future__ import annotations

import ast
import contextlib
import functools
import glob
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("fixtures/", "tools/", "bench/", "tests/", "docs/", "launch/")
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3", "$(PY)", "$(VENV)/bin/python"}
PLACEHOLDER_WORD = re.compile(r"^[A-Z][A-Z0-9_]*$")
SYNOPSIS = re.compile(r"\[-|\[[A-Z]")  # [--flag ...], [PID ...], [ARGS...]
NOT_SHELL = {"python", "py", "pycon", "json", "yaml", "yml", "toml", "diff", "ini", "cfg"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Shown:
    """A command as a page shows it."""
    file: str       # relative to the repository root
    line: int
    text: str
    inline: bool    # an inline `code` span (it may only name a command: `distcheck stacks`)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# ---------------------------------------------------------------------------------------------- extraction

def candidate_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, text, inline) of every fenced-block line, 4-space-indented line and inline code span."""
    out: list[tuple[int, str, bool]] = []
    fence: str | None = None
    code = False  # a fence of a language that holds no shell command (python, json, yaml...)
    pending: tuple[int, str] | None = None  # a block line ending with a backslash, continued on the next
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        marker = re.match(r"^\s{0,3}(```+|~~~+)", line)
        if marker:
            if fence and stripped.startswith(fence) and not stripped.strip("`~"):
                fence = None
            elif not fence:
                fence, code = marker.group(1), stripped.lstrip("`~").strip().lower() in NOT_SHELL
            continue
        if fence and code:
            continue
        if fence or line.startswith("    "):
            if pending:
                number, stripped = pending[0], pending[1] + " " + stripped
                pending = None
            if stripped.endswith("\\"):
                pending = (number, stripped[:-1].rstrip())
                continue
            out.append((number, stripped, False))
            continue
        for match in re.finditer(r"(`+)(.+?)\1", line):
            out.append((number, match.group(2).strip(), True))
    return out


def words(text: str) -> list[str] | None:
    """The shell words of one simple command (up to a pipe, ``&&`` or ``;``), without the prompt, comment and
    leading ``VAR=value`` assignments; a ``$(...)`` substitution stands for one value. None: no shell syntax."""
    text = re.sub(r"^\$\s+", "", text)
    text = re.sub(r"\$\([^()]*\)|\$\{\w+\}|\$[A-Za-z_]\w*", "1", text)
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return None
    cut = next((i for i, t in enumerate(tokens) if t and set(t) <= set(";&|")), len(tokens))
    tokens = tokens[:cut]
    while tokens and ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)
    return tokens


def kind_of(tokens: list[str]) -> str | None:
    """Which kind of command these words are, or None for none of ours."""
    if not tokens:
        return None
    head = tokens[0]
    if head in PYTHONS and len(tokens) > 1:
        if tokens[1:3] == ["-m", "distcheck"]:
            return "distcheck"
        if tokens[1:3] == ["-m", "pytest"]:
            return "pytest"
        if tokens[1] == "-m" and len(tokens) > 2 and tokens[2].startswith("distcheck."):
            return "module"
        if tokens[1].startswith(("tools/", "bench/")):
            return "script"
        return None
    if head in ("distcheck", ".venv/bin/distcheck"):
        # the console script; a line of output ("distcheck PASSED", "distcheck reports ...") is none
        from distcheck.cli import COMMANDS

        nxt = tokens[1] if len(tokens) > 1 else ""
        return "distcheck" if nxt.startswith("-") or (nxt and set(nxt.split("/")) <= set(COMMANDS)) else None
    if head in ("torchrun", ".venv/bin/torchrun"):
        return "torchrun"
    if head == "make":
        return "make"
    if head in ("pytest", ".venv/bin/pytest"):
        return "pytest"
    return None


def placeholder(text: str, tokens: list[str]) -> str | None:
    """What makes this a synopsis or a template rather than a command, or None."""
    if SYNOPSIS.search(text):
        return "a synopsis"
    if "..." in text or "…" in text or re.search(r"<[\w -]+>", text):
        return "a placeholder"
    for token in tokens:
        for part in re.split(r"[=,:]", token):
            if PLACEHOLDER_WORD.match(part) and not ASSIGNMENT.match(token):
                return f"a placeholder ({part})"
    return None


def shown_commands(path: Path) -> list[Shown]:
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for number, text, inline in candidate_lines(path.read_text()):
        tokens = words(text)
        if tokens is None or kind_of(tokens) is None or placeholder(text, tokens):
            continue
        found.append(Shown(rel, number, text, inline))
    return found


COMMANDS = [c for page in DOCS if page.exists() for c in shown_commands(page)]


def ids(commands: list[Shown]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for c in commands:
        n = seen.get(c.where, 0)
        seen[c.where] = n + 1
        out.append(c.where if n == 0 else f"{c.where}#{n + 1}")
    return out


# ---------------------------------------------------------------------------------------------- checks

class Wrong(Exception):
    """What is wrong with a command."""


def parse_with(parser, argv: list[str]):
    """``parser.parse_args(argv)``; a parse error (argparse exits) raises Wrong with argparse's message."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help, --version
            return None
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise Wrong(f"the parser rejects it (exit {exc.code}): {lines[-1] if lines else '(no message)'}") from None


def check_distcheck(args: list[str], inline: bool) -> None:
    from distcheck import cli

    if not args:
        raise Wrong("no command after distcheck")
    if inline and len(args) == 1 and re.fullmatch(r"[a-z]+(/[a-z]+)*", args[0]):
        # `distcheck stacks`, `python -m distcheck run/compare`: names commands, with no arguments
        unknown = [a for a in args[0].split("/") if a not in cli.available_commands()]
        if unknown:
            raise Wrong(f"no such command: {', '.join(unknown)} (commands: {', '.join(cli.available_commands())})")
        return
    argv = cli.join_negative_values(list(args))
    parser = cli.build_parser(next((a for a in argv if not a.startswith("-")), None))
    parsed = parse_with(parser, argv)
    if parsed is None:
        return
    if not getattr(parsed, "command", None):
        raise Wrong("no distcheck command (main() would print the help and exit 2)")
    script_args = getattr(parsed, "script_args", None) or []
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if script_args and not script_args[0].startswith("-"):
        check_script(script_args[0], script_args[1:])


def check_torchrun(args: list[str], inline: bool) -> None:
    from torch.distributed.run import get_args_parser

    parsed = parse_with(get_args_parser(), list(args))
    if parsed is None:
        return
    if parsed.module:
        if parsed.training_script == "distcheck":
            check_distcheck(parsed.training_script_args, inline)
        elif importlib.util.find_spec(parsed.training_script.split(".")[0]) is None:
            raise Wrong(f"torchrun -m {parsed.training_script}: no such module")
    else:
        check_script(parsed.training_script, parsed.training_script_args)


def check_paths(tokens: list[str]) -> None:
    """Every word naming a file of this repository (fixtures/x.py, fixtures/x.py:build, tests/t.py::test) exists."""
    for token in tokens:
        for part in token.split("="):
            path = re.split(r"::|:(?=[A-Za-z_]\w*$)", part)[0]
            if path.startswith(REPO_DIRS) and not (glob.glob(str(ROOT / path)) if glob.has_magic(path)
                                                   else (ROOT / path).exists()):
                raise Wrong(f"{path} does not exist")


@functools.lru_cache(maxsize=None)
def script_options(path: Path) -> frozenset[str]:
    """The string constants that look like options (``"--case"``, ``"-n"``) in a script and in the modules of its
    folder it imports (a parser shared by the benchmarks)."""
    tree = ast.parse(path.read_text())
    found = {node.value.split("=")[0] for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"--?[A-Za-z][\w-]*=?", node.value)}
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            sibling = path.parent / (name.replace(".", "/") + ".py")
            if sibling.exists() and sibling != path:
                found |= script_options(sibling)
    return frozenset(found)


def check_script(script: str, args: list[str]) -> None:
    """The script is a file of this repository, and the options passed to it are its own."""
    check_paths([script, *args])
    path = ROOT / script
    if not path.exists():
        raise Wrong(f"the script {script} does not exist (the docs show commands on files of this repository)")
    if path.suffix != ".py":
        return
    flags = [a.split("=")[0] for a in args if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a)]
    flags = [f for f in flags if f not in ("-h", "--help")]
    missing = [f for f in flags if f not in script_options(path)]
    if missing:
        raise Wrong(f"{script} has no option {', '.join(missing)}")


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([^\s#:=$][^:=]*?)\s*:(?![=:])", line)
        if match:
            targets.update(match.group(1).split())
    return frozenset(targets)


def check(command: Shown) -> None:
    tokens = words(command.text)
    kind = kind_of(tokens)
    if kind == "distcheck":
        check_distcheck(tokens[1:] if tokens[0].endswith("distcheck") else tokens[3:], command.inline)
    elif kind == "torchrun":
        check_torchrun(tokens[1:], command.inline)
    elif kind == "module":
        if importlib.util.find_spec(tokens[2]) is None:
            raise Wrong(f"python -m {tokens[2]}: no such module")
    elif kind == "script":
        check_script(tokens[1], tokens[2:])
    elif kind == "make":
        wanted = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]
        unknown = [t for t in wanted if t not in make_targets()]
        if unknown:
            raise Wrong(f"the Makefile has no target {', '.join(unknown)} (targets: {', '.join(sorted(make_targets()))})")
    elif kind == "pytest":
        check_paths(tokens[1:])


# ---------------------------------------------------------------------------------------------- tests

def test_the_docs_show_commands():
    assert len(COMMANDS) >= 5, [c.where for c in COMMANDS]
    assert any(c.file == "README.md" for c in COMMANDS), "README.md shows no command this test recognizes"


@pytest.mark.parametrize("command", COMMANDS, ids=ids(COMMANDS))
def test_documented_command_is_true(command):
    try:
        check(command)
    except Wrong as exc:
        pytest.fail(f"{command.where}: `{command.text}`: {exc}", pytrace=False)


@pytest.mark.parametrize("text, expected", [
    ("python -m distcheck run --nproc 2 -- fixtures/x.py", "distcheck"),
    ("$ .venv/bin/python -m distcheck compare --nproc 2 -- t.py  # note", "distcheck"),
    ("DISTCHECK_ZYGOTE=/tmp/z torchrun --nproc-per-node 2 -m distcheck consistency", "torchrun"),
    ("make check && make test", "make"),
    ("python -m pytest -q tests/unit", "pytest"),
    (".venv/bin/python tools/gallery.py --only coll_hang", "script"),
    ("python -m distcheck.supervise.zygote /tmp/sock", "module"),
    ("pytest11", None), ("distcheck.record(name, value)", None), ("torchrun_restart.py", None),
    ("python train.py", None),
])
def test_kind_of(text, expected):
    assert kind_of(words(text)) == expected


@pytest.mark.parametrize("text, skipped", [
    ("python -m distcheck run [--nproc N] -- SCRIPT [ARGS...]", True),
    ("python -m distcheck stacks PID", True),
    ("torchrun ... -m distcheck run -- x.py", True),
    ("distcheck report DIR --format github", True),
    ("python -m distcheck consistency --model MODULE_OR_FILE:FACTORY", True),
    ("make check TORCH_VERSION=2.13.0", False),
    ("python -m distcheck run --nproc 2 -- fixtures/coll_hang.py", False),
])
def test_placeholder(text, skipped):
    assert (placeholder(text, words(text)) is not None) == skipped


def test_candidate_lines_reads_blocks_indents_and_spans():
    page = "intro `make test` and ``distcheck run``\n\n```sh\nmake check \\\n  NPROC=2\n```\n\n    make soak\n"
    assert candidate_lines(page) == [(1, "make test", True), (1, "distcheck run", True), (4, "make check NPROC=2", False),
                                     (8, "make soak", False)]


@pytest.mark.parametrize("text, wrong", [
    ("python -m distcheck run --nproc 2 -- fixtures/no_such_fixture.py", "does not exist"),
    ("python -m distcheck run --no-such-flag -- fixtures/coll_hang.py", "rejects"),
    ("python -m distcheck frobnicate", "rejects"),
    ("torchrun --nproc-per-node 2 -m distcheck consistency --parallel zero3", "rejects"),
    ("make no-such-target", "no target"),
    (".venv/bin/python tools/gallery.py --no-such-flag", "no option"),
    ("python -m distcheck run --nproc 2 -- fixtures/dtensor_placement_errors.py --no-such-case", "no option"),
    ("pytest tests/unit/test_no_such_file.py", "does not exist"),
])
def test_a_wrong_command_is_caught(text, wrong):
    with pytest.raises(Wrong, match=wrong):
        check(Shown("x.md", 1, text, False))


@pytest.mark.parametrize("text", [
    "python -m distcheck run --nproc 2 -- fixtures/dtensor_placement_errors.py --case view",
    "torchrun --nproc-per-node 2 -m distcheck consistency --model fixtures/model_mlp.py:build --parallel ddp",
    "python -m distcheck run --help",
    "python -m distcheck stacks $(pgrep -f torchrun)",
    "make check NPROC=2",
    "pytest tests/unit/test_docs_commands.py::test_kind_of -q",
])
def test_a_right_command_passes(text):
    check(Shown("x.md", 1, text, False))


def test_an_inline_span_may_only_name_commands():
    check(Shown("x.md", 1, "distcheck stacks", True))
    check(Shown("x.md", 1, "python -m distcheck run/compare", True))
    with pytest.raises(Wrong, match="no such command"):
        check(Shown("x.md", 1, "python -m distcheck frobnicate", True))
    with pytest.raises(Wrong, match="rejects"):  # in a block it is a command, and stacks needs a PID
        check(Shown("x.md", 1, "distcheck stacks", False))
