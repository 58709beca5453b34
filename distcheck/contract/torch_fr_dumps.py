"""torch's own Flight Recorder dumps of a job distcheck never saw: finding the files and reading each one's ring.

    TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_ torchrun ... train.py     # NCCL's watchdog dumps every rank on a timeout
    python -m distcheck report /shared/fr/                             # the folder
    python -m distcheck report /shared/fr/rank_                        # or the prefix

**The files.** torch's ``DebugInfoWriter`` writes one file per rank, the prefix (``TORCH_FR_DUMP_TEMP_FILE``, older
name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``~/.cache/torch/comm_lib_trace_rank_``) followed by the global
rank, nothing else. :func:`find` takes a folder (every file named ``<prefix><rank>``, with an optional ``.json`` or
``.pkl``, whose first byte is a pickle's or a JSON object's; subfolders too, e.g. one per node) or a prefix
(``dumps/rank_``), and the rank always comes from the name, as torch's analyzer takes it. Several prefixes in one
folder are one job when their ranks do not overlap (``nodeA_rank_0..7``, ``nodeB_rank_8..15``); when they overlap
the folder is ambiguous and the command says which prefix to pass.

**The formats.** The pickle torch writes (``_dump_fr_trace`` for c10d's ring (gloo), ``_dump_nccl_trace`` for
NCCL's, the watchdog's dump) and the JSON of ``_dump_fr_trace_json`` / ``_dump_nccl_trace_json`` (also what each
worker of the ``torch.distributed.debug`` server answers on ``/handler/fr_trace_json`` and
``/handler/dump_nccl_trace_json``, saved one file per rank). The debug server's own periodic files
(``fr_trace_<timestamp>.txt``) hold torch's analyzer's tables, not the rings: :func:`find` names them and the fix.
A pickle is read with globals refused (a dump holds dicts, lists, strings and numbers only; anything else is a
file that is not a dump, never code that runs).

**One rank's ring as columns.** :class:`TorchRing` holds the entries as numpy columns, one row per entry: the
numbers (``record_id``, ``collective_seq_id``, the times, ...), two flags (``retired``, ``is_p2p``) and, for the
fields whose values repeat (op name, state, group, frames, sizes, dtypes), an index into that column's table of
distinct values. A 20,000-entry ring holds a few hundred distinct values: the analysis (analysis/fr_postmortem.py)
compares ids, never dicts, so 4,096 rings fit in memory one at a time. The C scanner (``_frscan.c``, built by
setup.py where a compiler is) makes the columns straight from the pickle's bytes without building the entries
(about 6 ms for a 20,000-entry ring, where unpickling it takes 0.2 s), and also reads what a truncated pickle holds
before its cut; without it (or for JSON) the document is loaded whole and turned into the same columns
(:func:`ring_from_document`, about 0.7 s for 20,000 entries).

A file that cannot be read (empty, cut off, not a dump) is a :class:`Unreadable`, named in the report, never fatal.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from distcheck.contract import files
from distcheck.errors import UsageError

try:  # the scanner in C, built by setup.py where a C compiler is there (see the module docstring)
    from distcheck.contract import _frscan
except ImportError:  # not built: every file is loaded whole (same columns, slower)
    _frscan = None

# Numbers of an entry (0 where a dump has none: a time not yet discovered is None in a pickle, 0 in JSON).
INT_COLUMNS = ("record_id", "pg_id", "collective_seq_id", "p2p_seq_id", "op_id", "time_created_ns",
               "time_discovered_started_ns", "time_discovered_completed_ns", "timeout_ms")
FLAG_COLUMNS = ("retired", "is_p2p")  # 1, 0, or -1 where the dump does not say
# Fields whose values repeat: each row holds an index into the column's table of distinct values (-1: absent).
VALUE_COLUMNS = ("profiling_name", "state", "process_group", "frames", "input_sizes", "output_sizes",
                 "input_dtypes", "output_dtypes")
ABSENT = {"record_id": -1, "pg_id": -1, "collective_seq_id": -1, "p2p_seq_id": -1, "op_id": -1}  # others: 0
# A row's combination: what the analysis needs of it at once (op, group, sizes, dtypes), as ids of these columns.
COMBO_COLUMNS = ("profiling_name", "process_group", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes")

# <prefix><rank>, as DebugInfoWriter names a dump, with the extension a user may give a saved JSON answer.
DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
DEBUG_SERVER_TABLE = re.compile(r"^fr_trace(_nccl)?_\d{8}_\d{6}\.txt$")
PICKLE_START, JSON_START = b"\x80", b"{"
DEFAULT_PREFIX = "~/.cache/torch/comm_lib_trace_rank_"


@dataclass(frozen=True)
class DumpFile:
    rank: int
    path: Path


@dataclass
class DumpSet:
    """The dumps of one job: one file per rank (the newest where a rank has two), and what was passed over."""

    target: str
    files: list[DumpFile]
    prefixes: list[str]  # the file-name prefixes read (one per node folder or host where names carry the host)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why): a second dump of a rank, ...


@dataclass
class TorchRing:
    """One rank's dump as columns (see the module docstring)."""

    rank: int
    path: str
    fmt: str  # "pickle" or "json"
    version: str
    pg_config: dict[str, Any]
    pg_status: dict[str, dict[str, int]]  # str(pg_id) -> {"last_enqueued_collective": n, ...}
    dumped_ns: int  # when the file was written (its mtime): a timeout is measured to it
    rows: int
    ints: dict[str, np.ndarray]  # INT_COLUMNS, int64
    flags: dict[str, np.ndarray]  # FLAG_COLUMNS, int8
    ids: dict[str, np.ndarray]  # VALUE_COLUMNS, int32 indices into values[column]
    values: dict[str, list[Any]]  # VALUE_COLUMNS -> distinct values, normalized (tuples, str, ints)
    problem: str = ""  # read with a problem (a pickle cut off after some entries): named in the report
    size: int = 0
    cut: bool = False  # the file ends before the document does: its newest entries are missing
    # Each row's combination (int32, an index into combos: tuples of COMBO_COLUMNS ids; -1: none): a ring holds a
    # few dozen, so the analysis works per combination, not per row.
    combo: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    combos: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class Unreadable:
    rank: int
    path: str
    reason: str


