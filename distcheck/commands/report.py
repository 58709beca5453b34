"""Print a report directory, or merge several (e.g. per-node stack dumps) into one report.

    python -m distcheck report DIR [DIR ...] [--format text|json|github]

``text`` is report.txt's form; ``json`` is report.json's form; ``github`` prints one workflow command per finding,
``::error file=F,line=L::message`` when the finding has a source location (``detail.file``/``detail.line``), else
``::error::message``, so a CI step turns findings into annotations on the diff.

With several directories the findings and checks are concatenated (duplicates dropped). When two or more of them
hold a stack dump (stacks.json, e.g. ``distcheck stacks --report-dir dumps/$(hostname)`` run on every node), the
stacks of all nodes are grouped together and one ``hang`` finding over all ranks replaces the per-node ones: a
rank that looks normal on its own node can be the odd one out across the job.

Exit code: 0 when the (merged) report passed, 1 when it holds findings or failed checks, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from distcheck.errors import UsageError
from distcheck.contract.findings import Finding
from distcheck.contract.report import Report, load_report, render_text

FORMATS = ("text", "json", "github")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="report directories (holding report.json)")
    parser.add_argument("--format", default="text", help="text (default), json, or github (workflow annotations)")


# --- GitHub workflow commands ---------------------------------------------------------------------------------


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _repo_path(path: str) -> str:
    """Annotations need a path relative to the repository root: the workspace (or cwd) when the file is inside it."""
    root = os.environ.get("GITHUB_WORKSPACE") or os.getcwd()
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def github_lines(report: Report) -> list[str]:
    lines = []
    for f in report.findings:
        message = _escape_data(f"[{f.kind}] {f.message}")
        file, line = f.detail.get("file"), f.detail.get("line")
        if file and isinstance(line, int) and line > 0:
            lines.append(f"::error file={_escape_property(_repo_path(str(file)))},line={line}::{message}")
        else:
            lines.append(f"::error::{message}")
    for c in report.checks:
        if not c.ok and not report.findings:
            lines.append(f"::error::{_escape_data(f'check {c.name} failed' + (f' ({c.note})' if c.note else ''))}")
    return lines


# --- merging --------------------------------------------------------------------------------------------------


def merge_reports(dirs: list[Path]) -> tuple[Report, str]:
    """The merged report and the text of the regrouped stacks ("" when fewer than two dirs hold stacks)."""
    from distcheck.analysis.hang import RankProgress, diagnose
    from distcheck.supervise.stacks import load_stacks_document, render_stacks_text

    reports = [load_report(d) for d in dirs]
    if len(reports) == 1:
        return reports[0], ""
    findings: list[Finding] = []
    seen: set[tuple] = set()
    for r in reports:
        for f in r.findings:
            key = (f.kind, tuple(f.ranks), f.message)
            if key not in seen:
                seen.add(key)
                findings.append(f)
    checks = [c for r in reports for c in r.checks]
    artifacts: dict[str, str] = {}
    for d, r in zip(dirs, reports):
        for name, rel in r.artifacts.items():
            artifacts[f"{d.name}/{name}"] = str(d / rel)
    world = max(r.world_size for r in reports)

    docs = []
    for d in dirs:
        path = d / "stacks.json"
        if path.exists():
            try:
                docs.append(load_stacks_document(path))
            except (ValueError, KeyError) as exc:
                raise UsageError(f"{path} is not a valid stack dump ({exc}): pass directories written by "
                                 "'distcheck stacks --report-dir' or a distcheck watchdog") from None
    stacks_text = ""
    if len(docs) >= 2:
        by_rank: dict[int, Any] = {}
        clashes = []
        errors = []
        progress: dict[int, RankProgress] = {}
        for stacks, errs, doc in docs:
            errors.extend(errs)
            for s in stacks:
                if s.rank in by_rank and (by_rank[s.rank].host, by_rank[s.rank].pid) != (s.host, s.pid):
                    clashes.append(f"rank {s.rank} appears on {by_rank[s.rank].host} and {s.host}; kept the first")
                    continue
                by_rank[s.rank] = s
            for rank, p in doc.get("last_collectives", {}).items():
                progress[int(rank)] = RankProgress.from_json(int(rank), p)
        stacks = [by_rank[r] for r in sorted(by_rank)]
        world = max([world] + [s.world_size or 0 for s in stacks])
        diag = diagnose(stacks, progress, world or None, None,
                        {e.rank: e.message for e in errors if e.rank is not None})
        findings = [f for f in findings if f.kind != "hang"]
        if len(diag.groups) > 1 or any(r.findings and r.findings[0].kind == "hang" for r in reports):
            hang = diag.to_finding(stacks, progress, [e.message for e in errors] + clashes)
            hang.detail["merged_from"] = [str(d) for d in dirs]
            findings.insert(0, hang)
        hosts = sorted({s.host for s in stacks})
        stacks_text = render_stacks_text(stacks, errors, f"merged stacks of {len(hosts)} node(s): {', '.join(hosts)}",
                                         progress, diag.groups, diag.message).split("\nall threads, uncollapsed:\n")[0]
    commands = sorted({r.command for r in reports})
    merged = Report(command=f"distcheck report (merged {len(dirs)} dirs: {'; '.join(commands)})", world_size=world,
                    findings=findings, checks=checks, artifacts=artifacts,
                    data={"merged_from": [str(d) for d in dirs]})
    return merged, stacks_text


def main(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format!r} is not supported: use one of {', '.join(FORMATS)}")
    dirs = []
    for d in args.dirs:
        path = Path(d)
        if not path.is_dir():
            raise UsageError(f"{d!r} is not a directory: pass report directories written by distcheck --report-dir")
        dirs.append(path)
    report, stacks_text = merge_reports(dirs)
    if args.format == "json":
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    elif args.format == "github":
        for line in github_lines(report):
            sys.stdout.write(line + "\n")
    else:
        if stacks_text:
            report.sections["stacks (all nodes)"] = stacks_text
        sys.stdout.write(render_text(report, dirs[0] if len(dirs) == 1 else None))
    return report.exit_code
