"""Print a report directory, or merge several (e.g. per-node stack dumps) into one report.

    python -m distcheck report DIR [DIR ...] [--format text|json|github]

``text`` is report.txt's form; ``json`` is report.json's form; ``github`` prints one workflow command per finding,
``::error file=F,line=L::message`` when the finding has a source location (``detail.file``/``detail.line``), else
``::error::message``, so a CI step turns findings into annotations on the diff.

With several directories (e.g. one per node) the findings are concatenated (duplicates dropped) and each check
is listed once (failed if it failed anywhere). When two or more of them hold a stack dump (stacks.json, e.g.
``distcheck stacks --report-dir dumps/$(hostname)`` run on every node), the stacks of all nodes are grouped
together and one ``hang`` finding over all ranks replaces the per-node ones: a rank that looks normal on its own
node can be the odd one out across the job. A finding the merged view contradicts is dropped: a node that could
not see another node's files took its ranks for dead ("rank 1 ended without finishing its script"), while the
node that holds rank 1's trace, or the stacks dumped there, show it running.

Exit code: 0 when the (merged) report passed, 1 when it holds findings or failed checks, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding
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
    from distcheck.analysis.hang import diagnose
    from distcheck.supervise.node_exchange import merge_stack_documents
    from distcheck.supervise.stacks import load_stacks_document, render_stacks_summary

    if len(dirs) > 1:
        from distcheck.supervise.node_report import job_report_from_nodes

        # Node report dirs of one job (each with node-<host>/summary.json): the report node 0 would have written.
        job = job_report_from_nodes(dirs)
        if job is not None:
            return job, ""
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
    checks = merge_checks([c for r in reports for c in r.checks])
    artifacts: dict[str, str] = {}
    for d, r in zip(dirs, reports):
        for name, rel in r.artifacts.items():
            artifacts[f"{d.name}/{name}"] = str(d / rel)
    world = max(r.world_size for r in reports)

    states = own_states(reports)
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
    alive = {s.rank for stacks, _, _ in docs for s in stacks if not s.role}
    findings = [f for f in findings if not contradicted(f, states, alive)]
    if len(docs) >= 2:
        stacks, errors, progress, clashes = merge_stack_documents(docs)
        world = max([world] + [s.world_size or 0 for s in stacks])
        diag = diagnose(stacks, progress, world or None, None,
                        {e.rank: e.message for e in errors if e.rank is not None})
        findings = [f for f in findings if f.kind != "hang"]
        if len(diag.groups) > 1 or any(r.findings and r.findings[0].kind == "hang" for r in reports):
            hang = diag.to_finding(stacks, progress, [e.message for e in errors] + clashes)
            hang.detail["merged_from"] = [str(d) for d in dirs]
            findings.insert(0, hang)
        hosts = sorted({s.host for s in stacks})
        stacks_text = render_stacks_summary(stacks, errors,
                                            f"merged stacks of {len(hosts)} node(s): {', '.join(hosts)}", progress,
                                            diag.groups, diag.message)
    commands = sorted({r.command for r in reports})
    merged = Report(command=f"distcheck report (merged {len(dirs)} dirs: {'; '.join(commands)})", world_size=world,
                    findings=findings, checks=checks, artifacts=artifacts,
                    data={"merged_from": [str(d) for d in dirs]})
    return merged, stacks_text


def merge_checks(checks: list[CheckResult]) -> list[CheckResult]:
    """Each check once, in first-seen order: failed if it failed in any directory, its longest time, its notes."""
    merged: dict[str, CheckResult] = {}
    for c in checks:
        first = merged.get(c.name)
        if first is None:
            merged[c.name] = CheckResult(c.name, c.ok, c.seconds, note=c.note)
            continue
        first.ok = first.ok and c.ok
        first.seconds = max(first.seconds, c.seconds)
        if c.note and c.note not in first.note.split("; "):
            first.note = f"{first.note}; {c.note}" if first.note else c.note
    return list(merged.values())


RUNNING_STATES = ("ok", "hung", "stopped")  # trace_align's states of a rank that did not fail


def own_states(reports: list[Report]) -> dict[int, str]:
    """Each rank's state as the report of the node holding its files tells it (its trace is an artifact there):
    the node that sees the rank, not one that only missed its files."""
    states: dict[int, str] = {}
    for r in reports:
        for rank, outcome in (r.data.get("ranks") or {}).items():
            if f"trace-rank{rank}" in r.artifacts and isinstance(outcome, dict) and rank.isdigit():
                states.setdefault(int(rank), str(outcome.get("state")))
    return states


def contradicted(f: Finding, states: dict[int, str], alive: set[int]) -> bool:
    """A rank_failure without a traceback of its own (the rank "ended without finishing its script", "not
    found") whose every rank the merged view shows alive: dumped in a stack dump, or running/finished by the
    report of the node that holds its files."""
    if f.kind != "rank_failure" or f.detail.get("exception") or not f.ranks:
        return False
    return all(r in alive or states.get(r) in RUNNING_STATES for r in f.ranks)


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
