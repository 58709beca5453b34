"""Bad input is one line on stderr and exit 2, before any rank starts (cli.main in this process)."""
from __future__ import annotations

import pytest

from distcheck import cli
from distcheck.options import capacity


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


def run_cli(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,message", [
    (["run", "--timeout", "nan"], "--timeout nan: expected a finite number of seconds > 0"),
    (["run", "--timeout", "inf"], "--timeout inf: expected a finite number of seconds > 0"),
    (["run", "--timeout", "0"], "--timeout 0: expected a finite number of seconds > 0"),
    (["run", "--nproc", "0"], "--nproc '0': expected a whole number >= 1"),
    (["run", "--steps", "-1"], "--steps '-1': expected a whole number >= 0"),
    (["run", "--nproc", "100000"], "--nproc 100000: this machine has"),
    (["compare", "--nproc", "2", "--timeout", "nan"], "--timeout nan: expected a finite number of seconds > 0"),
    (["compare", "--nproc", "1,100000"], "--nproc 100000: this machine has"),
    (["compare", "--nproc", "2", "--rtol", "nan"], "--rtol 'nan': expected a finite number >= 0"),
    (["consistency", "--timeout", "inf"], "--timeout inf: expected a finite number of seconds > 0"),
    (["consistency", "--rtol", "nan"], "--rtol 'nan': expected a finite number >= 0"),
    (["consistency", "--steps", "0"], "--steps '0': expected a whole number >= 1"),
])
def test_numeric_options_are_finite_and_in_range(capsys, script, argv, message):
    full = argv + (["--", str(script)] if argv[0] in ("run", "compare") else [])
    code, _, err = run_cli(capsys, full)
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err


def test_more_ranks_than_the_machine_can_run_names_the_limit_and_the_override(capsys, script):
    limit, _ = capacity()
    code, _, err = run_cli(capsys, ["run", "--nproc", str(limit + 1), "--", str(script)])
    assert code == 2 and f"use --nproc {limit} or less, or pass --oversubscribe" in err


def test_a_syntax_error_is_bad_input_with_its_line(capsys, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import os\nx = (1,\nprint(x)\n")
    code, _, err = run_cli(capsys, ["run", "--nproc", "2", "--", str(bad)])
    assert code == 2 and err.strip() == (f"distcheck: error: {bad}:2: syntax error: '(' was never closed: fix the "
                                         "script before running it")


def test_a_negative_shape_dim_works_as_documented(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default report directory is made in the working directory, not the checkout's
    code, out, err = run_cli(capsys, ["mesh", "--world-size", "8", "--shape", "-1,4", "--names", "dp,tp"])
    assert code == 0, err
    assert "distcheck PASSED" in out and "command:    distcheck mesh --world-size 8 --shape -1,4" in out


def test_join_negative_values_leaves_the_script_arguments_alone():
    argv = ["mesh", "--shape", "-1,4", "--", "train.py", "--lr", "-1"]
    assert cli.join_negative_values(argv) == ["mesh", "--shape=-1,4", "--", "train.py", "--lr", "-1"]