# --- finding the files ------------------------------------------------------------------------------------------


def looks_like_dumps(target: str | os.PathLike) -> bool:
    """Whether ``target`` is a folder or prefix of Flight Recorder dumps rather than a distcheck report directory
    (which holds report.json, or node folders that do)."""
    path = Path(target)
    if path.is_dir():
        # A report directory: its own report, or (on a node that is not node 0) its node folder's.
        if (path / files.REPORT_JSON).exists() or any(path.glob("node-*/" + files.REPORT_JSON)):
            return False
        try:
            return bool(_candidates(path))
        except OSError:
            return False
    return path.parent.is_dir() and bool(_prefix_files(path.parent, path.name))


def _first_byte(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError:
        return b""
    return head[:1]


def _walk(root: Path) -> Iterator[Path]:
    """Every file below ``root``, skipping hidden entries and distcheck's own report folders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not d.startswith("distcheck-report-")
                             and not (Path(dirpath) / d / "report.json").exists())
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def _candidates(root: Path) -> dict[tuple[str, str], list[DumpFile]]:
    """(folder, prefix) -> the files named <prefix><rank> there, for the prefixes at least one of whose files
    starts as a pickle or a JSON object does (a folder may hold logs named like train1.log: not dumps)."""
    groups: dict[tuple[str, str], list[DumpFile]] = {}
    dumps: set[tuple[str, str]] = set()
    for path in _walk(root):
        m = DUMP_NAME.match(path.name)
        if not m or files.is_distcheck_file(path.name):  # distcheck's own (flight-rank3.json, stackhook-pid42.json)
            continue
        key = (str(path.parent), m["prefix"])
        groups.setdefault(key, []).append(DumpFile(int(m["rank"]), path))
        if key not in dumps and _first_byte(path) in (PICKLE_START, JSON_START):
            dumps.add(key)
    return {k: v for k, v in groups.items() if k in dumps}


def _prefix_files(folder: Path, prefix: str) -> list[DumpFile]:
    out = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    for name in names:
        if name.startswith(prefix):
            m = re.fullmatch(r"(\d+)(\.json|\.pkl|\.pickle)?", name[len(prefix):])
            if m and (folder / name).is_file():
                out.append(DumpFile(int(m[1]), folder / name))
    return out


def find(target: str | os.PathLike) -> DumpSet:
    """The dumps of ``target`` (a folder or a prefix), or UsageError naming what is wrong and the fix."""
    path = Path(target)
    if path.is_dir():
        groups = _candidates(path)
        if not groups:
            tables = [p for p in _walk(path) if DEBUG_SERVER_TABLE.match(p.name)]
            if tables:
                raise UsageError(
                    f"{tables[0]} is a table of the torch.distributed.debug server (torch's own analysis), not the "
                    "Flight Recorder rings: save each worker's /handler/fr_trace_json (or /handler/"
                    "dump_nccl_trace_json) answer as rank<R>.json in one folder and pass that folder")
            raise UsageError(
                f"{str(target)!r} holds neither report.json nor Flight Recorder dumps (files named <prefix><rank>, "
                "as TORCH_FR_DUMP_TEMP_FILE names them): pass a directory written by distcheck --report-dir, or the "
                "folder or file prefix of torch's dumps (e.g. dumps/rank_)")
        return _one_job(str(target), groups)
    if not path.parent.is_dir():
        raise UsageError(f"{str(target)!r} is neither a directory nor a prefix of files in an existing directory: "
                         "pass a report directory, or the folder or file prefix of torch's Flight Recorder dumps")
    files = _prefix_files(path.parent, path.name)
    if not files:
        raise UsageError(f"no file is named {str(target)!r} followed by a rank: pass the prefix TORCH_FR_DUMP_TEMP_FILE "
                         "was set to (e.g. dumps/rank_), or the folder of the dumps")
    return _one_job(str(target), {(str(path.parent), path.name): files})


def _one_job(target: str, groups: dict[tuple[str, str], list[DumpFile]]) -> DumpSet:
    """One file per rank across the prefixes; prefixes whose ranks overlap are two jobs (or two dumps of one):
    ambiguous, so the command asks for one."""
    by_rank: dict[int, list[DumpFile]] = {}
    owner: dict[int, tuple[str, str]] = {}
    for key, files in sorted(groups.items()):
        ranks = {f.rank for f in files}
        clash = sorted(r for r in ranks if r in owner and owner[r][1] != key[1])
        if clash:
            other = owner[clash[0]]
            raise UsageError(
                f"{target!r} holds dumps of the same ranks under two prefixes ({os.path.join(*other)} and "
                f"{os.path.join(*key)}, rank {clash[0]} in both): pass one prefix, e.g. "
                f"{os.path.join(*key)}")
        for f in files:
            by_rank.setdefault(f.rank, []).append(f)
            owner[f.rank] = key
    chosen, skipped = [], []
    for rank in sorted(by_rank):
        files = sorted(by_rank[rank], key=lambda f: (_mtime(f.path), str(f.path)))
        chosen.append(files[-1])
        for f in files[:-1]:
            skipped.append((str(f.path), f"rank {rank} has a newer dump, {files[-1].path.name}: that one was read"))
    return DumpSet(target, chosen, sorted({os.path.join(*k) for k in groups}), skipped)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


# --- reading one file -------------------------------------------------------------------------------------------


class _DataOnly(pickle.Unpickler):
    """A dump holds plain data: a pickle that names a class or function is not a dump (and must not run)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a Flight Recorder dump never does")


_local = threading.local()  # each reading thread's buffer, reused file after file (no fresh pages per file)


def _read_into_buffer(path: Path) -> tuple[memoryview, int]:
    with open(path, "rb", buffering=0) as fh:
        st = os.fstat(fh.fileno())
        buf = getattr(_local, "buf", None)
        if buf is None or len(buf) < st.st_size + 1:
            buf = _local.buf = bytearray(max(st.st_size + 1, int(len(buf or b"") * 1.25)))
        view = memoryview(buf)
        n = 0
        while n < len(view):  # a file still growing reads to what is there
            got = fh.readinto(view[n:])
            if not got:
                break
            n += got
    return view[:n], st.st_mtime_ns


def read(dump: DumpFile, fast: bool = True) -> TorchRing | Unreadable:
    """One rank's ring, or why it cannot be read. ``fast=False`` leaves the C scanner out (the tests compare)."""
    try:
        data, mtime = _read_into_buffer(dump.path)
    except OSError as exc:
        return Unreadable(dump.rank, str(dump.path), f"cannot be read ({exc.strerror or exc})")
    return parse(data, dump.rank, str(dump.path), mtime, fast)


def parse(data: bytes | memoryview, rank: int, path: str, mtime: int = 0, fast: bool = True
          ) -> TorchRing | Unreadable:
    head = bytes(data[:64]).lstrip()[:1]
    if not head and not bytes(data).strip():
        return Unreadable(rank, path, "is empty (the dump was cut off before anything was written)")
    if head == JSON_START:
        try:
            doc = json.loads(bytes(data))
        except ValueError as exc:
            return Unreadable(rank, path, f"is not valid JSON ({exc}): a cut-off or partial dump")
        return _from_doc(doc, rank, path, "json", mtime, len(data))
    if head != PICKLE_START:
        return Unreadable(rank, path, "is neither a pickle nor JSON: not a Flight Recorder dump")
    scanned = _scan(data, rank, path, mtime) if fast and _frscan is not None else None
    if isinstance(scanned, Unreadable) or scanned is not None and not scanned.problem:
        return scanned
    try:
        doc = _DataOnly(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, MemoryError,
            AttributeError, OverflowError) as exc:
        if scanned is not None and scanned.rows:
            return scanned  # cut off: the entries before the cut, which only the scanner reads
        return Unreadable(rank, path, f"is not a readable pickle ({type(exc).__name__}: {exc}): a cut-off or "
                                      "partial dump")
    return _from_doc(doc, rank, path, "pickle", mtime, len(data))


def _from_doc(doc: Any, rank: int, path: str, fmt: str, mtime: int, size: int) -> TorchRing | Unreadable:
    if not isinstance(doc, dict) or not isinstance(doc.get("entries", []), list):
        return Unreadable(rank, path, "is not a Flight Recorder dump (no list of entries)")
    if "entries" not in doc and "pg_status" not in doc:
        return Unreadable(rank, path, "is not a Flight Recorder dump (no entries, no pg_status)")
    return ring_from_document(doc, rank, path, fmt, mtime, size)


def _meta(doc: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, dict[str, int]]]:
    config = doc.get("pg_config") if isinstance(doc.get("pg_config"), dict) else {}
    status: dict[str, dict[str, int]] = {}
    for key, s in (doc.get("pg_status") or {}).items() if isinstance(doc.get("pg_status"), dict) else ():
        if isinstance(s, dict):
            status[str(key)] = {str(k): _int(v, -1) for k, v in s.items()}
    return str(doc.get("version", "")), {str(k): v for k, v in config.items() if isinstance(v, dict)}, status


