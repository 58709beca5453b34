"""The README's commands, run: each one on a fixture (or the built-in consistency check) exits as documented.

tests/unit/test_docs_commands.py parses every command of README.md and docs/*.md and checks what it names; this
file runs the README's distcheck commands that name a fixture of this repository, or the built-in model of
``consistency``, from the repository root, with a ``--report-dir`` under tmp_path and a timeout each, and checks
the exit code the fixture's docstring implies: ``0`` for fixtures/ok/ and a ``No bug:`` fixture, ``1`` for a
``Bug:`` one, ``2`` for ``Bad input:`` (under torchrun, 1 for either of the last two: torchrun exits 1 whenever a
rank does). A script option ``--bug`` selects a bug (1), ``--fixed`` its fix (0).

A command another integration test already runs the same way (ALREADY_RUN) is not run twice: the test checks
that the test it names still exists. The other commands of README.md and of every docs/ page get ``--help`` once
per distcheck command and per repository script that takes options.
``make`` and ``pytest`` commands are left to tests/unit/test_docs_commands.py (``make test`` is the suite itself).

    .venv/bin/python -m pytest -q tests/integration/test_docs_commands_run.py
"""
from __future__ import annotations

import fnmatch
import glob
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch_helpers import ROOT, run_python

TESTS = ROOT / "tests"
README = ROOT / "README.md"
TIMEOUT = 240.0

# (launcher, distcheck command, fixture glob or None for the built-in model) -> the test that already runs it so,
# with the same exit code checked (and more). It only saves time: a README command that matches none runs here.
ALREADY_RUN = {
    ("torchrun", "consistency", None): "integration/test_consistency.py::test_builtin_passes_and_prints_verdict",
    ("python", "consistency", None): "integration/test_consistency.py::test_world_size_1_runs_and_says_what_means_nothing",
    ("python", "run", "fixtures/ok/*"): "integration/test_correct_corpus.py::test_distcheck_finds_nothing",
    ("python", "compare", "fixtures/ok/*"): "integration/test_correct_corpus.py::test_distcheck_finds_nothing",
    ("python", "run", "fixtures/coll_op_mismatch.py"): "integration/test_run.py::test_op_mismatch",
    ("python", "run", "fixtures/train_fsdp2.py"): "integration/test_run.py::test_non_bugs_have_no_findings",
    ("python", "compare", "fixtures/cmp_ddp_ok.py"): "integration/test_compare.py::test_correct_scripts_compare_equal",
}


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


shown = load("_docs_commands", TESTS / "unit" / "test_docs_commands.py")
fixtures_doc = load("_fixtures_doc", ROOT / "tools" / "fixtures_doc.py")


@dataclass(frozen=True)
class Launch:
    """A README command as launched here: python/torchrun, its distcheck command and its arguments."""
    where: str
    text: str
    launcher: str               # "python" or "torchrun"
    launcher_args: tuple        # torchrun's own options
    command: str                # consistency, run, compare, ...
    args: tuple                 # after the command
    fixture: str | None         # fixtures/... it names (the SCRIPT or a --model file), else None

    @property
    def builtin(self) -> bool:
        return self.command == "consistency" and not any(a.startswith("--model") for a in self.args)

    def already_run(self) -> str | None:
        for (launcher, command, pattern), test in ALREADY_RUN.items():
            if (launcher, command) == (self.launcher, self.command) and (
                    (pattern is None and self.builtin) or (pattern and self.fixture
                                                            and fnmatch.fnmatch(self.fixture, pattern))):
                return test
        return None

    def script_args(self) -> list[str]:
        args = list(self.args)
        return args[args.index("--") + 1:] if "--" in args else []

    def expected_code(self) -> int:
        if self.fixture is None:
            return 0
        kind = fixtures_doc.parse(ROOT / self.fixture).kind
        code = {"ok": 0, "bug": 1, "bad_input": 2}[kind]
        if "--bug" in self.script_args():
            code = 1
        if "--fixed" in self.script_args():
            code = 0
        return min(code, 1) if self.launcher == "torchrun" else code

    def argv(self, report_dir: Path) -> list[str]:
        """``python ARGV`` from the repository root: this --report-dir (the README's replaced), torchrun with
        --standalone (a free port: tests run side by side)."""
        args = list(self.args)
        end = args.index("--") if "--" in args else len(args)
        for i, a in enumerate(args[:end]):
            if a == "--report-dir":
                args[i + 1] = str(report_dir)
            elif a.startswith("--report-dir="):
                args[i] = f"--report-dir={report_dir}"
        if not any(a.startswith("--report-dir") for a in args[:end]) and self.command != "report":
            args[0:0] = ["--report-dir", str(report_dir)]
        if self.launcher == "torchrun":
            extra = [] if {"--standalone", "--rdzv-endpoint", "--rdzv_endpoint"} & set(self.launcher_args) \
                else ["--standalone"]
            return ["-m", "torch.distributed.run", *extra, *self.launcher_args, "-m", "distcheck", self.command,
                    *args]
        return ["-m", "distcheck", self.command, *args]


