"""Print a report directory, merge several (e.g. per-node stack dumps) into one report, or diagnose a job from
torch's own Flight Recorder dumps.

    python -m distcheck report DIR [DIR ...] [--format text|json|github] [--report-dir DIR]
    python -m distcheck report dumps/              # TORCH_FR_DUMP_TEMP_FILE=dumps/rank_ on the job
    python -m distcheck report dumps/rank_         # the same, by prefix

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

**Flight Recorder dumps.** A folder (or file prefix) of the per-rank files torch's NCCL watchdog writes on a
timeout (``TORCH_FR_DUMP_TEMP_FILE``), or that ``_dump_fr_trace`` / ``_dump_fr_trace_json`` return, of a job
distcheck never saw: contract/torch_fr_dumps.py finds and reads them (pickle or JSON, NCCL's ring or gloo's; a file
cut off or unreadable is a warning naming it), analysis/fr_postmortem.py diagnoses the job (mismatched
collectives, who never issued what the others wait in, timeouts). The report is written like every command's:
``--report-dir DIR``, by default a new ``distcheck-report-<timestamp>/`` in the working directory (the dumps'
folder is left as it was: it may be read-only, shared, or read again), and printed in ``--format``.

Exit code: 0 when the (merged) report passed, 1 when it holds findings or failed checks, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, load_report, prepare_report_dir, publish

FORMATS = ("text", "json", "github")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="report directories (holding report.json), or a folder or file prefix of torch's "
                             "Flight Recorder dumps")
    parser.add_argument("--format", default="text", help="text (default), json, or github (workflow annotations)")
    parser.add_argument("--report-dir", default=None,
                        help="also write report.json and report.txt there (for Flight Recorder dumps: where the "
                             "report goes, by default a new distcheck-report-<timestamp>/ here)")


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


# --- torch's Flight Recorder dumps ------------------------------------------------------------------------------


def find_dumps(targets: list[str]) -> list[Any]:
    """The dumps of each target (contract/torch_fr_dumps.DumpSet), or UsageError: several targets are the folders
    of one job (one per node), so no rank may have dumps in two of them."""
    from distcheck.contract import torch_fr_dumps

    unique: dict[str, str] = {}  # a target given twice is read once
    for t in targets:
        unique.setdefault(os.path.realpath(t) + ("/" if str(t).endswith(("/", os.sep)) else ""), t)
    sets = [torch_fr_dumps.find(t) for t in unique.values()]
    owner: dict[int, str] = {}
    for ds in sets:
        for f in ds.files:
            if f.rank in owner and owner[f.rank] != ds.target:
                raise UsageError(f"rank {f.rank} has dumps in both {owner[f.rank]!r} and {ds.target!r}: pass the "
                                 "folders of one job (one dump per rank)")
            owner[f.rank] = ds.target
    return sets


def flight_recorder_report(sets: list[Any], command: str) -> Report:
    """The diagnosis of a job from torch's dumps alone, read one ring at a time (a 4,096-rank job's rings are never
    in memory together)."""
    from distcheck.analysis.fr_postmortem import Postmortem
    from distcheck.contract import torch_fr_dumps

    start = time.monotonic()
    pm = Postmortem()
    for ds in sets:
        for path, why in ds.skipped:
            pm.skip(path, why)
        for ring in torch_fr_dumps.read_all(ds):
            if isinstance(ring, torch_fr_dumps.Unreadable):
                pm.unreadable(ring.rank, ring.path, ring.reason)
            else:
                pm.add(ring)
    diag = pm.result()
    seconds = time.monotonic() - start
    for c in diag.checks:
        c.seconds = seconds
    prefixes = sorted({p for ds in sets for p in ds.prefixes})
    diag.data["flight_recorder"]["prefixes"] = prefixes
    return Report(command=command, world_size=diag.world_size, findings=diag.findings, checks=diag.checks,
                  warnings=diag.warnings, data=diag.data)


def main(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format!r} is not supported: use one of {', '.join(FORMATS)}")
    from distcheck.contract.report import command_line
    from distcheck.contract.torch_fr_dumps import looks_like_dumps

    dumps = [looks_like_dumps(d) for d in args.dirs]
    if any(dumps):
        if not all(dumps):
            odd = next(d for d, is_dump in zip(args.dirs, dumps) if not is_dump)
            raise UsageError(f"{odd!r} is not a folder or prefix of Flight Recorder dumps while the other arguments "
                             "are: pass either report directories or the dumps of one job, not both")
        sets = find_dumps(list(args.dirs))
        report_dir = prepare_report_dir(args.report_dir)
        report = flight_recorder_report(sets, command_line(getattr(args, "argv", ["report", *args.dirs])))
        return _print(report, args.format, report_dir, "")
    dirs = []
    for d in args.dirs:
        path = Path(d)
        if not path.is_dir():
            raise UsageError(f"{d!r} is neither a directory nor a prefix of Flight Recorder dumps: pass report "
                             "directories written by distcheck --report-dir, or the folder or file prefix of torch's "
                             "dumps (TORCH_FR_DUMP_TEMP_FILE)")
        if len(args.dirs) == 1 and not (path / "report.json").exists() and not any(path.glob("node-*/report.json")):
            raise UsageError(f"{d!r} holds neither report.json nor Flight Recorder dumps (files named <prefix><rank>, "
                             "as TORCH_FR_DUMP_TEMP_FILE names them): pass a directory written by distcheck "
                             "--report-dir, or the folder or file prefix of torch's dumps (e.g. dumps/rank_)")
        dirs.append(path)
    report, stacks_text = merge_reports(dirs)
    target = prepare_report_dir(args.report_dir) if args.report_dir else None
    return _print(report, args.format, target, dirs[0] if len(dirs) == 1 else None, stacks_text)


def _print(report: Report, fmt: str, target: Path | None, shown: Path | None = None, stacks_text: str = "") -> int:
    """Write the report into ``target`` (--report-dir, or where the dumps' report goes) and print it in ``fmt``;
    ``shown``: the one directory read, named as the report's place when nothing is written. The merged stack groups
    are printed with the text, not written: each node's stacks files hold them."""
    if target is not None:
        publish(report, target)
    if fmt == "text":
        if stacks_text:
            report.sections["stacks (all nodes)"] = stacks_text
        publish(report, target or shown, echo=sys.stdout, write=False)
    elif fmt == "json":
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    elif fmt == "github":
        for line in github_lines(report):
            sys.stdout.write(line + "\n")
    return report.exit_code
