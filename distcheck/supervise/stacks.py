"""Dump the Python stacks of running rank processes: py-spy in parallel, with a faulthandler fallback.

    python -m distcheck stacks PID [PID ...] [--native] [--json] [--report-dir DIR]

Nothing here runs inside the process being dumped, so a rank stuck in native code that holds the GIL is dumped
like any other: py-spy reads the interpreter's memory from outside (ptrace), and the faulthandler fallback is a
C-level signal handler that needs no GIL.

ptrace permission and the faulthandler fallback are set up inside each rank: see distcheck/rank/stack_hooks.py.
On a hang the processes the ranks started are dumped alongside them (``Target.role``; supervise/hang.py finds
them): py-spy with ``--locals`` there, which names a DataLoader worker's index.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from distcheck.analysis.progress import RankProgress
from distcheck.analysis.hang import progress_by_rank_json, progress_json
from distcheck.analysis.stack_groups import (
    FAULTHANDLER_MARKER, RankStack, StackGroup, group_stacks, own_frames, parse_faulthandler, parse_pyspy_json,
    process_role, render_all_threads, render_groups, render_processes, stacks_from_json, stacks_json,
)
from distcheck.contract.findings import format_ranks

from distcheck.contract import env as env_names
from distcheck.contract import stack_dump_file, stack_hook_file
from distcheck.contract.stack_hook_file import HookInfo
from distcheck.processes import alive, children_map, is_python, proc_name, read_environ, safe_environ, yama_scope
from distcheck.supervise.procs import rank_descendants

log = logging.getLogger("distcheck")

PYSPY_ENV = env_names.PYSPY  # path of the py-spy binary, when it is not next to python or on PATH
DEFAULT_DUMP_TIMEOUT = 8.0
PERMISSION_FIX = ("run distcheck as the same user as the job or as root; in a container add --cap-add SYS_PTRACE; "
                  "or allow ptrace with 'sysctl kernel.yama.ptrace_scope=0'")


@dataclass
class Target:
    """A process to dump, with its rank as read from its environment."""

    pid: int
    rank: int
    rank_source: str = "RANK"
    world_size: int | None = None
    report_dir: str | None = None  # DISTCHECK_REPORT_DIR of the process: where its faulthandler hook lives
    name: str = ""
    role: str = ""  # a process rank ``rank`` started ("child process" until its stack says more), not a rank


@dataclass
class DumpError:
    pid: int
    kind: str  # no_such_process | not_python | no_pyspy | permission | exited | timeout | failed
    message: str
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "rank": self.rank, "kind": self.kind, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DumpError:
        return cls(int(d.get("pid", 0)), str(d.get("kind", "failed")), str(d.get("message", "")), d.get("rank"))


@dataclass
class DumpResult:
    stacks: list[RankStack] = field(default_factory=list)
    errors: list[DumpError] = field(default_factory=list)
    seconds: float = 0.0


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def resolve_targets(pids: Sequence[int]) -> tuple[list[Target], list[DumpError]]:
    """Turn user-given pids (rank processes or torchrun agents) into rank targets, plus one error per bad pid."""
    targets: list[Target] = []
    errors: list[DumpError] = []
    seen: set[int] = set()
    children = None
    for pid in pids:
        if not Path(f"/proc/{pid}").exists() or not alive(pid):
            errors.append(DumpError(pid, "no_such_process", f"pid {pid}: no such process (it is not running)"))
            continue
        try:
            env = read_environ(pid)
        except PermissionError:
            errors.append(DumpError(pid, "permission", f"pid {pid} ({proc_name(pid)}): permission denied reading "
                                                       f"its environment: {PERMISSION_FIX}"))
            continue
        except OSError:
            errors.append(DumpError(pid, "no_such_process", f"pid {pid}: no such process (it exited)"))
            continue
        if "RANK" in env:
            pids_here = [pid]
        else:
            children = children_map() if children is None else children
            pids_here = rank_descendants(pid, children) or [pid]
        for p in pids_here:
            if p in seen:
                continue
            seen.add(p)
            penv = env if p == pid else safe_environ(p)
            python = is_python(p)
            if python is False:
                errors.append(DumpError(p, "not_python", f"pid {p} ({proc_name(p)}) is not a Python process: "
                                                         "pass the pid of a rank or of its torchrun agent"))
                continue
            rank, source = _int(penv.get("RANK")), "RANK"
            if rank is None:
                rank, source = _int(penv.get("LOCAL_RANK")), "LOCAL_RANK"
            targets.append(Target(p, rank if rank is not None else -1, source if rank is not None else "argument order",
                                  _int(penv.get("WORLD_SIZE")), penv.get(env_names.REPORT_DIR), proc_name(p)))
    # Processes without a rank get numbers after the known ranks, in the order given, so grouping still works.
    used = {t.rank for t in targets if t.rank >= 0}
    next_rank = max(used, default=-1) + 1
    for t in targets:
        if t.rank < 0 or (t.rank_source == "LOCAL_RANK" and sum(u.rank == t.rank for u in targets) > 1):
            while next_rank in used:
                next_rank += 1
            t.rank, t.rank_source = next_rank, "argument order"
            used.add(next_rank)
    return sorted(targets, key=lambda t: t.rank), errors


# --- py-spy -----------------------------------------------------------------------------------------------------


def find_pyspy() -> str | None:
    """py-spy from $DISTCHECK_PYSPY, next to this Python (a venv's bin is often not on PATH), or PATH."""
    override = os.environ.get(PYSPY_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def permission_message(pid: int) -> str:
    scope = yama_scope()
    where = f" (kernel.yama.ptrace_scope is {scope} here)" if scope not in (None, "0") else ""
    return f"pid {pid} ({proc_name(pid)}): permission denied to read its stack{where}: {PERMISSION_FIX}"


def classify_pyspy_failure(pid: int, stderr: str) -> DumpError:
    """A py-spy failure as one actionable line; py-spy's own message is a Rust backtrace."""
    text = stderr.lower()
    if not alive(pid):
        return DumpError(pid, "exited", f"pid {pid} exited during the dump")
    if "permission denied" in text or "operation not permitted" in text or "os error 1)" in text:
        return DumpError(pid, "permission", permission_message(pid))
    if "failed to find python version" in text or "failed to find a python interpreter" in text:
        return DumpError(pid, "not_python", f"pid {pid} ({proc_name(pid)}) is not a Python process "
                                            "(py-spy found no interpreter in it)")
    first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "no output")
    return DumpError(pid, "failed", f"pid {pid}: py-spy failed: {first[:200]}")


def pyspy_dump(target: Target, pyspy: str, native: bool = False, timeout: float = DEFAULT_DUMP_TIMEOUT,
               host: str | None = None) -> RankStack | DumpError:
    # A process a rank started: --locals says which DataLoader worker it is (worker_id in _worker_loop).
    cmd = ([pyspy, "dump", "--pid", str(target.pid), "--json"] + (["--native"] if native else [])
           + (["--locals"] if target.role else []))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return DumpError(target.pid, "timeout", f"pid {target.pid}: py-spy did not finish within {timeout:g}s",
                         target.rank)
    except OSError as exc:
        return DumpError(target.pid, "no_pyspy", f"py-spy could not be started ({exc.strerror}): "
                                                 "pip install py-spy, or set DISTCHECK_PYSPY to its path", target.rank)
    if proc.returncode != 0:
        err = classify_pyspy_failure(target.pid, proc.stderr)
        err.rank = target.rank
        return err
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        return DumpError(target.pid, "failed", f"pid {target.pid}: py-spy printed no JSON", target.rank)
    stack = RankStack(target.rank, target.pid, host or socket.gethostname(),
                      "py-spy --native" if native else "py-spy", parse_pyspy_json(data, target.pid),
                      target.rank_source, target.world_size)
    if target.role:
        for thread in stack.threads:  # a forked process's frames outside its own start are its parent's
            thread.frames = own_frames(thread.frames)
        stack.role = process_role(stack)
    return stack


# --- faulthandler fallback and in-rank hooks -------------------------------------------------------------------


def faulthandler_dump(target: Target, hook: HookInfo, timeout: float = 3.0,
                      host: str | None = None) -> RankStack | DumpError:
    """Signal the process and read the dump its faulthandler hook writes after our marker line."""
    path = Path(hook.file)
    marker = f"{FAULTHANDLER_MARKER} pid {target.pid} t={time.time():.6f} ===\n"
    try:
        stack_dump_file.mark(path, marker)
        os.kill(target.pid, hook.signal)
    except ProcessLookupError:
        return DumpError(target.pid, "exited", f"pid {target.pid} exited during the dump", target.rank)
    except PermissionError:
        return DumpError(target.pid, "permission", f"pid {target.pid}: not allowed to signal it for a faulthandler "
                                                   f"dump: {PERMISSION_FIX}", target.rank)
    except OSError as exc:
        return DumpError(target.pid, "failed", f"pid {target.pid}: faulthandler fallback failed: {exc}", target.rank)
    deadline = time.monotonic() + timeout
    last_size, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        tail = stack_dump_file.after_mark(path, marker)
        size = len(tail)
        if size > len(marker) and size == last_size and time.monotonic() - stable_since > 0.1:
            threads = parse_faulthandler(tail)
            if threads:
                return RankStack(target.rank, target.pid, host or socket.gethostname(), "faulthandler", threads,
                                 target.rank_source, target.world_size)
        if size != last_size:
            last_size, stable_since = size, time.monotonic()
        if not alive(target.pid):
            return DumpError(target.pid, "exited", f"pid {target.pid} exited during the dump", target.rank)
        time.sleep(0.02)
    return DumpError(target.pid, "timeout", f"pid {target.pid}: no faulthandler dump within {timeout:g}s",
                     target.rank)


# --- all ranks at once ------------------------------------------------------------------------------------------


def dump_one(target: Target, native: bool = False, timeout: float = DEFAULT_DUMP_TIMEOUT,
             report_dirs: Sequence[str | os.PathLike | None] = (), pyspy: str | None = None) -> RankStack | DumpError:
    """py-spy first; faulthandler when py-spy is missing or denied and the process installed the hook."""
    first: DumpError | None = None
    if target.role and not pyspy:  # no faulthandler hook in a process a rank started
        return DumpError(target.pid, "no_pyspy", "py-spy is not installed", target.rank)
    if pyspy:
        out = pyspy_dump(target, pyspy, native, timeout)
        if isinstance(out, RankStack):
            return out
        first = out
        if out.kind not in ("permission", "no_pyspy", "timeout", "failed"):
            return out
    else:
        first = DumpError(target.pid, "no_pyspy", "py-spy is not installed: pip install py-spy "
                                                  "(or set DISTCHECK_PYSPY to its path)", target.rank)
    hook = stack_hook_file.read([*report_dirs, target.report_dir], target.pid)
    if hook is None:
        return first
    out = faulthandler_dump(target, hook, timeout=min(timeout, 5.0))
    if isinstance(out, RankStack):
        out.note = f"fallback: {first.message}"
        return out
    return DumpError(target.pid, first.kind, f"{first.message}; faulthandler fallback: {out.message}", target.rank)


def dump_all(targets: Sequence[Target], native: bool = False, timeout: float = DEFAULT_DUMP_TIMEOUT,
             report_dirs: Sequence[str | os.PathLike | None] = ()) -> DumpResult:
    """Dump every target in parallel (one py-spy per process); each dump is bounded by ``timeout``."""
    t0 = time.monotonic()
    result = DumpResult()
    if not targets:
        return result
    pyspy = find_pyspy()
    with ThreadPoolExecutor(max_workers=min(64, len(targets)), thread_name_prefix="distcheck-dump") as pool:
        outs = list(pool.map(lambda t: dump_one(t, native, timeout, report_dirs, pyspy), targets))
    for out in outs:
        (result.stacks if isinstance(out, RankStack) else result.errors).append(out)
    result.seconds = time.monotonic() - t0
    return result


# --- artifacts --------------------------------------------------------------------------------------------------

STACKS_FORMAT = "distcheck-stacks/1"


def stacks_document(stacks: Sequence[RankStack], errors: Sequence[DumpError], native: bool,
                    progress: dict[int, RankProgress] | None = None, hosts: Sequence[str] | None = None,
                    groups: Sequence[StackGroup] | None = None, summary: str = "",
                    processes: Sequence[RankStack] = (),
                    progress_doc: dict[str, Any] | None = None, title: str = "") -> dict[str, Any]:
    """The JSON form (stacks.json): one document per node; ``distcheck report`` merges several. ``processes``:
    the dumped processes the ranks started (each with its rank and role); ``title``: stacks.txt's first line.

    Up to SMALL_WORLD ranks each entry of ``ranks`` holds its threads. Above, each distinct stack is stored once in
    ``stacks`` (``{"ranks": "0-4093,4095", "count", "threads"}``) and each rank's entry points at it (``stack``,
    ``thread_ids``); ``last_collectives`` keys ranks with the same progress by their rank ranges
    (analysis/hang.progress_json; ``progress_doc``: that map, when the caller made it already for the finding).
    :func:`load_stacks_document` reads both forms.
    """
    groups = list(groups) if groups is not None else group_stacks(stacks)
    ws = [s.world_size for s in stacks if s.world_size]
    ranks, distinct = stacks_json(sorted(stacks, key=lambda s: s.rank))
    extra: dict[str, Any] = {}
    if processes:
        procs, proc_distinct = stacks_json(sorted(processes, key=lambda p: (p.rank, p.pid)))
        extra["processes"] = procs
        if proc_distinct:
            extra["process_stacks"] = proc_distinct
    if distinct:
        extra["stacks"] = distinct
    return {**extra,
        "tool": "distcheck",
        "format": STACKS_FORMAT,
        "hosts": sorted(set(hosts or [s.host for s in stacks] or [socket.gethostname()])),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "native": native,
        "world_size": max(ws) if ws else None,
        "ranks": ranks,
        "errors": [e.to_json() for e in errors],
        "groups": [g.to_json() for g in groups],
        "last_collectives": progress_doc if progress_doc is not None else progress_json(progress),
        "summary": summary,
        "title": title,
    }


def progress_line(rank: int, p: RankProgress) -> str:
    """``rank 1: last started all_reduce #3 (t.py:3); last completed all_reduce #3 (t.py:3); waits in all_reduce
    #2 (t.py:2) PENDING``: the rank's line of stacks.txt, from its progress (analysis/progress.py). The collective
    it waits in is named when it is not the last one started (an async op pending behind later ones)."""
    return f"rank {rank}: {_progress_text(p)}"


def _progress_text(p: RankProgress) -> str:
    started = p.last_started.text() if p.last_started else "none"
    completed = p.last_completed.text() if p.last_completed else "none"
    line = f"last started {started}; last completed {completed}"
    pending = p.pending
    if pending is not None and pending != p.last_started:
        line += f"; waits in {pending.text()}"
    return line


def progress_lines(progress: dict[int, RankProgress]) -> list[str]:
    """stacks.txt's last collectives: one line per distinct progress, naming its ranks (``ranks 0-4093,4095: last
    started ...``; a rank alone reads as :func:`progress_line`)."""
    by_text: dict[str, list[int]] = {}
    for r, p in sorted(progress.items()):
        by_text.setdefault(_progress_text(p), []).append(r)
    return [f"{format_ranks(ranks)}: {text}" for text, ranks in sorted(by_text.items(), key=lambda i: i[1][0])]


def render_stacks_text(stacks: Sequence[RankStack], errors: Sequence[DumpError], title: str = "",
                       progress: dict[int, RankProgress] | None = None, groups: Sequence[StackGroup] | None = None,
                       summary: str = "", processes: Sequence[RankStack] = (),
                       other_processes: Sequence[str] = ()) -> str:
    """stacks.txt: the summary (:func:`render_stacks_summary`), then every thread uncollapsed."""
    return (render_stacks_summary(stacks, errors, title, progress, groups, summary, processes, other_processes)
            + "\nall threads, uncollapsed:\n" + render_all_threads([*stacks, *processes]))


def render_stacks_summary(stacks: Sequence[RankStack], errors: Sequence[DumpError], title: str = "",
                          progress: dict[int, RankProgress] | None = None, groups: Sequence[StackGroup] | None = None,
                          summary: str = "", processes: Sequence[RankStack] = (),
                          other_processes: Sequence[str] = ()) -> str:
    """What a console shows of a hang's stacks: the diagnosis, the groups of ranks with their collapsed stacks, the
    processes the ranks started, and each rank's last collectives."""
    groups = list(groups) if groups is not None else group_stacks(stacks)
    if summary:
        title = f"{title}\ndiagnosis: {summary}" if title else f"diagnosis: {summary}"
    text = render_groups(groups, list(stacks), [e.message for e in errors], title)
    text += render_processes(list(processes), list(other_processes))
    if progress:
        lines = ["", "last collectives (from the trace):"]
        lines += [f"  {line}" for line in progress_lines(progress)]
        text += "\n".join(lines) + "\n"
    return text


def summary_of_document(path: str | os.PathLike) -> str:
    """:func:`render_stacks_summary` of a ``stacks.json`` (its structure, not stacks.txt's text): the groups the
    diagnosis singled out keep their highlight."""
    stacks, errors, doc = load_stacks_document(path)
    progress = {int(r): RankProgress.from_json(int(r), p) for r, p in doc.get("last_collectives", {}).items()}
    processes = stacks_from_json(doc.get("processes", []), doc.get("process_stacks", []))
    groups = group_stacks(stacks)
    singled_out = {tuple(g["ranks"]): bool(g.get("minority")) for g in doc.get("groups", [])}
    for g in groups:
        g.minority = singled_out.get(tuple(g.ranks), g.minority)
    return render_stacks_summary(stacks, errors, doc.get("title", ""), progress, groups, doc.get("summary", ""),
                                 processes)


def document_text(doc: dict[str, Any]) -> str:
    """stacks.json's text: one top-level key a line, each item of a list on a line of its own (a rank's entry, a
    distinct stack), so that a 4096-rank file reads line by line without indenting every number of it."""
    def compact(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    lines = []
    for key, value in doc.items():
        if isinstance(value, list) and value:
            body = ",\n".join(f"  {compact(item)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_stack_artifacts(report_dir: str | os.PathLike, stacks: Sequence[RankStack], errors: Sequence[DumpError],
                          native: bool = False, progress: dict[int, RankProgress] | None = None,
                          title: str = "", stem: str = "stacks", groups: Sequence[StackGroup] | None = None,
                          summary: str = "", processes: Sequence[RankStack] = (),
                          other_processes: Sequence[str] = (),
                          progress_doc: dict[str, Any] | None = None) -> dict[str, str]:
    """Write ``<stem>.txt`` and ``<stem>.json``; returns report.json artifact entries (relative paths).

    ``groups``/``summary`` come from the hang diagnosis, so the highlighted groups are the ranks it singled out.
    ``processes``: the processes the ranks started, dumped with them; ``other_processes``: one line for each that
    is not Python.
    """
    from distcheck.contract.report import atomic_write

    report_dir = Path(report_dir)
    atomic_write(report_dir / f"{stem}.txt", render_stacks_text(stacks, errors, title, progress, groups, summary,
                                                                processes, other_processes))
    atomic_write(report_dir / f"{stem}.json",
                 document_text(stacks_document(stacks, errors, native, progress, None, groups, summary, processes,
                                               progress_doc, title)))
    return {f"{stem}.txt": f"{stem}.txt", f"{stem}.json": f"{stem}.json"}


def load_stacks_document(path: str | os.PathLike) -> tuple[list[RankStack], list[DumpError], dict[str, Any]]:
    """The ranks' stacks, the dump errors and the document of a stacks.json, in either form; the document's
    ``last_collectives`` come back keyed by rank (one key per rank, values shared by the ranks of one entry)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != STACKS_FORMAT:
        raise ValueError(f"{path} is not a distcheck stacks dump (format {data.get('format')!r})")
    data["last_collectives"] = {str(r): p for r, p in progress_by_rank_json(data.get("last_collectives")).items()}
    return (stacks_from_json(data.get("ranks", []), data.get("stacks", [])),
            [DumpError.from_json(e) for e in data.get("errors", [])], data)
