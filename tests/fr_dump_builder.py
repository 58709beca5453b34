"""Flight Recorder dumps as torch writes them, built in the tests (and by bench/bench_fr_dumps.py).

    ring = Ring(rank=0, groups={"0": ("default_pg", [0, 1])})
    ring.coll("all_reduce", line=12)                   # #1 of group 0, completed
    ring.coll("all_reduce", line=14, state="started")  # #2, started and never completed
    write(folder, ring)                                # folder/rank_0, in torch's pickle layout

An entry has the fields of torch's dump format "2.10" (torch/csrc/distributed/c10d/FlightRecorder, as the
analyzer in torch/distributed/flight_recorder reads them): ``record_id``, ``pg_id``, ``process_group``
(name, desc), ``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``profiling_name`` (``nccl:all_reduce``,
``nccl:send 0->1``), sizes and dtypes, ``state`` (scheduled / started / completed), the times, ``retired``,
``timeout_ms``, ``is_p2p`` and the Python ``frames`` (innermost first). A dump adds ``version``, ``pg_config``
(each group's members, as NCCL records them) and ``pg_status`` (each group's counters, keyed by pg_id).

:class:`TorchPickler` writes the bytes the way torch's own pickler does (protocol 2, strings memoized by value,
a frame dict memoized once complete and fetched again by later entries with the same frame, one MARK for all
entries), so the C scanner's fast path sees what it sees in a real dump; ``layout="python"`` pickles with
Python's pickler instead, ``layout="json"`` writes what ``_dump_fr_trace_json`` writes (the group as a list,
no time as 0, the counters as strings, no frames).
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import time
from pathlib import Path
from typing import Any

TORCH_C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
C10D_LOGGER = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
USER_FILE = "/job/train.py"
TIMEOUT_MS = 600_000


class TorchPickler:
    """torch's pickler's layout for a dump's IValues (see the module docstring). ``fixed`` writes a number in one
    width (bench/bench_fr_dumps.py repeats a step's bytes and patches them); ``at`` records where each one is."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[Any, int] = {}
        self.at: dict[str, list[int]] = {}

    def _put(self, key: Any) -> None:
        i = len(self.memo)
        self.memo[key] = i
        self.out += b"q" + bytes([i]) if i < 256 else b"r" + struct.pack("<I", i)

    def _get(self, i: int) -> None:
        self.out += b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)

    def string(self, s: str) -> None:
        if ("s", s) in self.memo:
            self._get(self.memo[("s", s)])
            return
        data = s.encode()
        self.out += b"X" + struct.pack("<I", len(data)) + data
        self._put(("s", s))

    def integer(self, v: int, fixed: str | None = None) -> None:
        if fixed is not None:
            wide = fixed.startswith("time:")
            self.at.setdefault(fixed, []).append(len(self.out) + (2 if wide else 1))
            self.out += b"\x8a\x08" + struct.pack("<q", v) if wide else b"J" + struct.pack("<i", v)
        elif 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)
        elif -2**31 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            self.out += b"\x8a\x08" + struct.pack("<q", v)

    def value(self, v: Any, fixed: str | None = None) -> None:
        if v is None:
            self.out += b"N"
        elif v is True:
            self.out += b"\x88"
        elif v is False:
            self.out += b"\x89"
        elif isinstance(v, int):
            self.integer(v, fixed)
        elif isinstance(v, float):
            self.out += b"G" + struct.pack(">d", v)
        elif isinstance(v, str):
            self.string(v)
        elif isinstance(v, tuple):
            for x in v:
                self.value(x)
            self.out += {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(v)]
        elif isinstance(v, list):
            self.out += b"]"
            if v:
                self.out += b"("
                for x in v:
                    self.value(x)
                self.out += b"e"
        elif isinstance(v, dict) and set(v) == {"name", "filename", "line"}:  # a frame: shared by later entries
            key = ("f", v["name"], v["filename"], v["line"])
            if key in self.memo:
                self._get(self.memo[key])
                return
            self.dict(v)
            self._put(key)
        elif isinstance(v, dict):
            self.dict(v)
        else:
            raise TypeError(type(v))

    def dict(self, d: dict[str, Any], fixed: dict[str, str] | None = None) -> None:
        self.out += b"}"
        if d:
            self.out += b"("
            for k, v in d.items():
                self.string(k)
                self.value(v, (fixed or {}).get(k))
            self.out += b"u"

    def document(self, doc: dict[str, Any]) -> bytes:
        self.dict(doc)
        self.out += b"."
        return bytes(self.out)