def _int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return int(value)  # JSON's pg_status holds "7"
    except (TypeError, ValueError):
        return default


def normalize(column: str, value: Any) -> Any:
    """A field's value in the form every reader gives it (pickle and JSON alike): hashable, comparable."""
    if column == "frames":
        out = []
        for f in value if isinstance(value, (list, tuple)) else ():
            if isinstance(f, dict):
                out.append((str(f.get("filename") or ""), _int(f.get("line"), 0), str(f.get("name") or "")))
        return tuple(out)
    if column == "process_group":
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value[:2]) + (("",) if len(value) < 2 else ())
        return (str(value), "")
    if column in ("profiling_name", "state"):
        return value if isinstance(value, str) else str(value)
    return _tupled(value)


def _tupled(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_tupled(v) for v in value)
    if isinstance(value, dict):
        return tuple((str(k), _tupled(v)) for k, v in value.items())
    return value


def ring_from_document(doc: dict[str, Any], rank: int, path: str, fmt: str = "pickle", mtime: int = 0,
                       size: int = 0) -> TorchRing:
    """The columns of a loaded dump (the path without the C scanner, and JSON's). A loaded pickle shares what
    torch memoized (op names, states, frame dicts): each distinct object is normalized once."""
    entries = [e for e in doc.get("entries") or [] if isinstance(e, dict)]
    n = len(entries)
    ints = {c: [ABSENT.get(c, 0)] * n for c in INT_COLUMNS}
    flags = {c: [-1] * n for c in FLAG_COLUMNS}
    ids = {c: [-1] * n for c in VALUE_COLUMNS}
    values: dict[str, list[Any]] = {c: [] for c in VALUE_COLUMNS}
    index: dict[str, dict[Any, int]] = {c: {} for c in VALUE_COLUMNS}
    seen: dict[str, dict[Any, int]] = {c: {} for c in VALUE_COLUMNS}  # the raw object's identity -> id
    for i, e in enumerate(entries):
        for c in INT_COLUMNS:
            v = e.get(c)
            if v is not None and not isinstance(v, float):
                ints[c][i] = v if type(v) is int else _int(v, ABSENT.get(c, 0))
        for c in FLAG_COLUMNS:
            v = e.get(c)
            if isinstance(v, (bool, int)):
                flags[c][i] = 1 if v else 0
        for c in VALUE_COLUMNS:
            raw = e.get(c, _MISSING)
            if raw is _MISSING:
                continue
            # a frames list is new in every entry, its frame dicts are torch's shared ones
            key = tuple(map(id, raw)) if c == "frames" and isinstance(raw, list) else id(raw)
            k = seen[c].get(key)
            if k is None:
                v = normalize(c, raw)
                k = index[c].get(v)
                if k is None:
                    k = index[c][v] = len(values[c])
                    values[c].append(v)
                if c != "frames" or isinstance(raw, list):
                    seen[c][key] = k
            ids[c][i] = k
    version, config, status = _meta(doc)
    ints_a = {c: np.array(v, np.int64) for c, v in ints.items()}
    flags_a = {c: np.array(v, np.int8) for c, v in flags.items()}
    ids_a = {c: np.array(v, np.int32) for c, v in ids.items()}
    combo, combos = _combos(ids_a, n)
    return TorchRing(rank, path, fmt, version, config, status, mtime, n, ints_a, flags_a, ids_a, values, size=size,
                     combo=combo, combos=combos)