def launch_of(c) -> Launch | None:
    """The README command as a Launch, or None when it is no distcheck command (make, pytest, a script)."""
    tokens = shown.words(c.text)
    kind = shown.kind_of(tokens)
    if kind == "distcheck":
        launcher, launcher_args = "python", ()
        rest = tokens[1:] if tokens[0].endswith("distcheck") else tokens[3:]
    elif kind == "torchrun" and "-m" in tokens and tokens[tokens.index("-m") + 1:][:1] == ["distcheck"]:
        at = tokens.index("-m")
        launcher, launcher_args, rest = "torchrun", tuple(tokens[1:at]), tokens[at + 2:]
    else:
        return None
    if not rest or rest[0].startswith("-"):
        return None
    command, args = rest[0], tuple(rest[1:])
    fixture = None
    for a in args:
        path = a.split("=")[-1].split(":")[0]
        if path.startswith("fixtures/") and (ROOT / path).is_file():
            fixture = path
            break
    return Launch(c.where, c.text, launcher, launcher_args, command, args, fixture)


COMMANDS = shown.shown_commands(README) if README.exists() else []
LAUNCHES = [launch for launch in map(launch_of, COMMANDS) if launch is not None]
RUN = [launch for launch in LAUNCHES if launch.fixture or launch.builtin]
# Every page of docs/ too: its commands are parsed by the unit test; here each distcheck command and each script
# they show answers --help (the fixtures' own commands are run by tools/gallery.py and their tests).
DOC_COMMANDS = COMMANDS + [c for page in sorted((ROOT / "docs").glob("*.md")) for c in shown.shown_commands(page)]
DOC_LAUNCHES = [launch for launch in map(launch_of, DOC_COMMANDS) if launch is not None]
# --help: every distcheck command README.md and docs/ show and this file does not run, and every script of this
# repository with options that they show (a script without argparse would run for real).
HELP = sorted({("-m", "distcheck", name) for launch in DOC_LAUNCHES if launch not in RUN
               for name in launch.command.split("/")} |
              {(words[1],) for c in DOC_COMMANDS if shown.kind_of(words := shown.words(c.text)) == "script"
               and (ROOT / words[1]).is_file() and "argparse" in (ROOT / words[1]).read_text()})


def test_already_run_names_existing_tests():
    for (_, command, fixture), test in ALREADY_RUN.items():
        path, name = test.split("::")
        source = (TESTS / path).read_text()
        assert f"def {name}(" in source, f"ALREADY_RUN names {test}, which no longer exists"
        if fixture and not glob.has_magic(fixture):
            assert Path(fixture).name in source, f"{test} no longer runs {fixture}"


@pytest.mark.parametrize("launch", RUN, ids=[launch.where for launch in RUN])
def test_readme_command_exits_as_documented(tmp_path, launch):
    covered = launch.already_run()
    if covered:
        pytest.skip(f"run by {covered}")
    report = tmp_path / "report"
    res = run_python(launch.argv(report), timeout=TIMEOUT, cwd=ROOT)
    expected = launch.expected_code()
    assert res.returncode == expected, (
        f"{launch.where}: `{launch.text}` exited {res.returncode}, expected {expected} "
        f"(fixture: {launch.fixture or 'the built-in model'})\n--- output tail ---\n{res.output[-3000:]}")


@pytest.mark.parametrize("argv", HELP, ids=[" ".join(a) for a in HELP])
def test_documented_command_answers_help(argv):
    args = list(argv)
    res = run_python([*args, "--help"], timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "usage" in res.output.lower(), f"python {' '.join(args)} --help:\n{res.output}"
