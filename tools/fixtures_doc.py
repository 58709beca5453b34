"""Generate docs/fixtures.md from the fixtures' module docstrings.

    .venv/bin/python tools/fixtures_doc.py            # print the page
    .venv/bin/python tools/fixtures_doc.py --write    # write docs/fixtures.md
    .venv/bin/python tools/fixtures_doc.py --check    # exit 1 if docs/fixtures.md is stale

Each fixtures/*.py and fixtures/ok/*.py starts its module docstring with ``Bug:``, ``No bug:`` or ``Bad input:``,
holds a "Symptom without distcheck: ..." and a "distcheck reports ..." sentence, and, indented by 4 spaces, the
command(s) that run it from the repository root; fixtures/ok/ files also carry ``nproc:`` and ``compare:`` header
lines. This tool reads those docstrings (it runs nothing) and prints one entry per fixture, sorted by name, in four
sections: bugs, bad input, correct controls (fixtures/), the corpus of correct programs (fixtures/ok/).
tests/unit/test_fixtures_docs.py checks that docs/fixtures.md equals this output.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
PAGE = ROOT / "docs" / "fixtures.md"
REGENERATE = ".venv/bin/python tools/fixtures_doc.py --write"
KINDS = {"Bug:": "bug", "No bug:": "ok", "Not a bug:": "ok", "Bad input:": "bad_input"}
COMMAND_STARTS = ("python -m distcheck", "torchrun", "distcheck")
SYMPTOM = "Symptom without distcheck:"
REPORTS = "distcheck reports"
EXAMPLE = "coll_op_mismatch"  # the fixture whose command the page's introduction shows, where it has one
HEADER = re.compile(r"^(nproc|compare): *(\S+) *$")


@dataclass
class Fixture:
    path: Path          # relative to the repository root
    kind: str           # "bug", "ok", "bad_input" or "?"
    summary: str        # the first sentence, without its "Bug:" prefix
    symptom: str = ""
    reports: str = ""
    commands: list[str] = field(default_factory=list)
    header: dict[str, str] = field(default_factory=dict)


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def paragraphs(lines: list[str]) -> list[str]:
    """The prose, one string per paragraph (a blank line ends one), each line's spaces collapsed."""
    out: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            out[-1].append(line.strip())
        elif out[-1]:
            out.append([])
    return [" ".join(p) for p in out if p]


def parse(path: Path) -> Fixture:
    doc = docstring(path).strip("\n")
    lines = doc.splitlines()
    commands = [ln.strip() for ln in lines if ln.startswith("    ") and ln.strip().startswith(COMMAND_STARTS)]
    header = dict(m.groups() for m in map(HEADER.match, lines) if m)
    # Prose: everything but the commands and the header lines (a command is replaced by a paragraph break).
    prose = ["" if (ln.startswith("    ") and ln.strip().startswith(COMMAND_STARTS)) or HEADER.match(ln) else ln
             for ln in lines]
    paras = paragraphs(prose)
    # The summary: the first line, continued until a blank line, a list item, the symptom or the finding.
    first: list[str] = []
    for line in prose:
        if first and (not line.strip() or line.startswith((" ", "-", SYMPTOM, REPORTS))):
            break
        if line.strip():
            first.append(line.strip())
    summary = re.split(rf"\s*(?:{re.escape(SYMPTOM)}|{re.escape(REPORTS)}\b)", " ".join(first))[0]
    kind = next((k for prefix, k in KINDS.items() if summary.startswith(prefix)), "?")
    summary = next((summary[len(p):].strip() for p in KINDS if summary.startswith(p)), summary.strip())
    summary = summary[:1].upper() + summary[1:]
    symptom = reports = ""
    for para in paras:
        s = para.find(SYMPTOM)
        if s >= 0 and not symptom:
            rest = para[s + len(SYMPTOM):]
            r = re.search(rf"\b{re.escape(REPORTS)}\b", rest)
            symptom = (rest[:r.start()] if r else rest).strip()
        segment = para[s + len(SYMPTOM):] if s >= 0 else para
        r = re.search(rf"(?:^|\s){re.escape(REPORTS)}\b:?", segment)
        if r and not reports:
            reports = segment[r.end():].strip()
    return Fixture(path.relative_to(ROOT), kind, summary, symptom, reports, commands, header)


def fixtures(root: Path = FIXTURES) -> list[Fixture]:
    return [parse(p) for p in sorted(root.glob("*.py")) + sorted((root / "ok").glob("*.py"))]


CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def markdown(text: str) -> str:
    """Docstring prose as Markdown: code spans kept, brackets and angle brackets outside them escaped (a quoted
    ``f32[4, 4](S(0))`` must not become a link, ``'<unset>'`` not an HTML tag)."""
    parts = CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = (parts[i].replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")
                    .replace("<", "&lt;").replace("|", "\\|"))
    return "".join(parts)


def entry(f: Fixture) -> list[str]:
    link = "../" + f.path.as_posix()
    out = [f"### [`{f.path.name}`]({link})", "", markdown(f.summary) or "(no docstring)", ""]
    if f.header:
        out += [" · ".join(f"{k}: {v}" for k, v in f.header.items()), ""]
    out.append(f"- **Symptom without distcheck:** {markdown(f.symptom) or '(not stated)'}")
    out.append(f"- **distcheck reports:** {markdown(f.reports) or '(not stated)'}")
    out.append("")
    if f.commands:
        out += ["```sh", *f.commands, "```", ""]
    return out


SECTIONS = [
    ("bug", "fixtures", "Bugs",
     "Each one is a classic distributed-training bug, reduced to a few lines. distcheck exits 1 on each (under "
     "torchrun, torchrun's own exit code is 1 as well) and its report's first finding is the one described."),
    ("bad_input", "fixtures", "Bad input",
     "Invalid input to distcheck itself: it exits 2 with a one-line message on stderr."),
    ("ok", "fixtures", "Correct programs: controls",
     "Controls for the bugs above (the same code without the bug) and programs that exercise what distcheck must "
     "accept: distcheck finds nothing in them and exits 0, except where a command selects a bug on purpose "
     "(`--bug`, as the entry says)."),
    ("ok", "fixtures/ok", "Correct programs: the corpus",
     "fixtures/ok/ holds correct programs, one idiom each, taken from public code (pytorch/examples, torchtitan, "
     "Lightning, the PyTorch tutorials). A finding on one of them is a false positive. The header says how many "
     "ranks it needs (`nproc`) and whether it keeps its global batch fixed, so that its 1-rank and N-rank runs "
     "train the same model (`compare: yes`); tests/integration/test_correct_corpus.py runs each one."),
]


def render(items: list[Fixture] | None = None) -> str:
    items = fixtures() if items is None else items
    runs = [(f.path.stem != EXAMPLE, c) for f in items if f.kind == "bug" for c in f.commands
            if c.startswith("python -m distcheck run ")]
    example = min(runs)[1] if runs else "python -m distcheck run --nproc 2 -- fixtures/NAME.py"
    out = [
        "# Fixtures",
        "",
        f"<!-- Generated from the fixtures' docstrings: do not edit, run `{REGENERATE}` -->",
        "",
        "`fixtures/*.py` are minimal repro scripts, each showing one bug that distributed PyTorch training "
        "really meets (or none, for the correct controls); `fixtures/ok/*.py` is a corpus of correct programs on "
        "which distcheck must find nothing. The tests run them on real gloo ranks. Each entry below says what "
        "the script does, the symptom users see without distcheck, what distcheck reports, and the command that "
        "runs it. Run one from the repository root, with the venv that `make check` creates:",
        "",
        "```sh",
        f".venv/bin/{example}",
        "```",
        "",
        "Exit codes: `0` no finding, `1` a finding (a bug), `2` bad input. The report is in the "
        "`distcheck-report-<timestamp>/` folder the command prints (or `--report-dir DIR`).",
        "",
        "This page is generated from the fixtures' module docstrings: do not edit it, run "
        f"`{REGENERATE}` (tests/unit/test_fixtures_docs.py checks that it is up to date).",
        "",
    ]
    groups = []
    for kind, folder, title, intro in SECTIONS:
        members = [f for f in items if f.kind == kind and f.path.parent.as_posix() == folder]
        if members:
            groups.append((title, intro, members))
    strays = [f for f in items if not any(f in g[2] for g in groups)]
    if strays:  # a docstring without a known first word: listed, so that it shows
        groups.append(("Other", "Fixtures whose docstring starts with none of `Bug:`, `No bug:`, `Bad input:`.",
                       strays))
    out += [f"- [{title}](#{anchor(title)}): {len(members)}" for title, _, members in groups]
    out.append("")
    for title, intro, members in groups:
        out += [f"## {title}", "", intro, ""]
        for f in members:
            out += entry(f)
    return "\n".join(out).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {PAGE.relative_to(ROOT)} is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
        return 0
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else None
        if current != text:
            state = "missing" if current is None else "stale"
            print(f"{PAGE.relative_to(ROOT)} is {state}: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
