"""report.json / report.txt: the public report contract, written atomically.

A report directory holds report.json (machines), report.txt (people; also printed to stdout by rank 0 or the
supervisor) and artifacts (per-rank traces, stack dumps) listed in report.json's "artifacts" by relative path.
When the report cannot be written (the directory is full, gone or replaced), neither file is left behind, the
report goes to stderr after a one-line reason, and the printed text never names a report file that is not there.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from distcheck.contract import atomic_file
from distcheck.contract.files import REPORT_JSON, REPORT_TXT
from distcheck.errors import UsageError
from distcheck.contract.findings import KINDS, CheckResult, Finding, Note, headline, jsonable

# Contract keys of report.json; extra data (placement tables, ...) goes under other keys and never replaces these.
CONTRACT_KEYS = ("tool", "version", "command", "ok", "world_size", "findings", "checks", "artifacts")
# report.txt shows at most this many findings of one kind; the JSON always has all of them.
TEXT_FINDINGS_PER_KIND = 10


def version() -> str:
    from distcheck.contract.version import __version__

    return __version__


def command_line(argv: list[str] | tuple[str, ...]) -> str:
    """The command as the user typed it, for report.json's "command" (each command's argv, without the program)."""
    return "distcheck " + " ".join(argv)


@dataclass
class Report:
    command: str
    world_size: int
    findings: list[Finding] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    # Extra top-level JSON data and matching text sections for report.txt (e.g. the placement table).
    data: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)
    warnings: list[Note] = field(default_factory=list)  # never change ok or the exit code
    # Why publish could not write it (None: written, or not tried): the text then names no report file.
    unwritten: str | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return not self.findings and all(c.ok for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": "distcheck",
            "version": version(),
            "command": self.command,
            "ok": self.ok,
            "world_size": self.world_size,
            "findings": [jsonable(f.to_json()) for f in self.findings],
            "checks": [c.to_json() for c in self.checks],
            "artifacts": dict(self.artifacts),
        }
        if self.warnings:
            out["warnings"] = [jsonable(w.to_json()) for w in self.warnings]
        for key, value in self.data.items():
            if key not in CONTRACT_KEYS and key != "warnings":
                out[key] = jsonable(value)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        extra = {k: v for k, v in data.items() if k not in CONTRACT_KEYS and k != "warnings"}
        return cls(
            command=data.get("command", ""),
            world_size=int(data.get("world_size", 0)),
            findings=[Finding.from_json(f) for f in data.get("findings", [])],
            checks=[CheckResult.from_json(c) for c in data.get("checks", [])],
            artifacts=dict(data.get("artifacts", {})),
            data=extra,
            warnings=[Note.from_json(w) for w in data.get("warnings", [])],
        )


def finding_lines(findings: list[Finding], where: str | None = "report.json") -> list[str]:
    """The findings as report.txt lists them (and the pytest marker's failure text): one headline each, a message's
    later lines indented under it, at most TEXT_FINDINGS_PER_KIND of a kind and a count of the rest (in ``where``)."""
    lines: list[str] = []
    shown: dict[str, int] = {}
    for f in findings:
        shown[f.kind] = shown.get(f.kind, 0) + 1
        if shown[f.kind] <= TEXT_FINDINGS_PER_KIND:
            lines.append("  " + headline(f).replace("\n", "\n    "))  # a message's later lines stay under it
    for kind, count in shown.items():
        if count > TEXT_FINDINGS_PER_KIND:
            rest = f"in {where}" if where else "not shown"
            lines.append(f"  ... and {count - TEXT_FINDINGS_PER_KIND} more {kind} findings {rest}")
    return lines


def render_text(report: Report, report_dir: str | os.PathLike | None = None) -> str:
    """The human form of the report: verdict first, then checks, findings and sections."""
    n = len(report.findings)
    verdict = "PASSED" if report.ok else f"FAILED ({n} finding{'s' if n != 1 else ''})"
    lines = [f"distcheck {verdict}", f"  command:    {report.command}", f"  world size: {report.world_size}"]
    if report.checks:
        lines.append("checks:")
        width = max(len(c.name) for c in report.checks)
        for c in report.checks:
            status = "ok  " if c.ok else "FAIL"
            note = f"  ({c.note})" if c.note else ""
            lines.append(f"  {status} {c.name:<{width}} {c.seconds:7.2f}s{note}")
    if report.findings:
        lines.append("findings:")
        lines += finding_lines(report.findings)
    if report.warnings:
        lines.append("warnings (not findings: the verdict does not depend on them):")
        for w in report.warnings:
            lines.append("  " + headline(w))
    for title, body in report.sections.items():
        lines.append(f"{title}:")
        lines.extend("  " + line for line in body.rstrip("\n").splitlines())
    if report.artifacts:
        lines.append("artifacts: " + ", ".join(sorted(report.artifacts.values())))
    if report.unwritten is not None:
        lines.append(f"report: not written ({report.unwritten}); report.json went to stderr")
    elif report_dir is not None:
        lines.append(f"report: {Path(report_dir) / 'report.json'}")
    return "\n".join(lines) + "\n"


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """A report file written whole, so readers never see half a file (contract/atomic_file.py, the one atomic
    write; the report's writers call it by this name)."""
    atomic_file.write_text(path, text)


def default_report_dir(now: float | None = None, suffix: str | int | None = None) -> Path:
    """``distcheck-report-<timestamp>-<suffix>``: the suffix (by default this process's pid) keeps two commands
    started in the same second apart; ranks that must agree pass a shared one (their torchrun agent's pid)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return Path.cwd() / f"distcheck-report-{stamp}-{os.getpid() if suffix is None else suffix}"


def prepare_report_dir(path: str | os.PathLike | None) -> Path:
    """Create the report directory and prove it is writable, or raise UsageError (exit 2) naming the fix."""
    target = Path(path) if path else default_report_dir()
    probe = target / f".distcheck-write-test-{os.getpid()}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        try:
            probe.write_text("ok")
        finally:  # a full disk creates the file and then fails the write: never leave it behind
            probe.unlink(missing_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(
            f"report dir {str(target)!r} is not writable ({reason}): pass --report-dir with a writable directory"
        ) from None
    return target


def publish(report: Report, report_dir: str | os.PathLike | None, echo: TextIO | None = None,
            write: bool = True) -> Path | None:
    """The one way a report leaves distcheck: report.json and report.txt into ``report_dir`` (when there is one),
    then its text to ``echo`` (stdout for a command's own report, the job's stderr for a node watcher's, None when
    the caller prints in another form: ``report --format json``, ``stacks``). ``write=False`` prints a report
    already written there, unchanged. Returns the report.json path, or None when nothing was written (no
    directory, or one that refused the files: then report.json went to stderr).

        python -m distcheck run --nproc 2 -- train.py      # every command's report ends here
    """
    written = _write_files(report, Path(report_dir)) if report_dir is not None and write else None
    if echo is not None:
        echo.write(render_text(report, report_dir))
        echo.flush()
    return written


def remove_report(report_dir: str | os.PathLike) -> None:
    """Remove a report directory's report.json and report.txt: a command about to write a new report there (an
    earlier run's must not pass for this one's), or one that ended on bad input and writes none."""
    for name in (REPORT_TXT, REPORT_JSON):
        (Path(report_dir) / name).unlink(missing_ok=True)


def _write_files(report: Report, report_dir: Path) -> Path | None:
    """Write report.json and report.txt into report_dir (for :func:`publish`, their one caller); returns the
    report.json path.

    When the directory stopped being writable during the run (deleted, full,
    replaced), the report is not lost: report.json goes to stderr after a line saying why, neither file is left
    behind (report.txt alone would point at a report.json that is not there), ``report.unwritten`` says why for
    :func:`render_text`, and None is returned.
    """
    report.unwritten = None
    report.artifacts.setdefault("report.txt", "report.txt")
    written: list[Path] = []
    try:
        for name, text in (("report.txt", lambda: render_text(report, report_dir)),
                           ("report.json", lambda: json.dumps(report.to_json(), indent=2) + "\n")):
            atomic_write(report_dir / name, text())
            written.append(report_dir / name)
    except OSError as exc:
        for path in written:
            try:
                path.unlink()
            except OSError:
                pass
        reason = exc.strerror or str(exc)
        report.unwritten = reason
        for name in ("report.txt", "report.json"):
            if report.artifacts.get(name) == name:
                del report.artifacts[name]
        sys.stderr.write(f"distcheck: error: could not write the report into {report_dir} ({reason}); "
                         "report.json follows on stderr\n")
        sys.stderr.write(json.dumps(report.to_json(), indent=2) + "\n")
        sys.stderr.flush()
        return None
    return report_dir / "report.json"


def load_report(report_dir: str | os.PathLike) -> Report:
    """Read and validate a report.json; anything that does not follow the contract is a UsageError naming the
    field, never a report that passes."""
    path = Path(report_dir) / "report.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist: pass a directory written by distcheck --report-dir") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    problem = contract_problem(data)
    if problem:
        raise UsageError(f"{path} is not a distcheck report: {problem} (re-run the distcheck command that writes it)")
    return Report.from_json(data)


def contract_problem(data: Any) -> str | None:
    """What makes ``data`` not a report.json of the contract (the first problem found), or None."""
    if not isinstance(data, dict):
        return f"the top level must be an object, not {type(data).__name__}"
    if data.get("tool") != "distcheck":
        return f"'tool' must be \"distcheck\", not {data.get('tool')!r}"
    types = {"version": str, "command": str, "ok": bool, "world_size": int, "findings": list, "checks": list,
             "artifacts": dict}
    for key, kind in types.items():
        if key not in data:
            return f"'{key}' is missing"
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"'{key}' must be {kind.__name__}, not {type(value).__name__}"
    for i, f in enumerate(data["findings"]):
        where = f"findings[{i}]"
        if not isinstance(f, dict):
            return f"{where} must be an object"
        if f.get("kind") not in KINDS:
            return f"{where}.kind {f.get('kind')!r} is not one of the contract's kinds"
        if not isinstance(f.get("ranks"), list) or not all(isinstance(r, int) for r in f["ranks"]):
            return f"{where}.ranks must be a list of integers"
        if not isinstance(f.get("message"), str) or not isinstance(f.get("detail", {}), dict):
            return f"{where} needs a string 'message' and an object 'detail'"
    for i, c in enumerate(data["checks"]):
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("ok"), bool)
                and isinstance(c.get("seconds"), (int, float))):
            return f"checks[{i}] must be an object with 'name' (string), 'ok' (boolean) and 'seconds' (number)"
    if data["ok"] and (data["findings"] or not all(c["ok"] for c in data["checks"])):
        return "'ok' is true although it holds findings or failed checks"
    if not data["ok"] and not data["findings"] and all(c["ok"] for c in data["checks"]):
        return "'ok' is false but no finding or failed check says why"
    return None
