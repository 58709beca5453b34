"""Diagnose a job from torch's own Flight Recorder dumps alone: one finding per cause, for a job distcheck never saw.

    python -m distcheck report dumps/      # contract/torch_fr_dumps.py reads the files, this module diagnoses

Each rank's ring arrives as columns (contract/torch_fr_dumps.TorchRing), one rank at a time (:meth:`Postmortem.add`):
a 4,096-rank job's rings are never in memory together. What is kept is what the diagnosis needs:

* **per process group, per position** (``collective_seq_id``, torch's own counter of the group's collectives on
  each rank, so a mismatch never shifts what follows): the signature the first rank holding it issued (op, sizes,
  dtypes, as far as the op requires them to agree), how many ranks agree, and each rank that differs. A group is
  its name, its ring (NCCL's and c10d's count apart) and its members (``split_group`` reuses names for disjoint
  sets of ranks). The majority decides who is odd at a position, so rank 0 can be the culprit.
* **per rank, per group**: the positions its ring still holds, the last it issued, the last it completed, the
  first it has not completed (and the entries themselves, for the messages).
* **point-to-point ops** per (group, sender, receiver), in ``p2p_seq_id`` order on each side: the k-th send pairs
  with the k-th receive; **all_to_all** per pair where the ring holds each peer's size (the list form).

Then :meth:`Postmortem.result` gives the findings:

* ``collective_mismatch``: ranks issued different collectives at one position (op, sizes, dtypes), a send and its
  receive disagree, an all_to_all's sizes do not pair up, or ranks made one group with different members. Every
  group is compared to its end: one finding per cause (a group and its odd ranks), with how many positions it
  spans.
* ``hang``: per group, the first position some rank has not completed, and why, from ``state``, ``retired``,
  ``pg_status`` and the times: a rank that never issued it (it is elsewhere: a CPU-side divergence, or stuck in
  another group's collective, which then is the cause), a rank that left no dump, a collective every rank issued
  and none completed (the GPU, the network or a peer), one its peers completed but a rank did not (its GPU is
  behind), and whether it timed out (``timeout_ms`` against the time the dump was written; NCCL's watchdog retires
  a collective it timed out). A send whose receiver never posted the receive is one too.

Each message names the ranks, the group, the position, the op and sizes, and each rank's own line (the innermost
of the entry's ``frames`` that is the user's, analysis/frame_owner.py). Ranks whose ring was overwritten before
the position are named (raise ``TORCH_FR_BUFFER_SIZE``). What is not a bug in the job but limits the diagnosis
(a rank without a dump, a file cut off or unreadable, dumps of different versions) is a warning. Pure: no file is
read here; unknown op names, versions and fields are compared as they are, never a reason to stop.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from distcheck.analysis.flight_recorder import dtype_name, family
from distcheck.analysis.frame_owner import is_user, location, owner
from distcheck.analysis.split_matrix import FIX as SPLIT_FIX, LIST_FIX, PairMismatch, blamed
from distcheck.analysis.split_matrix import describe as describe_pairs
from distcheck.contract.findings import CheckResult, Finding, Note, format_ranks, rank_ranges
from distcheck.contract.site import file_line

STATES = {"scheduled": 1, "started": 2, "completed": 3}
DEVIANTS_PER_RANK = 64  # differing positions kept per rank and group (the first ones: a cause is its first)
OPEN_KEPT = 1024  # not-completed positions kept per rank and group
A2A_ROWS = 4_000_000  # all_to_all entries kept for the per-pair check
SHOWN = 4  # ranks or values a message names; the detail holds more
IN_FLIGHT_S = 60.0  # a wait shorter than this (and than the timeout) in a dump is a collective in flight
BUFFER_FIX = "raise TORCH_FR_BUFFER_SIZE (older name TORCH_NCCL_TRACE_BUFFER_SIZE) so the ring reaches back further"
_P2P = re.compile(r"^(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")
_U64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise (uint64, wrapping): ids in, well-spread 64-bit values out."""
    x = x.astype(_U64)
    with np.errstate(over="ignore"):
        x ^= x >> _U64(30)
        x *= _U64(0xBF58476D1CE4E5B9)
        x ^= x >> _U64(27)
        x *= _U64(0x94D049BB133111EB)
        x ^= x >> _U64(31)
    return x


