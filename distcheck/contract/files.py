"""The files of a report directory: every name, and the format version the per-rank files carry.

    python -m distcheck run --nproc 2 --report-dir out -- train.py    # ranks write out/trace-rank0.jsonl, ...

Ranks write per-rank files as things happen (so a rank that dies keeps what it wrote); the supervisor and the
analysis read them. Both sides take the names from here, and every per-rank file carries ``FORMAT`` (the trace's
meta line, each record index line, the autocheck state), which the readers check with :func:`check_format`, as
Flight Recorder's ``check_version`` does: a report directory written by another distcheck version is named as
such instead of being misread.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any, Iterable

from distcheck.contract import trace_slots
from distcheck.errors import UsageError

# Bump when a per-rank file changes in a way an older reader would misread.
FORMAT = 3
FORMAT_KEY = "format"

REPORT_JSON = "report.json"
REPORT_TXT = "report.txt"
CHROME_TRACE = "trace.json"
STACKS_STEM = "stacks"  # stacks.txt / stacks.json
STACKS_TXT = STACKS_STEM + ".txt"
STACKS_JSON = STACKS_STEM + ".json"
# A rank's report handed to its node's watcher, which publishes it (contract/report_handoff.py): hidden, so never an
# artifact
REPORT_OFFERED = ".report-offered.json"
REPORT_CLAIMED = ".report-claimed.json"

_PER_RANK = {
    "trace": "trace-rank{rank}.jsonl",  # meta, call signatures, errors, exit line (contract/trace_lines.py)
    "trace_events": "trace-rank{rank}.bin",  # collective start/end records (contract/trace_slots.py)
    "findings": "findings-rank{rank}.jsonl",  # findings of API calls inside the script (contract/findings_file.py)
    "autocheck": "autocheck-rank{rank}.json",  # zero-code check state (contract/autocheck_file.py)
    "records_index": "records-rank{rank}.jsonl",  # distcheck.record index (contract/records_file.py)
    "records_data": "records-rank{rank}.bin",  # distcheck.record tensor bytes
    # compare's second look at the first divergent module: its whole local output or input gradient (torch.save)
    "module_capture": "module-capture-rank{rank}.pt",
    # torch's Flight Recorder ring with the rank's phases (rank/flight_recorder.py), and its progress counter
    "flight": "flight-rank{rank}.json",
    "flight_status": "flight-rank{rank}.status",
    "samples": "samples-rank{rank}.jsonl",  # where the main thread was, a few times a second (rank/sampler.py)
    "saves": "saves-rank{rank}.jsonl",  # each torch.save to a named file: path, content digest, line (saves_file.py)
    "faulthandler": "faulthandler-rank{rank}.txt",  # stack dump fallback (contract/stack_dump_file.py)
    "stderr": "stderr-rank{rank}.txt",  # the rank's stderr, bounded, for the failure reports (contract/stderr_file.py)
    # Every thread's stack, dumped by the rank itself when torchrun's agent passes on a stop signal.
    "stop_SIGTERM": "stop-rank{rank}-SIGTERM.txt",
    "stop_SIGINT": "stop-rank{rank}-SIGINT.txt",
    "stop_SIGHUP": "stop-rank{rank}-SIGHUP.txt",
}
STOP_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGHUP")
_RANK_OF = {kind: re.compile("^" + re.escape(pattern).replace(r"\{rank\}", r"(\d+)") + "$")
            for kind, pattern in _PER_RANK.items()}
# The names of the records distcheck makes by itself in zero-code compare (rank/autocheck.py, analysis/record_*.py).
AUTO_LOSS = "auto/loss"
AUTO_PARAMS = "auto/params"
AUTO_GRADS = "auto/grads"
AUTO_INIT = "auto/init"  # every parameter before the first optimizer.step(): where both runs start
STACK_HOOK = "stackhook-pid{pid}.json"  # per process: "this pid takes the faulthandler signal"
EXCHANGE = "exchange-{host}-{attempt}.json"  # a node's exchange address for an attempt (contract/exchange_file.py)
WATCHER = "watcher-{host}.json"  # a node watcher's state (contract/watcher_file.py)
# distcheck's files in a report directory that are neither per rank nor the report's: never torch's dumps
_SHARED_OF = tuple(re.compile("^" + re.escape(pattern).replace(r"\{pid\}", r"\d+").replace(r"\{attempt\}", r"\d+")
                              .replace(r"\{host\}", r".+") + "$") for pattern in (STACK_HOOK, EXCHANGE, WATCHER))
FLIGHT_REQUEST = "flight-request"  # touched by a supervisor: every live rank dumps its Flight Recorder ring


class FormatError(UsageError, ValueError):
    """A per-rank file written by a distcheck whose file format this one does not read."""


def is_rank_file(name: str) -> bool:
    """Whether a file name is one of distcheck's per-rank files (``flight-rank3.json``): never torch's own dump."""
    return any(pattern.match(name) for pattern in _RANK_OF.values())


def is_distcheck_file(name: str) -> bool:
    """Whether a file name is one distcheck writes into a report directory (a per-rank file, a stack-hook, exchange
    or watcher file: ``stackhook-pid4242.json``), so never torch's Flight Recorder dump of a rank."""
    return is_rank_file(name) or any(pattern.match(name) for pattern in _SHARED_OF)