def frames(line: int, file: str = USER_FILE, op: str = "all_reduce", fn: str = "step") -> list[dict[str, Any]]:
    """A call's Python frames, innermost first: torch's two, the user's function at ``line``, its module."""
    return [{"name": op, "filename": TORCH_C10D, "line": 3245}, {"name": "wrapper", "filename": C10D_LOGGER, "line": 83},
            {"name": fn, "filename": file, "line": line}, {"name": "<module>", "filename": file, "line": 300}]


class Ring:
    """One rank's ring: entries numbered as torch numbers them (record_id, each group's collective_seq_id and
    p2p_seq_id, op_id), created a millisecond apart from ``t0``."""

    def __init__(self, rank: int, groups: dict[str, tuple[str, list[int]]], backend: str = "nccl",
                 t0: int | None = None, first_record: int = 0, config: bool = True) -> None:
        self.rank, self.groups, self.backend = rank, groups, backend
        self.t0 = time.time_ns() - 3_600 * 10**9 if t0 is None else t0
        self.entries: list[dict[str, Any]] = []
        self.seq: dict[str, int] = {}
        self.p2p: dict[str, int] = {}
        self.op_id: dict[str, int] = {}
        self.record = first_record
        self.config = config  # NCCL records each group's members; gloo records none
        self.pg_ids = {name: i for i, name in enumerate(groups)}

    def _entry(self, name: str, group: str, seq: int, p2p_seq: int, ins: Any, outs: Any, dtype: str,
               state: str, line: int, file: str, retired: bool | None, timeout_ms: int, is_p2p: bool,
               fn: str) -> dict[str, Any]:
        k = self.record
        created = self.t0 + k * 1_000_000
        done = state == "completed"
        started = state in ("started", "completed")
        self.op_id[group] = self.op_id.get(group, 0) + 1
        e = {"frames": frames(line, file, name.split(" ")[0], fn), "record_id": k, "pg_id": self.pg_ids[group],
             "process_group": (group, self.groups[group][0]), "collective_seq_id": seq, "p2p_seq_id": p2p_seq,
             "op_id": self.op_id[group], "profiling_name": f"{self.backend}:{name}", "time_created_ns": created,
             "input_sizes": ins, "input_dtypes": [dtype] * len(ins), "output_sizes": outs,
             "output_dtypes": [dtype] * len(outs), "state": state,
             "time_discovered_started_ns": created + 10_000 if started else None,
             "time_discovered_completed_ns": created + 500_000 if done else None,
             "retired": done if retired is None else retired, "timeout_ms": timeout_ms, "is_p2p": is_p2p}
        self.record += 1
        self.entries.append(e)
        return e

    def coll(self, op: str = "all_reduce", *, group: str = "0", ins: Any = None, outs: Any = None,
             dtype: str = "Float", state: str = "completed", line: int = 10, file: str = USER_FILE,
             retired: bool | None = None, timeout_ms: int = TIMEOUT_MS, seq: int | None = None,
             fn: str = "step") -> dict[str, Any]:
        """The group's next collective (or the one numbered ``seq``: a rank that skipped some)."""
        ins = [[4]] if ins is None else ins
        outs = ins if outs is None else outs
        self.seq[group] = self.seq.get(group, 0) + 1 if seq is None else seq
        return self._entry(op, group, self.seq[group], self.p2p.get(group, 0), ins, outs, dtype, state, line, file,
                           retired, timeout_ms, False, fn)

    def send(self, peer: int, *, group: str = "0", sizes: Any = None, dtype: str = "Float",
             state: str = "completed", line: int = 20) -> dict[str, Any]:
        members = self.groups[group][1]
        self.p2p[group] = self.p2p.get(group, 0) + 1
        me, to = members.index(self.rank), members.index(peer)
        sizes = [[4]] if sizes is None else sizes
        return self._entry(f"send {me}->{to}", group, self.seq.get(group, 0), self.p2p[group], sizes, sizes, dtype,
                           state, line, USER_FILE, None, TIMEOUT_MS, True, "step")

    def recv(self, peer: int, *, group: str = "0", sizes: Any = None, dtype: str = "Float",
             state: str = "completed", line: int = 30) -> dict[str, Any]:
        members = self.groups[group][1]
        self.p2p[group] = self.p2p.get(group, 0) + 1
        me, frm = members.index(self.rank), members.index(peer)
        sizes = [[4]] if sizes is None else sizes
        return self._entry(f"recv {me}<-{frm}", group, self.seq.get(group, 0), self.p2p[group], sizes, sizes, dtype,
                           state, line, USER_FILE, None, TIMEOUT_MS, True, "step")

    def keep_last(self, n: int) -> None:
        """What a ring of ``n`` entries still holds: the oldest are gone (it wrapped)."""
        self.entries = self.entries[-n:]

    def doc(self) -> dict[str, Any]:
        status = {}
        for name in self.groups:
            mine = [e for e in self.entries if e["process_group"][0] == name and not e["is_p2p"]]
            seqs = [e["collective_seq_id"] for e in mine]
            status[str(self.pg_ids[name])] = {
                "last_enqueued_collective": max(seqs, default=-1),
                "last_started_collective": max((e["collective_seq_id"] for e in mine if e["state"] != "scheduled"),
                                               default=-1),
                "last_completed_collective": max((e["collective_seq_id"] for e in mine if e["state"] == "completed"),
                                                 default=-1)}
        config = {name: {"name": name, "desc": desc, "ranks": str(list(members))}
                  for name, (desc, members) in self.groups.items()} if self.config else \
            {"": {"name": "", "desc": "", "ranks": "[]"}}
        return {"version": "2.10", "pg_config": config, "pg_status": status, "entries": self.entries}