class _Interner:
    """One table of distinct values for the whole job (op names, groups, frames, sizes, ...): a ring's own ids
    become the job's through :meth:`remap`."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.items: list[Any] = []

    def gid(self, value: Any) -> int:
        k = self.index.get(value)
        if k is None:
            k = self.index[value] = len(self.items)
            self.items.append(value)
        return k

    def remap(self, local_ids: np.ndarray, local_values: list[Any]) -> np.ndarray:
        """The job's ids of a ring's column (-1 stays -1: the table's last slot is the sentinel)."""
        lut = np.empty(len(local_values) + 1, np.int64)
        for k, v in enumerate(local_values):
            lut[k] = self.gid(v)
        lut[-1] = -1
        return lut[local_ids]


@dataclass(frozen=True)
class _Group:
    name: str
    desc: str
    ring: str  # "nccl", "gloo", ...: the backend whose counter numbers the group's collectives
    members: tuple[int, ...] | None  # from the dumps' pg_config; None where they hold none (gloo)

    def label(self) -> str:
        desc = "" if self.desc in ("", "undefined") else f" ({self.desc})"
        return f"group {self.name}{desc}"


@dataclass
class _Row:
    """One entry as the messages name it (the job's ids)."""

    rank: int
    seq: int
    op: int
    ins: int
    outs: int
    idt: int
    odt: int
    frames: int
    state: int
    completed: bool
    started: bool
    retired: int
    created: int
    t_started: int
    t_completed: int
    timeout_ms: int
    record_id: int
    p2p_seq: int = -1


@dataclass
class _Progress:
    """One rank on one group: what its ring holds."""

    first: int
    last: int
    done: int  # the last position it completed (-1: none held)
    open_first: int | None
    n_open: int
    open_positions: np.ndarray
    last_row: _Row
    open_row: _Row | None
    done_row: _Row | None


class _Table:
    """A group's positions: the first signature seen at each, how many ranks agree with it, who set it and its
    frames. Positions live in segments (arrays over a range of positions): the rings of one group cover about
    the same window, so a rank's positions update one segment at once; a group seen at seq 10 and at seq
    10,000,000 (a rank stuck since the start) gets two segments, not an array of ten million."""

    GAP = 1 << 16  # positions further than this from every segment start a new one

    def __init__(self) -> None:
        self.segs: list[list[Any]] = []  # [base, ref (uint64), cnt (int32), who (int32), frames (int32)]

    def _segment(self, lo: int, hi: int) -> list[Any]:
        for seg in self.segs:
            base, n = seg[0], len(seg[1])
            if lo >= base - self.GAP and hi < base + n + self.GAP:
                if lo < base or hi >= base + n:
                    slack = max(1024, n // 2)
                    new_lo = min(lo - (slack if lo < base else 0), base)
                    new_hi = max(hi + 1 + (slack if hi >= base + n else 0), base + n)
                    before, after = base - new_lo, new_hi - base - n
                    seg[1] = np.concatenate([np.zeros(before, _U64), seg[1], np.zeros(after, _U64)])
                    seg[2] = np.concatenate([np.zeros(before, np.int32), seg[2], np.zeros(after, np.int32)])
                    seg[3] = np.concatenate([np.full(before, -1, np.int32), seg[3], np.full(after, -1, np.int32)])
                    seg[4] = np.concatenate([np.full(before, -1, np.int32), seg[4], np.full(after, -1, np.int32)])
                    seg[0] = new_lo
                return seg
        n = hi - lo + 1
        seg = [lo, np.zeros(n, _U64), np.zeros(n, np.int32), np.full(n, -1, np.int32), np.full(n, -1, np.int32)]
        self.segs.append(seg)
        return seg

    def update(self, rank: int, pos: np.ndarray, sig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add one rank's positions (sorted, distinct); returns (the indices into ``pos`` where the rank differs
        from the signature held, the indices of positions it is the first to hold: set_frames() gives theirs)."""
        seg = self._segment(int(pos[0]), int(pos[-1]))
        base, ref, cnt, who, fr = seg
        i = pos - base
        unset = cnt[i] == 0
        new = np.flatnonzero(unset)
        if new.size:
            j = i[new]
            ref[j] = sig[new]
            who[j] = rank
        same = ref[i] == sig
        cnt[i[same]] += 1
        differ = np.flatnonzero(~same)
        return differ, new

    def set_frames(self, pos: np.ndarray, frames: np.ndarray) -> None:
        seg = self._segment(int(pos[0]), int(pos[-1]))
        seg[4][pos - seg[0]] = frames

    def at(self, p: int) -> tuple[int, int, int, int] | None:
        """(signature, ranks agreeing with it, the rank that set it, its frames) at position ``p``."""
        for base, ref, cnt, who, fr in self.segs:
            k = p - base
            if 0 <= k < len(ref) and cnt[k]:
                return int(ref[k]), int(cnt[k]), int(who[k]), int(fr[k])
        return None


@dataclass
class _OpTables:
    ring: np.ndarray
    kind: np.ndarray
    a2a: np.ndarray
    keep_in: np.ndarray
    keep_out: np.ndarray
    keep_idt: np.ndarray
    keep_odt: np.ndarray
    keep_all: np.ndarray  # no field left out
    state: np.ndarray  # state id -> STATES code (its last slot: an entry without a state)


_EMPTY = np.empty(0, np.int64)


@dataclass
class _RankInfo:
    rank: int
    path: str
    fmt: str
    version: str
    rows: int
    first_record: int
    dumped_ns: int
    problem: str
    pg_status: dict[str, dict[str, int]]
    cut: bool = False  # its file was cut off: its newest entries are missing
    current: _Row | None = None  # the earliest-created entry it has not completed, on any group
    current_group: int = -1


class _P2PSide:
    """One rank's sends to (or receives from) one peer on one group, in p2p_seq_id order; its entries as _Rows
    only where a message may name them (the first open one, the pairs that differ)."""

    def __init__(self, rank: int, seqs: np.ndarray, sigs: np.ndarray, completed: np.ndarray, rows: np.ndarray,
                 rows_of: Any, wrapped: bool) -> None:
        self.rank, self.seqs, self.sigs, self.completed, self.wrapped = rank, seqs, sigs, completed, wrapped
        self._rows, self._rows_of = rows, rows_of
        self._kept: dict[int, _Row] = {}

    def row(self, i: int) -> _Row:
        if i not in self._kept:
            self._kept[i] = self._rows_of(int(self._rows[i]))
        return self._kept[i]

    def settle(self) -> None:
        """Waiting for its peer's side, kept past its ring: the first open entry and the first few (a pair that
        differs is named by its first difference, within them or not at all)."""
        open_i = np.flatnonzero(~self.completed)
        for i in list(range(min(len(self.seqs), DEVIANTS_PER_RANK))) + open_i[:1].tolist():
            self.row(i)
        self._rows_of = None


@dataclass
class Diagnosis:
    findings: list[Finding]
    warnings: list[Note]
    checks: list[CheckResult]
    world_size: int
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Stuck:
    """A group's first position some rank has not completed, and the ranks around it."""

    group: int
    pos: int
    waiting: list[int]
    absent: list[int]  # dumped members that never issued it
    no_dump: list[int]
    completed: list[int]
    unknown: list[int]  # members whose ring no longer holds the position (overwritten)
    rows: dict[int, _Row]
    blocked_by: set[int] = field(default_factory=set)  # groups the absent ranks wait in
    cut: list[int] = field(default_factory=list)  # members whose dump file ends before it


class Postmortem:
    """Feed it every rank's ring (:meth:`add`) and every file it could not read (:meth:`unreadable`), then ask
    for :meth:`result`."""

    def __init__(self) -> None:
        self.ops, self.states, self.pgs, self.rings = _Interner(), _Interner(), _Interner(), _Interner()
        self.group_pg_ids: dict[int, Counter] = {}  # group -> the pg_ids its entries carry (pg_status's keys)
        self.frames, self.sizes, self.dtypes = _Interner(), _Interner(), _Interner()
        self.groups: list[_Group] = []
        self.group_index: dict[_Group, int] = {}
        self.tables: dict[int, _Table] = {}
        self.details: dict[int, tuple[int, int, int, int, int]] = {}  # signature -> (op, ins, outs, idt, odt)
        self.deviants: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.progress: dict[tuple[int, int], _Progress] = {}
        self.members_seen: dict[int, set[int]] = {}
        self.ranks: dict[int, _RankInfo] = {}
        self.failed: dict[int, tuple[str, str]] = {}  # rank -> (path, reason)
        self.skipped: list[tuple[str, str]] = []
        self.config_views: dict[tuple[str, str], dict[tuple[tuple[int, ...], str], list[int]]] = {}
        self._members_text: dict[str, tuple[int, ...]] = {}
        self.a2a: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.a2a_rows = 0
        self.p2p: dict[tuple[int, int, int], dict[str, _P2PSide]] = {}
        self.p2p_findings: list[Finding] = []
        self.p2p_unmatched: list[tuple[int, int, int, str, _Row]] = []  # (group, src, dst, side, row)
        self.notes: list[Note] = []
        self.entries = 0
        self._op_info: list[tuple[str, str, str, int, int, int]] = []  # ring, name, family, kind, src, dst
        self._cached: tuple[tuple[int, int], _OpTables] | None = None
        self._world: list[int] | None = None  # known once every ring is in (result())

    # --- reading -----------------------------------------------------------------------------------------------

    def unreadable(self, rank: int, path: str, reason: str) -> None:
        self.failed[rank] = (path, reason)

    def skip(self, path: str, why: str) -> None:
        self.skipped.append((path, why))

    def _op(self, gid: int) -> tuple[str, str, str, int, int, int]:
        while len(self._op_info) <= gid:
            name = str(self.ops.items[len(self._op_info)])
            ring, _, op = name.partition(":") if ":" in name else ("", "", name)
            m = _P2P.match(op)
            kind, src, dst = -1, -1, -1
            if m:
                kind = 0 if m[1] == "send" else 1
                a, b = int(m[2]), int(m[4])
                src, dst = (a, b) if m[3] == "->" else (b, a)
            fam = family(op.split(" ", 1)[0]) if op else "?"
            self._op_info.append((ring, op.split(" ", 1)[0], fam, kind, src, dst))
        return self._op_info[gid]

    def _members_of(self, config: dict[str, Any], name: str) -> tuple[int, ...] | None:
        info = config.get(name)
        if not isinstance(info, dict) or "ranks" not in info:
            return None
        text = info["ranks"]
        if isinstance(text, (list, tuple)):
            return tuple(sorted(int(r) for r in text if isinstance(r, int) or str(r).isdigit()))
        cached = self._members_text.get(str(text))
        if cached is None:
            cached = self._members_text[str(text)] = tuple(sorted(int(r) for r in re.findall(r"\d+", str(text))))
        return cached or None

    def _tables(self) -> Any:
        """Per op id of the job: its ring's id, its point-to-point kind (-1: a collective, 0 send, 1 recv), whether
        it is an all_to_all, and which fields must agree at a position (see :meth:`_signature`); per state id its
        code. Rebuilt when a ring brings new ops or states."""
        key = (len(self.ops.items), len(self.states.items))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._op(len(self.ops.items) - 1)
        info = self._op_info
        t = _OpTables(
            ring=np.array([self.rings.gid(i[0]) for i in info], np.int64),
            kind=np.array([i[3] for i in info], np.int64),
            a2a=np.array([i[2] == "all_to_all" for i in info], bool),
            keep_in=np.array([not (i[2] in ("all_to_all", "scatter") or i[1].endswith("_v") and i[2] == "all_gather")
                              for i in info], bool),
            keep_out=np.array([not (i[2] in ("all_to_all", "gather") or i[1].endswith("_v") and
                                    i[2] == "reduce_scatter") for i in info], bool),
            keep_idt=np.array([i[2] != "scatter" for i in info], bool),
            keep_odt=np.array([i[2] != "gather" for i in info], bool),
            keep_all=np.array([i[2] not in ("all_to_all", "scatter", "gather") and not i[1].endswith("_v")
                               for i in info], bool),
            state=np.array([STATES.get(str(v), 0) for v in self.states.items] + [0], np.int64))
        self._cached = (key, t)
        return t

    def _group_of(self, ring: Any, pg: int, ring_code: int) -> int:
        name, desc = self.pgs.items[pg]
        group = _Group(str(name), str(desc), self.rings.items[ring_code], self._members_of(ring.pg_config, str(name)))
        gi = self.group_index.get(group)
        if gi is None:
            gi = self.group_index[group] = len(self.groups)
            self.groups.append(group)
        return gi

    def add(self, ring: Any) -> None:
        """One rank's ring (contract/torch_fr_dumps.TorchRing)."""
        n = ring.rows
        ints, flags, values = ring.ints, ring.flags, ring.values
        first_record = int(ints["record_id"].min()) if n else -1
        info = _RankInfo(ring.rank, ring.path, ring.fmt, ring.version, n, first_record, int(ring.dumped_ns or 0),
                         ring.problem, ring.pg_status, bool(getattr(ring, "cut", False)))
        self.ranks[ring.rank] = info
        for name, cfg in ring.pg_config.items():
            members = self._members_of(ring.pg_config, name)
            if members is not None and isinstance(cfg, dict):
                view = self.config_views.setdefault((name, str(cfg.get("desc", ""))), {})
                view.setdefault((members, str(cfg.get("desc", ""))), []).append(ring.rank)
        if not n:
            return
        self.entries += n
        # Every row's op, group, sizes and dtypes come from its combination (a ring has a few dozen): the job's ids,
        # the group, the signature and the op's kind are worked out per combination, then taken per row.
        combos = list(ring.combos) + [(-1,) * 6]  # the last one: a row without a combination (combo -1)
        pick = (lambda col, interner, k, default=-1: interner.gid(values[col][k]) if k >= 0 else default)
        c_op = np.array([pick("profiling_name", self.ops, c[0], self.ops.gid("?")) for c in combos], np.int64)
        c_pg = [pick("process_group", self.pgs, c[1], self.pgs.gid(("?", ""))) for c in combos]
        c_ins = np.array([pick("input_sizes", self.sizes, c[2]) for c in combos], np.int64)
        c_outs = np.array([pick("output_sizes", self.sizes, c[3]) for c in combos], np.int64)
        c_idt = np.array([pick("input_dtypes", self.dtypes, c[4]) for c in combos], np.int64)
        c_odt = np.array([pick("output_dtypes", self.dtypes, c[5]) for c in combos], np.int64)
        t = self._tables()
        c_ring = t.ring[c_op]
        cid = ring.combo
        orphans = bool((cid < 0).any())  # rows without a combination (the scanner ran out of memory): group "?"
        c_group = np.array([self._group_of(ring, pg, int(rc)) if k < len(combos) - 1 or orphans else -1
                            for k, (pg, rc) in enumerate(zip(c_pg, c_ring.tolist()))], np.int64)
        c_sig = self._signature(t, c_op, c_ins, c_outs, c_idt, c_odt)
        c_gloo = np.array([self.rings.items[rc] == "gloo" for rc in c_ring.tolist()], bool)
        used = np.flatnonzero(np.bincount(cid, minlength=len(combos))[: len(combos)]) if (cid >= 0).all() else \
            np.unique(np.where(cid < 0, len(combos) - 1, cid))  # bincount: no sort (a unique() of 20,000 rows)
        for gi in set(c_group[used].tolist()):
            self.members_seen.setdefault(gi, set()).add(ring.rank)
        combo = _Combos(c_op, c_ins, c_outs, c_idt, c_odt, c_sig, c_group)

        state_code = np.array([STATES.get(str(v), 0) for v in values["state"]] + [0], np.int64)[ring.ids["state"]]
        retired = flags["retired"]
        t_done = ints["time_discovered_completed_ns"]
        completed = (state_code == 3) | (t_done > 0) | (c_gloo[cid] & (retired == 1))
        # An entry that says nothing of its state (an older dump): the group's completed counter decides.
        unknown = (state_code == 0) & (retired < 0) & (t_done <= 0) if ring.pg_status else None
        if unknown is not None and unknown.any():
            done = np.array([ring.pg_status.get(str(p), {}).get("last_completed_collective", -1)
                             for p in ints["pg_id"][unknown].tolist()], np.int64)
            completed[unknown] = ints["collective_seq_id"][unknown] <= done
        started = completed | (state_code == 2) | (ints["time_discovered_started_ns"] > 0)

        p2p = (flags["is_p2p"] == 1) | (t.kind[c_op][cid] >= 0)
        seq = ints["collective_seq_id"]
        coll = ~p2p & (seq >= 0)
        rows_of = _RowMaker(self, ring, combo, completed, started)

        # Earliest entry not completed, on any group: where the rank is stuck.
        open_rows = np.flatnonzero(~completed)
        if open_rows.size:
            k = int(open_rows[np.argmin(ints["time_created_ns"][open_rows])])
            info.current = rows_of(k)
            info.current_group = int(c_group[cid[k]])

        gidx = c_group[cid]
        coll_groups = sorted({int(g) for g in c_group[used]}) if coll.any() else []
        for gi in coll_groups:
            rows = np.flatnonzero(coll & (gidx == gi)) if len(coll_groups) > 1 else np.flatnonzero(coll)
            if not rows.size:
                continue
            self._collectives(ring, gi, rows, seq, c_sig[cid[rows]], combo, completed, rows_of, t)
        if p2p.any():
            self._p2p_rows(ring, np.flatnonzero(p2p), combo, completed, rows_of, first_record > 0)

    def _signature(self, t: Any, op: np.ndarray, ins: np.ndarray, outs: np.ndarray, idt: np.ndarray,
                   odt: np.ndarray) -> np.ndarray:
        """What must agree at a position, per op, as one number: an all_to_all's sizes may differ per rank (they
        are checked per pair), a gather's outputs and a scatter's inputs exist on the root only, the uneven
        (``_v``) forms differ. The job's ids are packed into 64 bits exactly where they fit (always, but in a job
        with over 8,191 op names or 65,535 distinct shapes), else mixed (odds of two signatures alike: 2^-64)."""
        k_in = np.where(t.keep_in[op], ins + 1, 0)
        k_out = np.where(t.keep_out[op], outs + 1, 0)
        k_idt = np.where(t.keep_idt[op], idt + 1, 0)
        k_odt = np.where(t.keep_odt[op], odt + 1, 0)
        if len(self.ops.items) < 1 << 13 and len(self.sizes.items) < (1 << 16) - 1 and \
                len(self.dtypes.items) < (1 << 9) - 1:
            # int64 arithmetic on small ids (op < 2^13, so op * 2^50 < 2^63): exact, no casts
            return (op * (1 << 50) + k_in * (1 << 34) + k_out * (1 << 18) + k_idt * (1 << 9) + k_odt).view(_U64)
        with np.errstate(over="ignore"):
            return (_mix(op + 1) ^ _mix(k_in.astype(_U64) + _U64(1 << 40)) ^ _mix(k_out.astype(_U64) + _U64(2 << 40))
                    ^ _mix(k_idt.astype(_U64) + _U64(3 << 40)) ^ _mix(k_odt.astype(_U64) + _U64(4 << 40)))

    def _frames(self, ring: Any, rows: np.ndarray) -> np.ndarray:
        """The job's frames ids of some rows of a ring."""
        return self.frames.remap(ring.ids["frames"][rows], ring.values["frames"])

    def _collectives(self, ring: Any, gi: int, rows: np.ndarray, seq: np.ndarray, sig: np.ndarray, combo: Any,
                     completed: np.ndarray, rows_of: Any, t: Any) -> None:
        """One rank's collectives on one group (``rows``, in record order, ``sig`` theirs) into the group's
        table and the rank's progress on it."""
        rank, ints = ring.rank, ring.ints
        ps = seq[rows]
        if ps.size > 1 and (ps[1:] < ps[:-1]).any():  # a group's entries are recorded in order; else sort them
            order = np.lexsort((ints["record_id"][rows], ps))
            rows, ps, sig = rows[order], ps[order], sig[order]
        if ps.size > 1 and (ps[1:] == ps[:-1]).any():
            # Coalesced ops share one position: their signatures combine.
            starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
            with np.errstate(over="ignore"):
                psig = np.add.reduceat(_mix(sig), starts)
            pos, lead = ps[starts], rows[starts]
        else:
            psig, pos, lead = sig, ps, rows
        table = self.tables.get(gi)
        if table is None:
            table = self.tables[gi] = _Table()
        differ, new = table.update(rank, pos, psig)
        if new.size:
            table.set_frames(pos[new], self._frames(ring, lead[new]))
        cid = ring.combo
        for idx in (new, differ):
            if idx.size:
                sigs, at = np.unique(psig[idx], return_index=True)
                for sv, r in zip(sigs.tolist(), lead[idx[at]].tolist()):
                    if sv not in self.details:
                        self.details[sv] = combo.detail(int(cid[r]))
        ids = self.group_pg_ids.get(gi)
        if ids is None:
            ids = self.group_pg_ids[gi] = Counter()
        ids[int(ints["pg_id"][rows[0]])] += 1
        if differ.size:
            differ = differ[:DEVIANTS_PER_RANK]
            self.deviants.setdefault(gi, []).append((rank, pos[differ], psig[differ], self._frames(ring, lead[differ])))
        done_mask = completed[rows]
        open_idx = np.flatnonzero(~done_mask)
        if open_idx.size:
            done_idx = np.flatnonzero(done_mask)
            last_done = int(done_idx[-1]) if done_idx.size else None
        else:
            last_done = len(rows) - 1
        open_row = rows_of(int(rows[open_idx[0]])) if open_idx.size else None
        done_row = rows_of(int(rows[last_done])) if last_done is not None else None
        self.progress[(rank, gi)] = _Progress(
            int(pos[0]), int(pos[-1]), int(ps[last_done]) if last_done is not None else -1,
            int(ps[open_idx[0]]) if open_idx.size else None, int(open_idx.size),
            np.unique(ps[open_idx[:OPEN_KEPT]]) if open_idx.size else _EMPTY,
            rows_of(int(lead[-1])), open_row, done_row)
        a2a = t.a2a[combo.op[cid[rows]]]
        if a2a.any() and self.a2a_rows < A2A_ROWS:
            rr = rows[a2a]
            self.a2a.setdefault(gi, []).append((rank, seq[rr], combo.ins[cid[rr]], combo.outs[cid[rr]]))
            self.a2a_rows += int(rr.size)

    def _p2p_rows(self, ring: Any, rows: np.ndarray, combo: Any, completed: np.ndarray, rows_of: Any,
                  wrapped: bool) -> None:
        """Sends and receives per (group, sender, receiver), each side in p2p_seq_id order; a pair is compared as
        soon as both sides are in."""
        ints, cid = ring.ints, ring.combo
        by_pair: dict[tuple[int, int, int, str], list[int]] = {}
        kinds = {}
        for c in np.unique(cid[rows]).tolist():
            ring_, name, fam, kind, src, dst = self._op(int(combo.op[c]))
            gi = int(combo.group[c])
            members = self.groups[gi].members
            if kind < 0 or members is not None and max(src, dst) >= len(members):
                continue
            if members is not None:
                src, dst = members[src], members[dst]
            kinds[c] = (gi, src, dst, "send" if kind == 0 else "recv")
        for r, c in zip(rows.tolist(), cid[rows].tolist()):
            key = kinds.get(c)
            if key is not None:
                by_pair.setdefault(key, []).append(r)
        for (gi, src, dst, side), rs in by_pair.items():
            rs_arr = np.array(rs, np.int64)
            rs_arr = rs_arr[np.lexsort((ints["record_id"][rs_arr], ints["p2p_seq_id"][rs_arr]))]
            c = cid[rs_arr]
            sizes = combo.ins[c] if side == "send" else combo.outs[c]
            dts = combo.idt[c] if side == "send" else combo.odt[c]
            sig = _mix(sizes + 1) ^ _mix(dts.astype(_U64) + _U64(0x5000000000))
            entry = _P2PSide(ring.rank, ints["p2p_seq_id"][rs_arr], sig, completed[rs_arr], rs_arr, rows_of,
                             wrapped)
            pair = self.p2p.setdefault((gi, src, dst), {})
            pair[side] = entry
            if len(pair) == 2:
                self._pair(gi, src, dst, pair.pop("send"), pair.pop("recv"))
                del self.p2p[(gi, src, dst)]
            else:
                entry.settle()  # its ring is let go: keep only the rows a message may name

    def _pair(self, gi: int, src: int, dst: int, send: _P2PSide, recv: _P2PSide) -> None:
        ns, nr = len(send.seqs), len(recv.seqs)
        # Align the two sides: from the first op when neither ring lost its beginning, else on the completed
        # ones (a send completes with its receive): the last completed send is the last completed receive.
        if send.wrapped or recv.wrapped:
            shift = int(send.completed.sum()) - int(recv.completed.sum())
        else:
            shift = 0
        pairs = [(i, i - shift) for i in range(ns) if 0 <= i - shift < nr]
        mism = [(i, j) for i, j in pairs if send.sigs[i] != recv.sigs[j]]
        if mism:
            i, j = mism[0]
            s, r = send.row(i), recv.row(j)
            g = self.groups[gi]
            more = f"; {len(mism) - 1} later pair(s) of the two differ too" if len(mism) > 1 else ""
            self.p2p_findings.append(Finding(
                "collective_mismatch", [src, dst],
                f"a send and its receive disagree on {g.label()}: rank {src} sends {self._sizes(s.ins, s.idt)} to "
                f"rank {dst} (its p2p #{s.p2p_seq}{self._at(s)}); rank {dst} receives "
                f"{self._sizes(r.outs, r.odt)} from rank {src} (its p2p #{r.p2p_seq}{self._at(r)}){more}. Fix: the "
                "receive's tensor must have the shape and dtype of the send's",
                {"group": g.name, "fields": ["shapes"], "src": src, "dst": dst, **self._site(s),
                 "send": self._row_json(s), "recv": self._row_json(r), "pairs_differing": len(mism)}))
        matched_s = {i for i, _ in pairs}
        matched_r = {j for _, j in pairs}
        for i in range(ns):
            if i not in matched_s and not send.completed[i]:
                self.p2p_unmatched.append((gi, src, dst, "send", send.row(i)))
                break
        for j in range(nr):
            if j not in matched_r and not recv.completed[j]:
                self.p2p_unmatched.append((gi, src, dst, "recv", recv.row(j)))
                break

    # --- naming things -----------------------------------------------------------------------------------------

    def _user_frame(self, frames_gid: int) -> tuple[str | None, int | None, str | None]:
        """(file, line, via) of the innermost frame that is the user's; via: the library call it made."""
        if frames_gid < 0:
            return None, None, None
        frames = self.frames.items[frames_gid]
        inner = None
        for filename, line, name in frames:
            if is_user(filename):
                via = None
                if inner is not None and owner(inner[0]) not in ("torch", "python", "distcheck"):
                    via = location(inner[0], inner[1], inner[2])
                return filename, line, via
            inner = (filename, line, name)
        return None, None, None

    def _at(self, row: _Row | None) -> str:
        if row is None:
            return ""
        file, line, _ = self._user_frame(row.frames)
        site = file_line(file, line)
        return f" at {site}" if site else ""

    def _site(self, row: _Row | None) -> dict[str, Any]:
        if row is None:
            return {}
        file, line, via = self._user_frame(row.frames)
        out: dict[str, Any] = {"file": file, "line": line} if file else {}
        if via:
            out["via"] = via
        return out

    def _shape(self, gid: int) -> Any:
        v = self.sizes.items[gid] if gid >= 0 else None
        return _listed(v)

    def _sizes(self, sizes: int, dtypes: int) -> str:
        shape = self._shape(sizes)
        dt = self.dtypes.items[dtypes] if dtypes >= 0 else ()
        names = sorted({dtype_name(d) for d in dt}) if dt else []
        return f"{shape if shape is not None else '?'}" + (f" {'/'.join(names)}" if names else "")

    def _op_name(self, gid: int) -> str:
        ring, name, *_ = self._op(gid)
        return name or str(self.ops.items[gid])

    def _brief(self, row: _Row, seq: bool = True) -> str:
        out = f"{self._op_name(row.op)}" + (f" #{row.seq}" if seq else "") + f" {self._sizes(row.ins, row.idt)}"
        if row.outs != row.ins and row.outs >= 0:
            out += f" -> {self._shape(row.outs)}"
        return out

    def _row_json(self, row: _Row | None) -> dict[str, Any] | None:
        if row is None:
            return None
        file, line, via = self._user_frame(row.frames)
        return {"op": str(self.ops.items[row.op]), "seq": row.seq, "input_sizes": self._shape(row.ins),
                "output_sizes": self._shape(row.outs),
                "input_dtypes": [dtype_name(d) for d in (self.dtypes.items[row.idt] if row.idt >= 0 else ())],
                "output_dtypes": [dtype_name(d) for d in (self.dtypes.items[row.odt] if row.odt >= 0 else ())],
                "state": str(self.states.items[row.state]) if row.state >= 0 else None,
                "completed": row.completed, "started": row.started, "retired": row.retired,
                "time_created_ns": row.created, "timeout_ms": row.timeout_ms, "record_id": row.record_id,
                "file": file, "line": line, **({"via": via} if via else {})}

    # --- members -----------------------------------------------------------------------------------------------

    def world(self) -> list[int]:
        if self._world is not None:
            return self._world
        ranks = set(self.ranks) | set(self.failed)
        for g in self.groups:
            ranks |= set(g.members or ())
        for views in self.config_views.values():
            for members, _ in views:
                ranks |= set(members)
        if ranks:
            ranks |= set(range(max(ranks) + 1))  # torch names every rank's file: a gap is a rank without one
        self._world = sorted(ranks)
        return self._world

    def members(self, gi: int) -> list[int]:
        g = self.groups[gi]
        if g.members is not None:
            return list(g.members)
        if g.desc == "default_pg" or g.name == "0":
            return self.world()
        return sorted(self.members_seen.get(gi, ()))

    # --- the diagnosis -----------------------------------------------------------------------------------------

    def result(self) -> Diagnosis:
        self._world = None
        findings: list[Finding] = []
        mismatch_at: dict[int, set[int]] = {}
        findings += self._group_views()
        for gi in sorted(self.deviants):
            findings += self._mismatches(gi, mismatch_at)
        for gi in sorted(self.a2a):
            findings += self._a2a_pairs(gi)
        findings += self.p2p_findings
        hangs = self._hangs(mismatch_at, findings)
        hangs += self._p2p_hangs()
        findings += hangs
        warnings = self._warnings()
        mismatches = [f for f in findings if f.kind == "collective_mismatch"]
        hang_findings = [f for f in findings if f.kind == "hang"]
        n_groups = len(self.groups)
        checks = [CheckResult("collectives", not mismatches, 0.0,
                              note=f"{len(self.ranks)} ring(s), {n_groups} group(s), {self.entries} entries"),
                  CheckResult("progress", not hang_findings, 0.0)]
        world = self.world()
        spans: dict[int, list[int]] = {}
        for (_, gi), prog in self.progress.items():
            span = spans.setdefault(gi, [prog.first, prog.last])
            span[0], span[1] = min(span[0], prog.first), max(span[1], prog.last)
        data = {"flight_recorder": {
            "dumps": len(self.ranks), "entries": self.entries,
            "ranks": rank_ranges(self.ranks), "without_dump": rank_ranges(self._no_dump()),
            "unreadable": [{"rank": r, "path": p, "reason": why} for r, (p, why) in sorted(self.failed.items())][:64],
            "groups": [{"name": g.name, "desc": g.desc, "ring": g.ring,
                        "members": rank_ranges(self.members(i)), "positions": spans.get(i, [])}
                       for i, g in enumerate(self.groups)][:256],
            "versions": sorted({r.version for r in self.ranks.values()})}}
        return Diagnosis(findings, warnings, checks, len(world), data)

    def _no_dump(self) -> list[int]:
        return [r for r in self.world() if r not in self.ranks]

    def _group_views(self) -> list[Finding]:
        """A group name whose members differ between ranks that are members of both: ranks made one group with
        different lists (split_group's disjoint groups under one name are fine)."""
        out = []
        for (name, desc), views in sorted(self.config_views.items()):
            if len(views) < 2:
                continue
            items = sorted(views.items(), key=lambda kv: -len(kv[1]))
            clash = [(m, rs) for (m, _), rs in items
                     if any(set(m) & set(m2) for (m2, _), _rs in items if m2 != m)]
            if not clash:
                continue
            majority = clash[0]
            odd = sorted({r for m, rs in clash[1:] for r in rs})
            # The line: where the first odd rank used the group (the ring holds no group's creation).
            used = next((prog.last_row for (r, gi), prog in self.progress.items()
                         if r == (odd or majority[1])[0] and self.groups[gi].name == name), None)
            parts = [f"{_ranks_text(rs)} made it with ranks {_short(list(m))}" for m, rs in clash[:SHOWN]]
            label = _Group(name, desc, "", None).label()
            out.append(Finding(
                "collective_mismatch", odd or sorted(majority[1]),
                f"{label} has different members on different ranks: {'; '.join(parts)}. Fix: every rank must pass "
                "the same ranks to new_group (or the same color to split_group): a rank-dependent list makes each "
                "rank wait for a different set of peers",
                {"group": name, "fields": ["group"], **self._site(used),
                 "views": [{"members": list(m), "ranks": rs} for m, rs in clash]}))
        return out

    def _holders(self, gi: int, p: int) -> list[int]:
        return [r for r in self.members(gi) if (r, gi) in self.progress
                and self.progress[(r, gi)].first <= p <= self.progress[(r, gi)].last]

    def _lost(self, gi: int, p: int) -> list[int]:
        """Members whose ring no longer holds position ``p``: it starts after it and lost its beginning."""
        out = []
        for r in self.members(gi):
            prog, info = self.progress.get((r, gi)), self.ranks.get(r)
            if info is None or info.first_record <= 0:
                continue
            if prog is None or prog.first > p:
                out.append(r)
        return out

    def _mismatches(self, gi: int, mismatch_at: dict[int, set[int]]) -> list[Finding]:
        table = self.tables[gi]
        devs = self.deviants[gi]
        by_pos: dict[int, list[tuple[int, int, int]]] = {}
        for rank, pos, sig, frames in devs:
            for p, s, f in zip(pos.tolist(), sig.tolist(), frames.tolist()):
                by_pos.setdefault(p, []).append((rank, s, f))
        causes: dict[tuple[int, ...], dict[str, Any]] = {}
        for p in sorted(by_pos):
            held = table.at(p)
            if held is None:
                continue
            ref_sig, ref_cnt, ref_rank, ref_frames = held
            dev = by_pos[p]
            counts = Counter({ref_sig: ref_cnt})
            for _, s, _ in dev:
                counts[s] += 1
            ranked = counts.most_common()
            tie = len(ranked) > 1 and ranked[0][1] == ranked[1][1]
            majority = None if tie else ranked[0][0]
            dev_ranks = {r for r, _, _ in dev}
            agree_ref = [r for r in self._holders(gi, p) if r not in dev_ranks]
            if ref_rank not in agree_ref:
                agree_ref.append(ref_rank)
            by_sig: dict[int, list[int]] = {ref_sig: sorted(agree_ref)}
            frames_of: dict[int, int] = {ref_rank: ref_frames}
            for r, s, f in dev:
                by_sig.setdefault(s, []).append(r)
                frames_of[r] = f
            odd = sorted(r for s, rs in by_sig.items() if s != majority for r in rs)
            key = tuple(odd)
            mismatch_at.setdefault(gi, set()).add(p)
            if key in causes:
                causes[key]["positions"].append(p)
                continue
            causes[key] = {"first": p, "positions": [p], "by_sig": {s: sorted(rs) for s, rs in by_sig.items()},
                           "majority": majority, "frames": frames_of}
        out = []
        g = self.groups[gi]
        for odd, c in sorted(causes.items(), key=lambda kv: kv[1]["first"]):
            p = c["first"]
            details = {s: self.details.get(s) for s in c["by_sig"]}
            fields = self._differing(details)
            parts, per_rank = [], {}
            order = sorted(c["by_sig"].items(), key=lambda kv: (kv[0] != c["majority"], kv[1][0]))
            for s, rs in order:
                d = details.get(s)
                row = self._detail_row(d, p, c["frames"].get(rs[0], -1), rs[0])
                parts.append(f"{_ranks_text(rs)} issued {self._brief(row) if row else '?'}{self._at(row)}")
                for r in rs[:SHOWN]:
                    per_rank[str(r)] = self._row_json(self._detail_row(d, p, c["frames"].get(r, -1), r))
            later = [q for q in c["positions"] if q != p]
            text = (f"collective #{p} of {g.label()} differs in {', '.join(fields) or 'signature'}: "
                    + "; ".join(parts[:SHOWN]) + (f"; +{len(parts) - SHOWN} more" if len(parts) > SHOWN else ""))
            if later:
                text += (f"; {len(later)} later position(s) of the group differ for the same ranks (from #{later[0]}"
                         f"): their sequences stay apart after it")
            lost = self._lost(gi, p)
            if lost:
                text += (f"; {_ranks_text(lost)}: the ring no longer holds #{p} (overwritten before it: "
                         f"{BUFFER_FIX})")
            odd_row = self._detail_row(details.get(next(s for s, rs in order if rs[0] in odd) if odd else -1),
                                       p, c["frames"].get(odd[0], -1), odd[0]) if odd else None
            text += (". Fix: every rank of the group must issue the same collective at the same point: look for a "
                     "rank-dependent branch or shape around these lines")
            out.append(Finding("collective_mismatch", list(odd) or sorted(self.members(gi)), text,
                               {"group": g.name, "desc": g.desc, "ring": g.ring, "position": p, "fields": fields,
                                "positions": len(c["positions"]), "later_positions": later[:16],
                                "ranks_detail": per_rank, "overwritten": lost[:64], **self._site(odd_row)}))
        return out

    def _detail_row(self, d: tuple[int, int, int, int, int] | None, p: int, frames: int, rank: int) -> _Row | None:
        if d is None:
            return None
        op, ins, outs, idt, odt = d
        return _Row(rank, p, op, ins, outs, idt, odt, frames, -1, False, False, -1, 0, 0, 0, 0, -1)

    def _differing(self, details: dict[int, tuple[int, int, int, int, int] | None]) -> list[str]:
        ds = [d for d in details.values() if d is not None]
        fields = []
        names = ("op", "input sizes", "output sizes", "input dtypes", "output dtypes")
        for k, name in enumerate(names):
            if k == 0:
                vals = {self._op_name(d[0]) for d in ds}
            elif k in (1, 2):
                vals = {d[k] for d in ds}
            else:
                vals = {d[k] for d in ds}
            if len(vals) > 1:
                fields.append(name)
        if "op" in fields:
            return ["op"] + [f for f in fields if f != "op"]
        return fields

    def _a2a_pairs(self, gi: int) -> list[Finding]:
        """An all_to_all whose ring holds each peer's tensor (the list form): what rank i sends to j must be what
        j receives from i. The single-tensor form holds totals only: the group's totals must balance."""
        members = self.members(gi)
        n = len(members)
        index = {r: k for k, r in enumerate(members)}
        by_pos: dict[int, dict[int, tuple[int, int]]] = {}
        for rank, pos, ins, outs in self.a2a[gi]:
            for p, a, b in zip(pos.tolist(), ins.tolist(), outs.tolist()):
                by_pos.setdefault(p, {})[rank] = (a, b)
        causes: dict[tuple[int, ...], tuple[int, list[PairMismatch], dict[int, tuple[int, int]]]] = {}
        counts: Counter = Counter()
        g = self.groups[gi]
        for p in sorted(by_pos):
            have = by_pos[p]
            if len(have) != n or set(have) - set(index):
                continue  # a member's ring does not hold it: nothing to pair
            shapes = {r: (_listed(self.sizes.items[a]) if a >= 0 else None,
                          _listed(self.sizes.items[b]) if b >= 0 else None) for r, (a, b) in have.items()}
            if all(isinstance(s[0], list) and len(s[0]) == n and isinstance(s[1], list) and len(s[1]) == n
                   and n > 1 for s in shapes.values()):
                pairs = [PairMismatch(i, j, shapes[i][0][index[j]], shapes[j][1][index[i]])
                         for i in members for j in members if shapes[i][0][index[j]] != shapes[j][1][index[i]]]
            else:
                sent = sum(_numel(s[0]) for s in shapes.values())
                got = sum(_numel(s[1]) for s in shapes.values())
                if sent == got:
                    continue
                pairs = []
                key = ("totals",)
                counts[key] += 1
                if key not in causes:
                    causes[key] = (p, [], have)  # type: ignore[index]
                continue
            if not pairs:
                continue
            key = tuple(blamed(pairs, members))
            counts[key] += 1
            if key not in causes:
                causes[key] = (p, pairs, have)
        out = []
        for key, (p, pairs, have) in causes.items():
            rows = {r: self._progress_row(r, gi, p) for r in have}
            if not pairs:
                text = (f"all_to_all #{p} of {g.label()} does not balance: the group's ranks send "
                        f"{sum(_numel(_listed(self.sizes.items[a])) for a, _ in have.values())} elements in total "
                        f"but receive {sum(_numel(_listed(self.sizes.items[b])) for _, b in have.values())} (the "
                        "ring holds each rank's totals only, not its per-peer splits). Fix: " + SPLIT_FIX)
                out.append(Finding("collective_mismatch", sorted(have), text,
                                   {"group": g.name, "position": p, "fields": ["shapes"],
                                    "positions": counts[key], **self._site(rows.get(min(have)))}))
                continue
            events = {r: _SplitView(shapes_of(self, have[r]), self._at(rows.get(r)).removeprefix(" at ") or None)
                      for r in have}
            text = (f"all_to_all #{p} of {g.label()}: the per-peer sizes do not pair up: "
                    f"{describe_pairs(pairs, events, members)}"
                    + (f"; {counts[key] - 1} later all_to_all(s) of the group too" if counts[key] > 1 else "")
                    + f". Fix: {LIST_FIX}")
            blame = list(key)
            out.append(Finding("collective_mismatch", blame, text,
                               {"group": g.name, "position": p, "fields": ["shapes"], "positions": counts[key],
                                "pairs": [q.to_json() for q in pairs[:64]], **self._site(rows.get(blame[0]))}))
        return out

    def _progress_row(self, rank: int, gi: int, p: int) -> _Row | None:
        prog = self.progress.get((rank, gi))
        if prog is None:
            return None
        for row in (prog.open_row, prog.last_row, prog.done_row):
            if row is not None and row.seq == p:
                return row
        return prog.last_row

    # --- hangs -------------------------------------------------------------------------------------------------

    def _stuck(self, gi: int) -> _Stuck | None:
        members = self.members(gi)
        opens = [(p.open_first, r) for r in members if (p := self.progress.get((r, gi))) is not None
                 and p.open_first is not None]
        if not opens:
            return None
        pos = min(o for o, _ in opens)
        st = _Stuck(gi, pos, [], [], [], [], [], {})
        for r in members:
            prog = self.progress.get((r, gi))
            info = self.ranks.get(r)
            if info is None:
                st.no_dump.append(r)
                continue
            if prog is None:
                enqueued = self._enqueued(info, gi)
                if enqueued is not None and enqueued >= pos or enqueued is None and info.first_record > 0 \
                        and not info.pg_status:
                    st.unknown.append(r)  # it issued it (its counter says so, or nothing says) but its ring lost it
                else:
                    st.absent.append(r)
                continue
            if prog.last < pos:
                if info.cut:
                    st.cut.append(r)  # its file ends before what it issued last
                    continue
                st.absent.append(r)
                st.rows[r] = prog.last_row
                continue
            if prog.first > pos:  # the ring starts after it: it went past it long ago
                st.completed.append(r)
                continue
            is_open = prog.open_first is not None and (pos in prog.open_positions or (
                prog.open_first <= pos and prog.n_open > len(prog.open_positions)))
            if is_open:
                st.waiting.append(r)
                st.rows[r] = prog.open_row if prog.open_row is not None and prog.open_row.seq == pos \
                    else prog.last_row
            else:
                st.completed.append(r)
        for r in st.absent:
            info = self.ranks[r]
            if info.current is not None and info.current_group != gi:
                st.blocked_by.add(info.current_group)
        return st

    def _enqueued(self, info: _RankInfo, gi: int) -> int | None:
        """The group's enqueued counter in the rank's pg_status (keyed by pg_id, which the other ranks' entries of
        the group give), or None where it has none for it."""
        ids = self.group_pg_ids.get(gi)
        if not ids:
            return None
        status = info.pg_status.get(str(ids.most_common(1)[0][0]))
        return None if status is None else int(status.get("last_enqueued_collective", -1))

    def _hangs(self, mismatch_at: dict[int, set[int]], findings: list[Finding]) -> list[Finding]:
        stucks = {gi: st for gi in range(len(self.groups)) if (st := self._stuck(gi)) is not None}
        # A group whose absent ranks all wait in another group's collective is that group's consequence (unless
        # the two wait for each other: then both are named).
        def reaches(a: int, b: int, seen: set[int]) -> bool:
            if a == b:
                return True
            seen.add(a)
            st = stucks.get(a)
            return st is not None and any(x not in seen and reaches(x, b, seen) for x in st.blocked_by)

        consequence: dict[int, list[int]] = {}
        for gi, st in stucks.items():
            hs = [h for h in sorted(st.blocked_by) if h in stucks and not reaches(h, gi, set())]
            if not st.absent or not hs:
                continue
            # Each rank the group waits for waits in one of those groups, or is what one of them waits for.
            if all(any(self.ranks[a].current_group == h or a in stucks[h].absent or a in stucks[h].no_dump
                       for h in hs) for a in st.absent):
                consequence.setdefault(hs[0], []).append(gi)
        folded = {g for gs in consequence.values() for g in gs}
        out = []
        for gi, st in sorted(stucks.items(), key=lambda kv: kv[0]):
            if gi in folded or self._in_flight(st) and st.pos not in mismatch_at.get(gi, set()):
                continue
            if st.pos in mismatch_at.get(gi, set()):
                self._fold_into_mismatch(findings, gi, st)
                continue
            out.append(self._hang_finding(st, [stucks[c] for c in consequence.get(gi, [])]))
        return out

    def _fold_into_mismatch(self, findings: list[Finding], gi: int, st: _Stuck) -> None:
        name = self.groups[gi].name
        for f in findings:
            if f.kind == "collective_mismatch" and f.detail.get("group") == name and \
                    f.detail.get("position") == st.pos:
                f.message = f.message.replace(". Fix:", f"; {self._waits(st)}. Fix:", 1)
                f.detail["hang"] = {"waiting": st.waiting, "absent": st.absent}
                return
        for f in findings:
            if f.kind == "collective_mismatch" and f.detail.get("group") == name:
                f.detail.setdefault("hang", {"position": st.pos, "waiting": st.waiting, "absent": st.absent})
                return

    def _waits(self, st: _Stuck) -> str:
        if not st.waiting:
            return "the job then hangs there"
        row = st.rows.get(st.waiting[0])
        verb = "waits" if len(st.waiting) == 1 else "wait"
        return (f"{_ranks_text(st.waiting)} then {verb} in it{self._timeout(st)}" if row is not None
                else f"{_ranks_text(st.waiting)} then {verb}")

    def _wait(self, st: _Stuck) -> tuple[float, int, bool, bool]:
        """(the longest wait in seconds, its timeout_ms, whether it timed out, whether the wait is known), over the
        waiting ranks: measured from the entry's start (its creation where no start was discovered) to when the
        rank's dump was written (its file's mtime). NCCL's watchdog retires a collective it timed out."""
        worst: tuple[float, int, bool, bool] | None = None
        for r in st.waiting:
            row, info = st.rows.get(r), self.ranks.get(r)
            if row is None or info is None:
                continue
            since = row.t_started or row.created
            known = bool(info.dumped_ns and since)
            waited = max(0.0, (info.dumped_ns - since) / 1e9) if known else 0.0
            timed = (row.retired == 1 and not row.completed and self.groups[st.group].ring != "gloo") or (
                known and row.timeout_ms > 0 and waited * 1000 >= row.timeout_ms)
            if worst is None or (timed, waited) > (worst[2], worst[0]):
                worst = (waited, row.timeout_ms, timed, known)
        return worst or (0.0, 0, False, False)

    def _timeout(self, st: _Stuck) -> str:
        """", timed out (waited 35 s, timeout 30 s)" or ", waiting 12 s when the dump was written (timeout 600 s)"."""
        waited, timeout_ms, timed, known = self._wait(st)
        limit = f"timeout {timeout_ms / 1000:g} s" if timeout_ms else "no timeout recorded"
        if timed:
            return f", timed out ({f'waited {waited:.0f} s, ' if waited >= 1 else ''}{limit})"
        if known and waited >= 1:
            return f", waiting {waited:.0f} s when the dump was written ({limit})"
        return ""

    def _in_flight(self, st: _Stuck) -> bool:
        """A dump of a job that runs (the debug server's, or one on request) holds the collectives in flight and
        ranks a step apart: not a hang unless the wait has lasted (its timeout, or a minute) or the times are
        unknown (then the dump is taken to be the watchdog's, written at a hang)."""
        waited, timeout_ms, timed, known = self._wait(st)
        return known and not timed and waited < min(IN_FLIGHT_S, timeout_ms / 1000 if timeout_ms else IN_FLIGHT_S)

    def _hang_finding(self, st: _Stuck, consequences: list[_Stuck]) -> Finding:
        g = self.groups[st.group]
        ref = next((st.rows[r] for r in st.waiting if r in st.rows), None)
        what = self._brief(ref) if ref is not None and ref.seq == st.pos else f"collective #{st.pos}"
        where = f"{what} of {g.label()}{self._at(ref)}"
        detail: dict[str, Any] = {"group": g.name, "desc": g.desc, "ring": g.ring, "position": st.pos,
                                  "waiting": st.waiting, "absent": st.absent, "without_dump": st.no_dump,
                                  "completed": st.completed, "unknown": st.unknown,
                                  "rows": {str(r): self._row_json(row) for r, row in list(st.rows.items())[:SHOWN * 2]}}
        verb = "waits" if len(st.waiting) == 1 else "wait"
        waits = f"{_ranks_text(st.waiting)} {verb} in {where}{self._timeout(st)}" if st.waiting else \
            f"{g.label()} stalls at #{st.pos}"
        if st.absent:
            culprits = st.absent
            parts = [self._elsewhere(r, st) for r in st.absent[:SHOWN]]
            more = f"; +{len(st.absent) - SHOWN} more" if len(st.absent) > SHOWN else ""
            text = f"{waits}; {_ranks_text(st.absent)} never issued it: {'; '.join(parts)}{more}"
            detail["cause"] = "never_issued"
            site_row = self.ranks[st.absent[0]].current or st.rows.get(st.absent[0])
        elif st.no_dump:
            culprits = st.no_dump
            one = len(st.no_dump) == 1
            text = (f"{waits}; {_ranks_text(st.no_dump)} left no dump: {'the rank' if one else 'the ranks'} the "
                    f"others wait for ({'it' if one else 'they'} died, hung without {'its' if one else 'their'} "
                    f"watchdog dumping, or {'its' if one else 'their'} file was not collected: look at "
                    f"{'its' if one else 'their'} log)")
            detail["cause"] = "without_dump"
            site_row = ref
        elif st.completed:
            culprits = st.waiting
            states = {self.states.items[st.rows[r].state] if r in st.rows and st.rows[r].state >= 0 else "?"
                      for r in st.waiting}
            its = "its" if len(st.waiting) == 1 else "their"
            text = (f"{waits}, which {_ranks_text(st.completed)} completed: {_ranks_text(st.waiting)} issued it "
                    f"and never completed it (state {'/'.join(sorted(states))}): {its} GPU has not run it yet, "
                    f"something before it on {its} stream is stuck (a kernel or another group's collective)")
            detail["cause"] = "behind_on_gpu"
            site_row = ref
        else:
            started = [r for r in st.waiting if r in st.rows and st.rows[r].started]
            not_started = [r for r in st.waiting if r not in started]
            if started and not_started:
                culprits = not_started
                its = "its" if len(not_started) == 1 else "their"
                text = (f"{waits}: every rank issued it; {_ranks_text(started)} started it on the GPU, "
                        f"{_ranks_text(not_started)} never did (state scheduled): {its} stream is stuck before it "
                        "(a kernel or another collective ahead of it)")
                detail["cause"] = "not_started"
            else:
                culprits = st.waiting
                timing = "" if started else (" (no rank shows it started: without TORCH_NCCL_ENABLE_TIMING=1 NCCL "
                                             "records no start, so a stuck kernel and a queued one look alike)")
                text = (f"{waits}: every rank issued it and none completed it: no rank is missing or elsewhere, so "
                        "the collective itself does not finish: the network or NCCL (a link, a peer's NIC, "
                        f"NCCL_DEBUG=INFO tells), or a GPU that no longer runs kernels{timing}")
                detail["cause"] = "not_completing"
            site_row = ref
        if st.unknown:
            text += (f"; {_ranks_text(st.unknown)}: the ring no longer holds the group's entries ({BUFFER_FIX})")
        if st.cut:
            text += f"; {_ranks_text(st.cut)}: the dump file is cut off before it (its newest entries are missing)"
            detail["cut"] = st.cut
        if consequences:
            others = "; ".join(f"{self.groups[c.group].label()} #{c.pos} ({_ranks_text(c.waiting)} wait)"
                               for c in consequences[:SHOWN])
            text += f"; this also holds up {others}"
            detail["also_blocks"] = [{"group": self.groups[c.group].name, "position": c.pos, "waiting": c.waiting}
                                     for c in consequences]
        detail.update(self._site(site_row))
        return Finding("hang", culprits, text, detail)

    def _elsewhere(self, r: int, st: _Stuck) -> str:
        info = self.ranks[r]
        cur = info.current
        if cur is not None and info.current_group != st.group:
            h = self.groups[info.current_group]
            return f"rank {r} waits in {self._brief(cur)} of {h.label()}{self._at(cur)}"
        last = st.rows.get(r)
        if last is None:
            return f"rank {r} issued nothing on the group (its ring holds {info.rows} entries)"
        done = "completed" if last.completed else "not completed"
        return (f"rank {r}'s last collective on the group is {self._brief(last)}{self._at(last)} ({done}): it is "
                "elsewhere in its code (a CPU-side divergence: a branch, a data loader, host code)")

    def _p2p_hangs(self) -> list[Finding]:
        out = []
        for key, sides in list(self.p2p.items()):
            gi, src, dst = key
            for side, entry in sides.items():
                open_i = [i for i in range(len(entry.seqs)) if not entry.completed[i]]
                if open_i:
                    self.p2p_unmatched.append((gi, src, dst, side, entry.row(open_i[0])))
        for gi, src, dst, side, row in self.p2p_unmatched:
            g = self.groups[gi]
            info = self.ranks.get(row.rank)
            since = row.t_started or row.created
            if info is not None and info.dumped_ns and since and row.retired != 1 and \
                    (info.dumped_ns - since) / 1e9 < min(IN_FLIGHT_S, row.timeout_ms / 1000 or IN_FLIGHT_S):
                continue  # in flight
            me, peer = (src, dst) if side == "send" else (dst, src)
            verb = "sends to" if side == "send" else "receives from"
            other = "receive" if side == "send" else "send"
            if peer not in self.ranks:
                why = f"rank {peer} left no dump"
            else:
                cur = self.ranks[peer].current
                where = (f": rank {peer} waits in {self._brief(cur)} of "
                         f"{self.groups[self.ranks[peer].current_group].label()}{self._at(cur)}") if cur else ""
                why = f"rank {peer} never posted the matching {other}{where}"
            out.append(Finding(
                "hang", [peer],
                f"rank {me} waits in {self._op_name(row.op)} (p2p #{row.p2p_seq}, {self._sizes(row.ins if side == 'send' else row.outs, row.idt)}) "
                f"that {verb} rank {peer} on {g.label()}{self._at(row)}; {why}",
                {"group": g.name, "src": src, "dst": dst, "side": side, "cause": "p2p_unmatched",
                 "row": self._row_json(row), **self._site(row)}))
        return out

    # --- warnings ----------------------------------------------------------------------------------------------

    def _warnings(self) -> list[Note]:
        notes = list(self.notes)
        no_dump = [r for r in self._no_dump() if r not in self.failed]
        if no_dump:
            notes.append(Note("files_incomplete", no_dump,
                              f"{_ranks_text(no_dump)} left no dump: what they did is unknown (a rank that died, or "
                              "whose dump was not collected); the findings name them where the others wait for "
                              "them", {"ranks": rank_ranges(no_dump)}))
        for rank, (path, reason) in sorted(self.failed.items())[:64]:
            notes.append(Note("files_incomplete", [rank], f"{path} {reason}: rank {rank} counts as without a dump",
                              {"path": path}))
        for info in sorted(self.ranks.values(), key=lambda i: i.rank):
            if info.problem:
                notes.append(Note("files_incomplete", [info.rank], f"{info.path} {info.problem}",
                                  {"path": info.path}))
        for path, why in self.skipped[:64]:
            notes.append(Note("files_incomplete", [], f"{path} not read: {why}", {"path": path}))
        versions = Counter(i.version for i in self.ranks.values())
        if len(versions) > 1:
            (common, _), *rest = versions.most_common()
            odd = sorted(i.rank for i in self.ranks.values() if i.version != common)
            notes.append(Note("dump_versions", odd,
                              f"dumps of different format versions: {_ranks_text(odd)} wrote "
                              f"{', '.join(v for v, _ in rest)}, the others {common} (compared field by field "
                              "anyway: ranks that ran different torch builds are suspect themselves)", {}))
        wrapped = sorted(i.rank for i in self.ranks.values() if i.first_record > 0)
        if wrapped:
            notes.append(Note("ring_overwritten", wrapped,
                              f"the rings of {_ranks_text(wrapped)} had wrapped: their oldest entries are gone "
                              f"(positions before what each holds cannot be compared; {BUFFER_FIX})",
                              {"ranks": rank_ranges(wrapped)}))
        return notes


@dataclass
class _Combos:
    """A ring's combinations of op, sizes and dtypes (the job's ids), their signatures and groups."""

    op: np.ndarray
    ins: np.ndarray
    outs: np.ndarray
    idt: np.ndarray
    odt: np.ndarray
    sig: np.ndarray
    group: np.ndarray

    def detail(self, c: int) -> tuple[int, int, int, int, int]:
        return int(self.op[c]), int(self.ins[c]), int(self.outs[c]), int(self.idt[c]), int(self.odt[c])


class _RowMaker:
    """Makes the _Row of one entry of a ring (only for the few entries the messages may name)."""

    def __init__(self, pm: Postmortem, ring: Any, combo: _Combos, completed: np.ndarray, started: np.ndarray
                 ) -> None:
        self.pm, self.ring, self.combo = pm, ring, combo
        self.completed, self.started = completed, started

    def __call__(self, i: int) -> _Row:
        ring, pm = self.ring, self.pm
        op, ins, outs, idt, odt = self.combo.detail(int(ring.combo[i]))
        frames = int(ring.ids["frames"][i])
        state = int(ring.ids["state"][i])
        ints = ring.ints
        return _Row(ring.rank, int(ints["collective_seq_id"][i]), op, ins, outs, idt, odt,
                    pm.frames.gid(ring.values["frames"][frames]) if frames >= 0 else -1,
                    pm.states.gid(ring.values["state"][state]) if state >= 0 else -1,
                    bool(self.completed[i]), bool(self.started[i]), int(ring.flags["retired"][i]),
                    int(ints["time_created_ns"][i]), int(ints["time_discovered_started_ns"][i]),
                    int(ints["time_discovered_completed_ns"][i]), int(ints["timeout_ms"][i]),
                    int(ints["record_id"][i]), int(ints["p2p_seq_id"][i]))


@dataclass
class _SplitView:
    """What split_matrix.describe reads of an event: the per-peer shapes it sends and receives, and its line."""

    split: dict[str, Any]
    site: str | None

    @property
    def extra(self) -> dict[str, Any]:
        return {"split": self.split}


def shapes_of(pm: Postmortem, ids: tuple[int, int]) -> dict[str, Any]:
    a, b = ids
    return {"send": _listed(pm.sizes.items[a]) if a >= 0 else [], "recv": _listed(pm.sizes.items[b]) if b >= 0 else [],
            "unit": None}


def _listed(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_listed(v) for v in value]
    return value


def _numel(shapes: Any) -> int:
    total = 0
    for s in shapes or []:
        n = 1
        for d in s if isinstance(s, list) else [s]:
            n *= int(d) if isinstance(d, int) else 1
        total += n
    return total


def _ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0-2,5``; a long strided list (a DP group of a 4,096-rank job) as ``512 ranks (2,10,18,
    ...,4090)``: the finding's ranks list holds them all."""
    ranks = sorted(set(ranks))
    text = format_ranks(ranks)
    if len(text) <= 60:
        return text
    return f"{len(ranks)} ranks ({','.join(map(str, ranks[:3]))},...,{ranks[-1]})"


def _short(ranks: list[int]) -> str:
    return f"[{rank_ranges(ranks)}]" if len(ranks) > 8 else str(ranks)