def rank_file(report_dir: str | os.PathLike, kind: str, rank: int) -> Path:
    return Path(report_dir) / _PER_RANK[kind].format(rank=rank)


def rank_files(report_dir: str | os.PathLike, kind: str) -> dict[int, Path]:
    """``{rank: path}`` of the per-rank files of one kind present in ``report_dir``."""
    out: dict[int, Path] = {}
    pattern = _RANK_OF[kind]
    glob = _PER_RANK[kind].format(rank="*")
    for path in Path(report_dir).glob(glob):
        match = pattern.match(path.name)
        if match:
            out[int(match.group(1))] = path
    return dict(sorted(out.items()))


def rank_of(path: str | os.PathLike, kind: str) -> int:
    match = _RANK_OF[kind].match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a {_PER_RANK[kind].format(rank='<R>')} file")
    return int(match.group(1))


def hook_file(report_dir: str | os.PathLike, pid: int) -> Path:
    return Path(report_dir) / STACK_HOOK.format(pid=pid)


def hook_files(report_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(report_dir).glob(STACK_HOOK.format(pid="*")))


def remove_rank_files(report_dir: str | os.PathLike, ranks: Iterable[int],
                      kinds: Iterable[str] = ("trace", "trace_events", "findings", "autocheck", "stderr", "flight",
                                               "flight_status", "samples", "saves")) -> None:
    """Per-rank files are appended to: a reused report dir must not mix in an earlier run."""
    for rank in ranks:
        for kind in kinds:
            rank_file(report_dir, kind, rank).unlink(missing_ok=True)


_DUMP_KINDS = ("faulthandler", "stderr", *(f"stop_{s}" for s in STOP_SIGNAL_NAMES))


def remove_empty_rank_files(report_dir: str | os.PathLike, rank: int) -> None:
    """A rank's dump files that nothing was written to (no stack dump happened) are not artifacts."""
    for kind in _DUMP_KINDS:
        path = rank_file(report_dir, kind, rank)
        try:
            if path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass


ATTEMPT_DIR = "attempt-{attempt}"  # a torchrun restart's earlier attempt, kept apart (``--max-restarts``)
_ATTEMPT_OF = re.compile(r"^attempt-(\d+)$")


def attempt_dirs(report_dir: str | os.PathLike) -> dict[int, Path]:
    """``{attempt: dir}`` of the earlier attempts of a restarted torchrun job kept in ``report_dir``."""
    out = {}
    for path in Path(report_dir).glob("attempt-*"):
        match = _ATTEMPT_OF.match(path.name)
        if match and path.is_dir():
            out[int(match.group(1))] = path
    return dict(sorted(out.items()))