_MISSING = object()


def _combos(ids: dict[str, np.ndarray], n: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Each row's combination of COMBO_COLUMNS ids, numbered in order of appearance."""
    index: dict[tuple[int, ...], int] = {}
    keys = zip(*(ids[c].tolist() for c in COMBO_COLUMNS)) if n else ()
    combo = np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int32, n)
    return combo, list(index)


def _scan(data: bytes, rank: int, path: str, mtime: int) -> TorchRing | Unreadable | None:
    """The columns straight from the pickle's bytes (_frscan.c): a whole ring, a cut-off one (``problem`` says
    so), or None where the scanner could not read it (the caller then loads the file whole, which refuses what
    is no dump)."""
    try:
        out = _frscan.scan(data)
    except (ValueError, MemoryError):
        return None
    if out["error"] and (out["unsupported"] or not out["rows"]):
        return None
    if not out["error"] and not out["truncated"] and (
            not out["top_dict"] or not out["has_entries"] and "pg_status" not in out["meta"]):
        return Unreadable(rank, path, "is not a Flight Recorder dump (no list of entries)")
    n = out["rows"]
    cols = out["columns"]
    ints = {c: np.frombuffer(cols[c], np.int64, n) for c in INT_COLUMNS}
    flags = {c: np.frombuffer(cols[c], np.int8, n) for c in FLAG_COLUMNS}
    ids = {c: np.frombuffer(cols[c], np.int32, n) for c in VALUE_COLUMNS}
    values = {c: [normalize(c, v) for v in out["values"][c]] for c in VALUE_COLUMNS}
    combo = np.frombuffer(cols["combo"], np.int32, n)
    combos = [tuple(c) for c in out["combos"]]
    for c in VALUE_COLUMNS:  # two raw values may normalize alike (a list and a tuple): one id each
        if len(set(values[c])) != len(values[c]):
            first: dict[Any, int] = {}
            remap = np.array([first.setdefault(v, len(first)) for v in values[c]], np.int32)
            ids[c] = np.where(ids[c] >= 0, remap[np.maximum(ids[c], 0)], -1).astype(np.int32)
            values[c] = list(first)
            if c in COMBO_COLUMNS:
                k = COMBO_COLUMNS.index(c)
                combos = [x[:k] + ((int(remap[x[k]]) if x[k] >= 0 else -1),) + x[k + 1:] for x in combos]
    if len(set(combos)) != len(combos):  # combinations that became one
        first_c: dict[tuple[int, ...], int] = {}
        remap_c = np.array([first_c.setdefault(x, len(first_c)) for x in combos] + [-1], np.int32)
        combo = remap_c[combo]
        combos = list(first_c)
    meta = out["meta"]
    problem = ""
    if out["error"]:
        problem = f"read up to a problem ({out['error']}): {n} entries read before it"
    elif out["truncated"]:
        problem = f"is cut off: {n} entries read before the cut"
    version, config, status = _meta(meta)
    if n == 0 and (out["error"] or out["truncated"]):
        return None  # nothing usable before the cut: the caller names the file unreadable
    return TorchRing(rank, path, "pickle", version, config, status, mtime, n, ints, flags, ids, values, problem,
                     size=len(data), cut=bool(out["truncated"] or out["error"]), combo=combo, combos=combos)


