"""docs/commands.md's command list stays in step with the CLI: every flag a command takes is in its line there, and
every flag it shows exists (frozen-CLI style). The links of README.md and docs/*.md stay inside the repository and
point at files (and headings) a clone has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from distcheck import cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS_DOC = ROOT / "docs" / "commands.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_flags() -> dict[str, set[str]]:
    """The flags of each command in the first code block of docs/commands.md."""
    text = COMMANDS_DOC.read_text()
    block = text[text.index("```") + 3:]
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
def test_commands_doc_lists_exactly_the_flags_of_each_command(command):
    assert documented_flags()[command] == cli_flags(command)


def test_every_command_is_in_the_commands_doc():
    assert set(documented_flags()) == set(cli.COMMANDS)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (lowercase, punctuation dropped, spaces to hyphens)."""
    anchors = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def links(text: str) -> list[tuple[str, str]]:
    """(target, anchor) of each markdown link, outside code blocks and code spans; an escaped ``\\]`` is no link."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"(?<!\\)\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(page):
    for target, anchor in links(page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target).resolve() if target else page
        assert path.is_relative_to(ROOT) and path.exists(), \
            f"{page.relative_to(ROOT)} links {target}, which a clone does not have"
        if anchor and path.suffix == ".md":
            assert anchor in heading_anchors(path), f"{page.relative_to(ROOT)} links {target}#{anchor}: no such heading"