def dump_bytes(doc: dict[str, Any], layout: str = "torch") -> bytes:
    if layout == "torch":
        return TorchPickler().document(doc)
    if layout == "python":
        return pickle.dumps(doc, protocol=2)
    if layout == "json":
        entries = []
        for e in doc["entries"]:
            j = {k: v for k, v in e.items() if k != "frames"}
            j["process_group"] = list(e["process_group"])
            for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                j[k] = j[k] or 0
            entries.append(j)
        status = {k: {kk: str(vv) for kk, vv in v.items()} for k, v in doc["pg_status"].items()}
        return json.dumps({"version": doc["version"], "pg_config": doc["pg_config"], "pg_status": status,
                           "entries": entries, "comm_lib_version": ""}).encode()
    raise ValueError(layout)


def write(folder: str | os.PathLike, ring: Ring, layout: str = "torch", prefix: str = "rank_",
          mtime_ns: int | None = None) -> Path:
    """Write the ring as ``folder/<prefix><rank>`` (``.json`` for JSON), its mtime now (or ``mtime_ns``): when the
    watchdog wrote it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}{ring.rank}{'.json' if layout == 'json' else ''}"
    path.write_bytes(dump_bytes(ring.doc(), layout))
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def world(n: int) -> dict[str, tuple[str, list[int]]]:
    return {"0": ("default_pg", list(range(n)))}