def read_all(dumps: DumpSet, fast: bool = True, threads: int | None = None
             ) -> Iterable[TorchRing | Unreadable]:
    """Every file's ring, in rank order, read ahead by a few threads (the C scanner lets go of the GIL while it
    scans, so reading, scanning and the caller's analysis of the previous ring overlap). The GIL changes hands
    every millisecond meanwhile, not every 5: a reader whose scan is done waits less for the caller's analysis to
    let go of it."""
    import sys

    if _frscan is not None:
        _frscan.retain_freed_memory()  # blocks of 20,000 rows reused, not mapped afresh for every file
    workers = threads or min(4, max(2, (os.cpu_count() or 1) + 1))
    if workers <= 1 or len(dumps.files) <= 1:
        for d in dumps.files:
            yield read(d, fast)
        return
    ahead = workers * 2  # bounded: a 4,096-rank job never holds more than a few rings at once
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 0.001))
    try:
        yield from _read_ahead(dumps, fast, workers, ahead)
    finally:
        sys.setswitchinterval(interval)


def _read_ahead(dumps: DumpSet, fast: bool, workers: int, ahead: int) -> Iterable[TorchRing | Unreadable]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="distcheck-fr-read") as pool:
        pending = []
        files = iter(dumps.files)
        for d in files:
            pending.append(pool.submit(read, d, fast))
            if len(pending) >= ahead:
                break
        while pending:
            ring = pending.pop(0).result()
            nxt = next(files, None)
            if nxt is not None:
                pending.append(pool.submit(read, nxt, fast))
            yield ring
