"""The README's command list stays in step with the CLI: every flag a command takes is in its README line, and
every flag the README shows exists (frozen-CLI style)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from distcheck import cli

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_flags() -> dict[str, set[str]]:
    text = README.read_text()
    block = text[text.index("## Commands"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    flags: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        match = re.search(r"-m distcheck (\w+)", line)
        if match:
            current = match.group(1)
        if current:
            flags.setdefault(current, set()).update(re.findall(r"(--[a-z][a-z-]*)", line))
    for flags_of in flags.values():
        flags_of.discard("--nproc-per-node")  # torchrun's, in the torchrun forms
    return flags


def cli_flags(command: str) -> set[str]:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)).choices[command]
    return {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_readme_lists_exactly_the_flags_of_each_command(command):
    assert readme_flags()[command] == cli_flags(command)


def test_every_command_is_in_the_readme():
    assert set(readme_flags()) == set(cli.COMMANDS)


def test_readme_links_stay_inside_the_repository():
    root = README.parent
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if "://" in target:
            continue
        path = (root / target).resolve()
        assert path.is_relative_to(root) and path.exists(), f"README links {target}, which a clone does not have"
