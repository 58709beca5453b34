"""Shared by both tiers (tests/unit launches no process; tests/integration runs real ranks, always with timeouts).

    make test-unit     # seconds
    make test          # both tiers
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = ROOT / "fixtures"
# Helpers (launch_helpers) and the fixture scripts (imported as modules by in-process tests) are importable.
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(FIXTURES))

pytest_plugins = ["pytester"]


def source_line(source: str | Path | ModuleType | None, marker: str, text: str | None = None) -> int:
    """The one rule for "the line of this marker": the first line after the module docstring that contains it.

    ``source`` is a fixture's file name (``"coll_hang.py"``), a path, or an imported module; or pass ``text``.
    Fixture docstrings quote the buggy lines, so the docstring is skipped.
    """
    if text is None:
        if isinstance(source, ModuleType):
            source = source.__file__
        path = Path(source)
        text = (path if path.is_absolute() or path.exists() else FIXTURES / path).read_text()
    lines = text.splitlines()
    body = ast.parse(text).body
    skip = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip = body[0].end_lineno
    for number, line in enumerate(lines[skip:], skip + 1):
        if marker in line:
            return number
    raise AssertionError(f"{marker!r} is not in {source or 'the text'}")


@pytest.fixture
def line_of():
    """``line_of("coll_hang.py", "# BUG")`` -> the line number (see source_line)."""
    return source_line


# The files whose tests launch the most (two torchrun agents, restarts, fresh interpreters, torch.compile, the
# corpus): they go first. `make test` runs 3 xdist workers with worksteal on 2 cores; with these at the end of the
# collection (alphabetical order puts test_multinode, test_torchrun_fail_fast and test_untraced there) the last
# minute ran one long test on one worker while the others idled. Longest first, the tail is short tests.
SLOW_FIRST = ("test_multinode.py", "test_torchrun_fail_fast.py", "test_untraced.py", "test_faults.py",
              "test_faults_procs.py", "test_correct_corpus.py", "test_consistency.py", "test_faults_disk.py",
              "test_pytest_plugin.py", "test_check_model_live.py", "test_watchdog.py", "test_dp_inputs_fsdp.py")


def pytest_collection_modifyitems(config, items):
    def weight(item) -> tuple[int, int]:
        name = item.path.name
        if name in SLOW_FIRST:
            return 0, SLOW_FIRST.index(name)
        return (1 if "integration" in item.path.parts else 2), 0

    items.sort(key=weight)  # stable: each file keeps its own order


def pytest_configure(config):
    """Under xdist, the controller starts the one zygote every worker's launches fork from (tests/integration/
    conftest.py says why there is one) and names it in DISTCHECK_ZYGOTE, which the workers inherit: one import of
    torch for the suite instead of one per worker, about 4 s of CPU each. Without xdist, or for the unit tier
    alone, the integration tier's session fixture starts one when a test needs it."""
    from distcheck.supervise.zygote import ENV

    wanted = [a for a in config.args if "unit" not in Path(a).parts]
    if (sys.platform != "linux" or hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
            or os.environ.get(ENV) is not None or not wanted):
        return
    from launch_helpers import start_zygote

    config.stash[_ZYGOTE] = start_zygote()


def pytest_unconfigure(config):
    started = config.stash.get(_ZYGOTE, None)
    if started is not None:
        from launch_helpers import stop_zygote

        stop_zygote(*started)


_ZYGOTE = pytest.StashKey()