def archive_rank_files(report_dir: str | os.PathLike, rank: int, dest: Path) -> None:
    """Move every per-rank file of ``rank`` into ``dest`` (an earlier attempt's folder): a restarted rank starts its
    files afresh, and the earlier attempt's collectives never mix into this one's."""
    dest.mkdir(parents=True, exist_ok=True)
    for kind in _PER_RANK:
        path = rank_file(report_dir, kind, rank)
        try:
            path.replace(dest / path.name)
        except FileNotFoundError:
            pass


def archive_shared(report_dir: str | os.PathLike, dest: Path) -> None:
    """Move the earlier attempt's report, Chrome trace and stack dumps into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (REPORT_JSON, REPORT_TXT, CHROME_TRACE, STACKS_TXT, STACKS_JSON):
        try:
            (Path(report_dir) / name).replace(dest / name)
        except FileNotFoundError:
            pass


def clear_shared(report_dir: str | os.PathLike) -> None:
    """Before a run writes into a reused directory: the earlier run's report, Chrome trace and stack dumps go
    (a stale stacks.txt next to a new PASSED report would contradict it). Only distcheck's own files."""
    for name in (REPORT_JSON, REPORT_TXT, CHROME_TRACE, STACKS_TXT, STACKS_JSON, REPORT_OFFERED, REPORT_CLAIMED):
        (Path(report_dir) / name).unlink(missing_ok=True)


def tidy(report_dir: str | os.PathLike) -> None:
    """Once every rank has ended: the empty dump files of every rank and the stack-hook files (only meaningful
    while their process runs) go, and the unwritten tail of a killed rank's trace records is cut; what remains is
    the run's artifacts."""
    ranks = {r for kind in _DUMP_KINDS for r in rank_files(report_dir, kind)}
    for rank in ranks:
        remove_empty_rank_files(report_dir, rank)
    for path in hook_files(report_dir):
        path.unlink(missing_ok=True)
    for path in rank_files(report_dir, "flight_status").values():  # a progress counter, not an artifact
        path.unlink(missing_ok=True)
    # a rank killed while it rewrote its status (contract/atomic_file.py's temporary name)
    for path in Path(report_dir).glob(".flight-rank*.status.*.tmp"):
        path.unlink(missing_ok=True)
    try:
        (Path(report_dir) / FLIGHT_REQUEST).unlink(missing_ok=True)
    except OSError:  # the report dir was removed or replaced under the run: nothing of ours is left in it
        pass
    for path in rank_files(report_dir, "trace_events").values():
        trace_slots.truncate_unused(path)


def trace_progress(report_dir: str | os.PathLike, rank: int, hint: dict[str, int] | None = None) -> int:
    """A number that grows whenever the rank starts a collective, completes its latest one or writes a trace line:
    the watch loop's progress token. -1 before the rank has opened its trace. ``hint``: the caller's memo for this
    rank, kept between polls (trace_slots.progress): a poll then reads only past what the last one found."""
    try:
        size = rank_file(report_dir, "trace", rank).stat().st_size
    except OSError:
        return -1
    return (size + max(0, trace_slots.progress(rank_file(report_dir, "trace_events", rank), hint))
            + flight_progress(report_dir, rank))


def flight_progress(report_dir: str | os.PathLike, rank: int) -> int:
    """The rank's count of collectives the process group enqueued and completed, Python-called or not (DDP's
    buckets, compiled graphs): rank/flight_recorder.py rewrites it when it moves. 0 when unknown."""
    from distcheck.contract import flight_status_file

    return flight_status_file.read(rank_file(report_dir, "flight_status", rank)).progress


def check_format(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Raise FormatError when ``data`` (a meta line or state document) names a format other than ours.

    A file without the key predates versioning and has format 1.
    """
    found = data.get(FORMAT_KEY, 1)
    if found != FORMAT:
        raise FormatError(f"{path} has distcheck file format {found!r}, this distcheck reads format {FORMAT}: "
                          "read it with the distcheck version that wrote it")


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` (whole lines) to an O_APPEND file in one write, or nothing of it: what a refused write (a full
    disk) left of it is taken back, so the next lines that fit stay readable, and ENOSPC is raised. Every per-rank
    line file is written through this (trace lines, findings, the records' index)."""
    n = os.write(fd, data)
    if n < len(data):
        try:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - n))
        except OSError:
            pass
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
