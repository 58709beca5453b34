"""Command-line entry point: ``python -m distcheck COMMAND ...`` (or the ``distcheck`` console script).

    torchrun --nproc-per-node 2 -m distcheck consistency
    python -m distcheck --help

Each command lives in ``distcheck/commands/<name>.py`` and exposes ``add_arguments(parser)`` and
``main(args) -> int``; this module only dispatches and turns bad input into one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from typing import NoReturn, Sequence

from distcheck.errors import StopNow, UsageError

# The registry of commands, in the order of the contract (DESIGN.md). A command is listed when its module exists.
COMMANDS = {
    "consistency": "pre-launch check: environment, collectives, model replicas, parallel vs 1-rank reference",
    "run": "run a script on every rank with collective tracing; report the first diverging collective",
    "compare": "run a script with 1 rank and with N ranks and compare what it recorded",
    "mesh": "check a device mesh shape against a world size, simulated in one process",
    "stacks": "dump and group the Python stacks of every rank of a running job (py-spy)",
    "report": "print or merge report directories (text, json, or GitHub annotations)",
}

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; users asked for one line naming the problem and the fix."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"distcheck: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(EXIT_USAGE)


def available_commands() -> dict[str, str]:
    return {name: help_ for name, help_ in COMMANDS.items()
            if importlib.util.find_spec(f"distcheck.commands.{name}") is not None}


def build_parser(command: str | None = None) -> OneLineParser:
    """The parser; only ``command``'s module is imported (each pulls in torch pieces, which costs seconds)."""
    from distcheck.contract.version import __version__

    parser = OneLineParser(prog="python -m distcheck", description="Correctness harness for distributed PyTorch.")
    parser.add_argument("--version", action="version", version=f"distcheck {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, help_ in available_commands().items():
        if name != command:
            sub.add_parser(name, help=help_)
            continue
        module = importlib.import_module(f"distcheck.commands.{name}")
        cmd = sub.add_parser(name, help=help_, description=(module.__doc__ or help_).strip(),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_module=module)
    return parser


def join_negative_values(argv: list[str]) -> list[str]:
    """``--shape -1,4`` -> ``--shape=-1,4``: argparse takes a value starting with "-" for an option unless it looks
    like a plain negative number, so the documented form would fail with "expected one argument"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "=" not in arg and i + 1 < len(argv) and re.match(r"^-\d", argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    typed = list(sys.argv[1:] if argv is None else argv)
    from distcheck.options import in_torchrun

    if not in_torchrun():  # not a rank: the streams are distcheck's own
        from distcheck.supervise.console import survive_lost_console

        survive_lost_console()  # `distcheck run ... | head`: the verdict is the exit code, whoever reads the rest
    try:
        argv = join_negative_values(typed)
        parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        args.argv = typed  # report.json's "command": as the user typed it
        return int(args._module.main(args))
    except UsageError as exc:
        sys.stderr.write(f"distcheck: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("distcheck: interrupted\n")
        return 130
    except StopNow as exc:
        # A second stop signal before the command could catch it itself (while parsing, importing, starting).
        sys.stderr.write(f"distcheck: {exc}: no report was written\n")
        return 1
