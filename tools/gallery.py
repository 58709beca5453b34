"""Run every fixture's documented command and print a fixture table for the docs (markdown).

    .venv/bin/python tools/gallery.py > /tmp/gallery.md
    .venv/bin/python tools/gallery.py --only coll_op_mismatch
    .venv/bin/python tools/gallery.py --exclude 'cmp_*'

Each fixtures/*.py starts its module docstring with ``Bug:``, ``No bug:`` or ``Bad input:`` and holds, indented by
4 spaces, the command that runs it under distcheck. This tool runs that command from the repository root (timeout
180 s each, PYTHONPATH=ROOT, OMP_NUM_THREADS=1, a temporary --report-dir where the command takes one, torchrun with
--standalone so parallel runs never share a port) and prints one row per fixture: its name, its docstring's first
line, and distcheck's first finding as ``[kind] ranks: message`` (or "PASSED, no findings", or the exit-2 message).
A documentation tool run by hand: not part of the test suite.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
BIN = Path(sys.executable).parent
TIMEOUT = 180.0
CELL = 160
KINDS = {"Bug:": "Bug", "No bug:": "No bug", "Not a bug:": "No bug", "Bad input:": "Bad input"}
COMMAND_STARTS = ("python -m distcheck", "torchrun", "distcheck")
# Subcommands that take --report-dir; it goes right after the subcommand, before any `-- SCRIPT`.
REPORT_DIR_COMMANDS = {"run", "compare", "consistency", "mesh", "stacks"}


@dataclass
class FixtureDoc:
    name: str
    kind: str
    first_line: str
    command: str | None


def parse_fixture(path: Path) -> FixtureDoc:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    # The bug sentence: the first line, continued until a blank line, the symptom, the finding or the command.
    lines = doc.strip().splitlines()
    summary = lines[:1]
    for line in lines[1:]:
        if not line.strip() or line.startswith((" ", "-", "Symptom without distcheck", "distcheck reports")):
            break
        summary.append(line.strip())
    first = " ".join(s.strip() for s in summary)
    kind = next((k for prefix, k in KINDS.items() if first.startswith(prefix)), "?")
    command = None
    for line in doc.splitlines():
        if line.startswith("    ") and line.strip().startswith(COMMAND_STARTS):
            command = line.strip()
            if "distcheck" in command:  # prefer the distcheck command over a plain `torchrun script.py`
                break
    return FixtureDoc(path.stem, kind, first, command)


def prepare(command: str, report_dir: Path) -> list[str]:
    """The documented command as argv: this venv's executables, --standalone for torchrun, a --report-dir."""
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv[0] = str(BIN / "torchrun")
        if "--standalone" not in argv:
            argv.insert(1, "--standalone")
    elif argv[0] == "distcheck":
        argv[0:1] = [sys.executable, "-m", "distcheck"]
    if "--report-dir" not in argv and "distcheck" in argv:
        sub = argv.index("distcheck") + 1
        end = argv.index("--") if "--" in argv else len(argv)
        if sub < end and argv[sub] in REPORT_DIR_COMMANDS:
            argv.insert(sub + 1, "--report-dir")
            argv.insert(sub + 2, str(report_dir))
    return argv


def run(argv: list[str], timeout: float) -> tuple[int | None, str, str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "DISTCHECK_REPORT_DIR"):
        env.pop(key, None)
    start = time.monotonic()
    # Own session: a timeout ends the launcher and every rank it started, by this process group only.
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    code: int | None
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived their launcher
        except ProcessLookupError:
            pass
    return code, out, err, time.monotonic() - start


def shorten(text: str, limit: int = CELL) -> str:
    text = re.sub(r"\s+", " ", text.replace(str(ROOT) + os.sep, "")).strip()
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def rank_list(ranks: list[int]) -> str:
    """0,1,2,5 -> '0-2,5': a 64-rank mesh finding must not fill the cell with rank numbers."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def finding_cell(code: int | None, out: str, err: str, report_dir: Path, timeout: float) -> str:
    if code is None:
        return f"FAILED: timed out after {timeout:.0f}s"
    if code == 2 and err.strip():  # bad input: the one-line message on stderr is the verdict
        return shorten(f"exit 2: {last_line(err)}")
    report = None
    path = report_dir / "report.json"
    if path.exists():
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return shorten(f"FAILED: unreadable report.json ({exc})")
    if report is None:
        if code == 2 or (code != 0 and err.strip()):
            return shorten(f"exit {code}: {last_line(err) or last_line(out)}")
        return shorten(f"FAILED: exit {code}, no report.json: {last_line(err) or last_line(out)}")
    findings = report.get("findings") or []
    if not findings:
        if report.get("ok", code == 0):
            return "PASSED, no findings"
        return shorten(f"FAILED (exit {code}) with no findings")
    f = findings[0]
    ranks = rank_list(f.get("ranks", []))
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    text = shorten(f"[{f.get('kind')}] {ranks}: {f.get('message', '')}", CELL - len(more))
    return text + more


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this fixture (name with or without .py; repeatable)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip fixtures whose name matches, e.g. 'cmp_*' (repeatable)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per command (default 180)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)

    only = {n.removesuffix(".py") for n in args.only}
    paths = sorted(FIXTURES.glob("*.py"))
    paths = [p for p in paths if (not only or p.stem in only)
             and not any(fnmatch.fnmatch(p.name, g) or fnmatch.fnmatch(p.stem, g) for g in args.exclude)]
    if not paths:
        print(f"no fixture matches {sorted(only) or args.exclude}", file=sys.stderr)
        return 2

    print("| fixture | bug | distcheck's one-line finding |")
    print("|---|---|---|")
    for path in paths:
        doc = parse_fixture(path)
        if doc.command is None:
            result = "FAILED: no command in the docstring"
        else:
            with tempfile.TemporaryDirectory(prefix=f"gallery-{doc.name}-") as tmp:
                report_dir = Path(tmp) / "report"
                argv_ = prepare(doc.command, report_dir)
                if args.dry_run:
                    print(" ".join(shlex.quote(a) for a in argv_), file=sys.stderr)
                    result = "(not run)"
                else:
                    print(f"[gallery] {doc.name}: {doc.command}", file=sys.stderr, flush=True)
                    try:
                        code, out, err, secs = run(argv_, args.timeout)
                        result = finding_cell(code, out, err, report_dir, args.timeout)
                        print(f"[gallery] {doc.name}: exit {code} in {secs:.0f}s: {result}", file=sys.stderr,
                              flush=True)
                    except Exception as exc:  # a documentation tool: one broken fixture must not end the table
                        result = shorten(f"FAILED: {type(exc).__name__}: {exc}")
        bug = shorten(doc.first_line, 120) if doc.first_line else "(no docstring)"
        print(f"| `{path.name}` | {cell(bug)} | {cell(result)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
