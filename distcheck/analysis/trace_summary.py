"""Big jobs' traces in time and memory linear in the records: per-rank summaries, read incrementally.

    from distcheck.analysis.trace_events import load_traces
    traces = load_traces("report")   # summarized by itself beyond trace_events.FULL_LIMIT / TOTAL_LIMIT records

A 4096-rank job that ran 20,000 collectives wrote 82 million records. Made into one TraceEvent each (every one
holding its group's 4096 ranks) they took hours and terabytes; most of them say only "the same as the peers".
Here a rank's records (contract/trace_slots.py) are read with numpy, a group's rank list is parsed once per
process (rank_trace._pg_tuple), and each rank's trace becomes a :class:`TraceSummary`:

* counts (started, completed, failed, issued-only, open) and, per process group (:attr:`TraceEvent.group_key`),
  how many it issued and completed there, and the first position where its call signatures
  (call_signature.signature, numbered by the :class:`Aligner`) differ from the load's reference: what the first rank
  to reach each position issued there. Where two members of a group differ, one of them differs from that
  reference, so the alignment (trace_align.find_divergences) starts at the earliest such position, or at the
  shortest member's end, and nothing before it can differ;
* events only for what a question about the rank needs: its last TAIL collectives, the first it has not ended,
  each group's last and first open one, its last completed, every failed one and every point-to-point op (they
  pair per peer, not by position). RankTrace.events holds those; analysis/progress.py takes its references from
  them and its counts from the summary;
* the slot of every STRIDE-th position of each group, so that :meth:`TraceSummary.events_at` reads any position
  back from between two of them, not from the whole file.

A :class:`TraceFollower` (one per report directory, kept between loads) reads each rank's files from where it
stopped: the JSON lines appended since, the records appended since, and again the records that had not ended
(their end is stored in place). The watch loop's stop check (stop_rule.provably_stuck on load_traces) then costs
what the ranks did since the last check, not what they did since the start. A trace file replaced since (a new
run in a reused directory) starts the directory over; an end line for a record already read (an error), a record
written into a slot the last read found empty, or a cut that moved start that rank over.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distcheck.analysis.call_signature import signature
from distcheck.analysis.rank_trace import (Incomplete, RankTrace, TraceEvent, _event, _Lines, _lost_sig,
                                           _read_lines, header_state, sequence_key)
from distcheck.analysis.ops import PEER_OPS
from distcheck.contract import files
from distcheck.contract import trace_reader
from distcheck.contract import trace_slots

TAIL = 2  # the last collectives a summarized trace keeps, besides those its questions need
STRIDE = 256  # a group's sequence remembers the slot of every STRIDE-th position, to read any position back
FOLLOWED_DIRS = 4  # report directories whose followers are kept between loads


class Aligner:
    """The reference the summarized traces of one report directory compare against: per process group, the
    signature number at each position, as the first rank to reach it issued it."""

    def __init__(self) -> None:
        self._signatures: dict[Any, int] = {}
        self._fast: dict[tuple, int] = {}
        self._refs: dict[str, Any] = {}  # group key -> numpy array of signature numbers

    def signature_number(self, desc: dict[str, Any], rank: int) -> int:
        # What signature() reads of a call, cheap to key on: every rank's sig lines repeat a few calls.
        fast = (desc.get("op"), str(desc.get("shapes")), str(desc.get("dtypes")), desc.get("reduce_op"),
                desc.get("root"), str(desc.get("objects")), bool(desc.get("uneven")))
        hit = self._fast.get(fast)
        if hit is not None:
            return hit
        sig = signature(_event(rank, desc, 0, 0, 0.0))
        try:
            number = self._signatures.setdefault(sig, len(self._signatures) + 1)
        except TypeError:  # an unhashable extra: its repr is the signature
            number = self._signatures.setdefault(repr(sig), len(self._signatures) + 1)
        self._fast[fast] = number
        return number

    def first_difference(self, key: str, numbers: Any, start: int) -> int | None:
        """The first position (0-based) from ``start`` where ``numbers`` (a rank's signatures at positions
        ``start`` on) differ from the reference of ``key``, which grows with them; None: none as far as both go."""
        import numpy as np

        ref = self._refs.get(key)
        if ref is None:
            ref = np.zeros(0, numbers.dtype)
        end = start + len(numbers)
        if len(ref) < end:
            if len(ref) < start:  # (a rank started over): a gap no signature matches keeps the bound safe
                ref = np.concatenate([ref, np.full(start - len(ref), -1, numbers.dtype)])
            ref = self._refs[key] = np.concatenate([ref, numbers[len(ref) - start:]])
        diff = np.flatnonzero(ref[start:end] != numbers)
        return start + int(diff[0]) if diff.size else None


@dataclass
class SequenceSummary:
    """A summarized rank's traced collectives on one process group (TraceEvent.group_key)."""

    key: str
    count: int  # collectives it issued there
    completed: int  # of those, ended without error (issued-only included)
    first_difference: int | None  # 0-based position where it first differs from the reference (Aligner)
    checkpoints: list[int]  # the slot of position i * STRIDE, for reading any position back


@dataclass
class TraceSummary:
    """The counts of a long trace (:attr:`RankTrace.summary`), its sequences, and its events at any position, read
    back from the record file on demand (:meth:`events_at`)."""

    started: int
    completed: int  # ended without error (issued-only included)
    failed: int
    issued_only: int
    open: int
    sequences: dict[str, SequenceSummary]
    rank: int
    path: str | None
    sigs: dict[int, dict[str, Any]]
    ends: dict[int, dict[str, Any]]  # JSON end lines by id
    until: int | None  # the first slot not to read (a cut trace)
    kept: dict[int, TraceEvent]  # events already made, by id
    read: dict[int, TraceEvent] = field(default_factory=dict)  # events read back since (events_at)

    def events_at(self, key: str, lo: int, hi: int) -> dict[int, TraceEvent]:
        """The rank's events at positions ``lo`` to ``hi - 1`` (0-based) of sequence ``key``, read from the slots
        between two checkpoints (not the whole file)."""
        import numpy as np

        seq = self.sequences.get(key)
        hi = min(hi, seq.count if seq is not None else 0)
        if seq is None or lo >= hi or self.path is None:
            return {}
        first = lo // STRIDE
        slot_lo = seq.checkpoints[first]
        last = (hi - 1) // STRIDE + 1
        slot_hi = seq.checkpoints[last] if last < len(seq.checkpoints) else None
        try:
            data = trace_reader.read_slots(self.path, slot_lo, None if slot_hi is None else slot_hi - slot_lo)
        except OSError:
            return {}
        arr = np.frombuffer(data, trace_slots.slot_dtype(), count=len(data) // trace_slots.SIZE)
        slots = np.arange(slot_lo, slot_lo + len(arr))
        mine = np.array(sorted(n for n, d in self.sigs.items() if _alignable(d) and _group_of(d) == key), np.uint32)
        mask = (arr["kind"] != 0) & np.isin(arr["sig"], mine)
        if self.until is not None:
            mask &= slots < self.until
        out: dict[int, TraceEvent] = {}
        for pos, i in enumerate(np.flatnonzero(mask), first * STRIDE):
            if pos < lo:
                continue
            if pos >= hi:
                break
            slot = int(slots[i])
            e = self.kept.get(slot) or self.read.get(slot)
            if e is None:
                rec = arr[i]
                e = self.read[slot] = _record_event(self.rank, self.sigs[int(rec["sig"])], slot, pos + 1,
                                                    float(rec["t"]), float(rec["t_end"]),
                                                    bool(int(rec["flags"]) & trace_slots.ISSUED), self.ends.get(slot))
            out[pos] = e
        return out


def _alignable(desc: dict[str, Any]) -> bool:
    return str(desc.get("op")) not in PEER_OPS


def _group_of(desc: dict[str, Any]) -> str:
    """TraceEvent.group_key of a traced call, from its sig line."""
    return desc.get("pg_name") or (desc.get("pg") if isinstance(desc.get("pg"), str)
                                   else ",".join(map(str, desc.get("pg") or ())))


def _record_event(rank: int, desc: dict[str, Any], slot: int, seq: int, t: float, t_end: float, issued: bool,
                  end: dict[str, Any] | None) -> TraceEvent:
    event = _event(rank, desc, slot, seq, t)
    event.t_end = t_end or None
    event.issued_only = issued and event.t_end is not None
    if end is not None:  # JSON ends carry errors: they win over the record
        try:
            event.t_end = float(end.get("t", 0.0))
            event.error = end.get("error")
            event.issued_only = bool(end.get("issued", False))
        except (TypeError, ValueError):
            pass
    return event


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


@dataclass
class _Group:
    """A follower's state of one sequence (trace_events.sequence_key): a process group's, or a peer pair's."""

    key: str | None  # TraceEvent.group_key; None: point-to-point (not aligned by position)
    count: int = 0
    completed: int = 0
    first_difference: int | None = None
    checkpoints: list[int] = field(default_factory=list)
    last: tuple[int, int, int] | None = None  # (slot, position, sig) of its last collective


class _StartOver(Exception):
    """A rank's files changed in a way that only reading them again from the start takes."""


class _NewRun(Exception):
    """A trace file was replaced (a new run in a reused report directory): the directory starts over."""


class RankFollower:
    """One rank's summarized trace, read incrementally (see the module docstring)."""

    def __init__(self, rank: int, trace_path: Path, aligner: Aligner) -> None:
        self.rank = rank
        self.trace_path = trace_path
        self.bin_path = files.rank_file(trace_path.parent, "trace_events", rank)
        self.aligner = aligner
        self.identity: tuple[int, int] | None = None
        self._start()

    def _start(self) -> None:
        self.lines = _Lines({}, [], [], {}, {}, [], None)
        self.line_pos = 0
        self.ends_seen = 0
        self.ends: dict[int, dict[str, Any]] = {}  # JSON end lines by slot
        self.next_slot = 1  # the first record slot not read yet
        self.holes: list[int] = []  # empty slots before a written one: claimed, not yet written
        self.until: int | None = None  # the first slot not recorded (a cut trace)
        self.lost_from: int | None = None  # the first record whose sig line was lost
        self.groups: list[_Group] = []
        self.group_of_key: dict[Any, int] = {}
        self.sig_group: dict[int, int] = {}
        self.sig_number: dict[int, int] = {}
        self.started = self.completed = self.failed = self.issued_only = 0
        self.open: dict[int, tuple[int, int, int]] = {}  # slot -> (group index, position, sig): not ended yet
        self.last_done: tuple[int, int, int, int] | None = None  # (slot, group index, position, sig)
        self.tail: list[tuple[int, int, int, int]] = []
        self.kept: dict[int, TraceEvent] = {}
        self.forever: set[int] = set()  # kept whatever comes: failed and point-to-point ops

    def read(self) -> RankTrace | None:
        """The rank's trace now, from what was appended since the last read; None: a trace this summary does not
        take (JSON start lines of old, or NCCL ends left to the Flight Recorder), which a full read must."""
        try:
            return self._read()
        except _StartOver:
            self._start()
            return self._read()

    # -- the JSON lines ---------------------------------------------------------------------------------------
    def _read_new_lines(self) -> bool:
        """Read the lines appended since; False: there is no trace file."""
        try:
            appended = trace_reader.read_appended(self.trace_path, self.line_pos, self.identity)
        except trace_reader.Replaced:
            raise _NewRun() from None
        if appended is None:
            return False
        chunk, self.identity = appended
        whole = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.line_pos += whole
        _read_lines(chunk[:whole].split(b"\n"), self.rank, self.lines)
        for rec in self.lines.ends[self.ends_seen:]:
            try:
                slot = int(rec["id"])
            except (KeyError, TypeError, ValueError):
                continue
            if slot < self.next_slot:
                raise _StartOver()  # an end (an error) for a record read already
            self.ends[slot] = rec
        self.ends_seen = len(self.lines.ends)
        return True

    # -- the records ------------------------------------------------------------------------------------------
    def _read(self) -> RankTrace | None:
        import numpy as np

        if not self._read_new_lines():
            return RankTrace(self.rank, [], [], {}, None)
        if self.lines.order:
            return None
        try:
            records: trace_reader.RecordFile | None = trace_reader.RecordFile(self.bin_path)
        except OSError:
            records = None
        head: bytes | None = None
        try:
            if records is not None:
                head = records.read(0, 1)
            incomplete, finished, state = header_state(head, self.rank, self.lines)
            if records is not None and trace_slots.read_header(head or b"") is not None:
                until = incomplete.from_id if incomplete is not None else None
                if until != self.until and until is not None and until < self.next_slot:
                    raise _StartOver()  # the cut came before what was read
                self.until = until
                self._recheck(records)
                if self.lost_from is None:
                    self._read_records(records, np)
        finally:
            if records is not None:
                records.close()
        if self._ends_assumed():
            return None
        if self.lost_from is not None:
            incomplete = _lost_sig(incomplete, self.lost_from)
        return self._trace(incomplete, finished, state)

    def _ends_assumed(self) -> bool:
        """Whether a group has more than one NCCL call still waiting for the end NCCL's ring gives it (rank/tracer.py
        leaves synchronous NCCL calls to the ring; the rank stores the ends in its record file at its dump): the full
        load assumes ends there (flight_recorder._assume_ends), which the summary does not."""
        ring = {n for n, d in self.lines.sigs.items() if d.get("completion") == "flight_recorder"}
        if not ring:
            return False
        seen: set[int] = set()
        for gi, _, sig in self.open.values():
            if sig in ring:
                if gi in seen:
                    return True
                seen.add(gi)
        return False

    def _recheck(self, records: trace_reader.RecordFile) -> None:
        """The records that had not ended, and the slots that were empty, read again."""
        for slot in self.holes:
            if records.read(slot, 1)[:1] not in (b"", b"\0"):
                raise _StartOver()  # a record written into a slot claimed before a later one: positions moved
        if not self.open:
            return
        slots = sorted(self.open)
        if len(slots) <= 64:
            found = {}
            for slot in slots:
                found[slot] = records.read(slot, 1)
        else:  # many open (async ops never waited): one read across them
            data = records.read(slots[0], slots[-1] - slots[0] + 1)
            found = {s: data[(s - slots[0]) * trace_slots.SIZE:(s - slots[0] + 1) * trace_slots.SIZE] for s in slots}
        for slot, raw in found.items():
            if len(raw) < trace_slots.SIZE:
                continue
            _, flags, _, _, t_end = trace_slots.SLOT.unpack(raw)
            if not t_end:
                continue
            gi, pos, sig = self.open.pop(slot)
            issued = bool(flags & trace_slots.ISSUED)
            self.completed += 1
            self.issued_only += issued
            self.groups[gi].completed += 1
            if self.last_done is None or slot > self.last_done[0]:
                self.last_done = (slot, gi, pos, sig)
            old = self.kept.get(slot)
            if old is not None:
                self.kept[slot] = dataclasses.replace(old, t_end=t_end, issued_only=issued)

    def _lookups(self, np: Any, top: int) -> tuple[Any, Any, Any]:
        """Per sig number up to ``top``: known, its sequence's index, its signature's number."""
        known = np.zeros(top + 1, bool)
        group = np.full(top + 1, -1, np.int64)
        number = np.zeros(top + 1, np.int64)
        for n, desc in self.lines.sigs.items():
            if not 0 <= n <= top:
                continue
            gi = self.sig_group.get(n)
            if gi is None:
                try:
                    key = _hashable(sequence_key(desc, self.rank))
                    gi = self.group_of_key.get(key)
                    if gi is None:
                        gi = self.group_of_key[key] = len(self.groups)
                        self.groups.append(_Group(_group_of(desc) if _alignable(desc) else None))
                    self.sig_group[n] = gi
                    self.sig_number[n] = self.aligner.signature_number(desc, self.rank) if _alignable(desc) else 0
                except (KeyError, TypeError, ValueError):
                    continue
            known[n] = True
            group[n] = gi
            number[n] = self.sig_number[n]
        return known, group, number

    def _read_records(self, records: trace_reader.RecordFile, np: Any) -> None:
        """The records appended since the last read."""
        first = self.next_slot
        data = records.read(first, None if self.until is None else max(0, self.until - first))
        body = np.frombuffer(data, trace_slots.slot_dtype(), count=len(data) // trace_slots.SIZE)
        used = body["kind"] != 0
        written = np.flatnonzero(used)
        if not written.size:
            return
        end = int(written[-1]) + 1  # zero slots after the last record are the file's unused tail
        body, used = body[:end], used[:end]
        whole = bool(used.all())
        if not whole:
            self.holes += [first + int(i) for i in np.flatnonzero(~used)]
        # Fields one at a time: indexing the structured records themselves copies them slowly (their padding).
        slots = np.arange(first, first + end) if whole else written[written < end] + first
        sig = body["sig"] if whole else body["sig"][used]
        known, group_of, number_of = self._lookups(np, max(int(sig.max()), max(self.lines.sigs, default=0)))
        lost = np.flatnonzero(~known[sig])
        if lost.size:  # its sig line was lost (a full disk): the trace ends before it
            self.lost_from = int(slots[lost[0]])
            n = int(lost[0])
            slots, sig = slots[:n], sig[:n]
            used = used.copy()
            used[self.lost_from - first:] = False
            whole = False
        self.next_slot = first + end
        if not len(sig):
            return
        t = body["t"] if whole else body["t"][used]
        t_end = (body["t_end"] if whole else body["t_end"][used]).copy()
        issued = ((body["flags"] if whole else body["flags"][used]) & trace_slots.ISSUED) != 0
        error = np.zeros(len(sig), bool)
        for slot in [s for s in self.ends if first <= s < self.next_slot]:
            i = int(np.searchsorted(slots, slot))
            if i < len(slots) and slots[i] == slot:
                rec = self.ends[slot]
                try:
                    t_end[i] = float(rec.get("t", 0.0)) or 1e-9
                except (TypeError, ValueError):
                    continue
                error[i] = rec.get("error") is not None
                issued[i] = bool(rec.get("issued", False))
        groups = group_of[sig]
        ended = t_end != 0
        done = ended & ~error
        self.started += len(sig)
        self.completed += int(np.count_nonzero(done))
        self.failed += int(np.count_nonzero(ended & error))
        self.issued_only += int(np.count_nonzero(done & issued))
        present = np.unique(groups) if len(self.groups) > 1 else np.zeros(1, np.int64)
        positions = np.empty(len(sig), np.int64)
        for gi in present.tolist():
            g = self.groups[gi]
            idx = np.arange(len(sig)) if len(present) == 1 else np.flatnonzero(groups == gi)
            start = g.count
            positions[idx] = np.arange(start + 1, start + len(idx) + 1)
            g.count += len(idx)
            if g.key is None:  # point-to-point: every one is kept
                self.forever.update(int(s) for s in slots[idx])
                continue
            g.completed += int(np.count_nonzero(done[idx]))
            # the slot of every STRIDE-th position (0-based positions start .. start + len - 1)
            first_cp = -(-start // STRIDE) * STRIDE
            g.checkpoints += [int(s) for s in slots[idx[first_cp - start::STRIDE]]]
            if g.first_difference is None:
                g.first_difference = self.aligner.first_difference(g.key, number_of[sig[idx]], start)
            last = int(idx[-1])
            g.last = (int(slots[last]), g.count, int(sig[last]))
        self.forever.update(int(s) for s in slots[error])
        for i in np.flatnonzero(~ended).tolist():
            self.open[int(slots[i])] = (int(groups[i]), int(positions[i]), int(sig[i]))
        done_idx = np.flatnonzero(done)
        if done_idx.size:
            i = int(done_idx[-1])
            self.last_done = (int(slots[i]), int(groups[i]), int(positions[i]), int(sig[i]))
        new_tail = [(int(slots[i]), int(groups[i]), int(positions[i]), int(sig[i]))
                    for i in range(max(0, len(sig) - TAIL), len(sig))]
        self.tail = (self.tail + new_tail)[-TAIL:]
        # Events for the new records the trace keeps, made while their fields are at hand.
        wanted = self._wanted()
        for i in np.flatnonzero(np.isin(slots, np.fromiter(wanted, np.int64, len(wanted)))).tolist():
            slot = int(slots[i])
            if slot not in self.kept:
                self.kept[slot] = _record_event(self.rank, self.lines.sigs[int(sig[i])], slot, int(positions[i]),
                                                float(t[i]), float(t_end[i]) if slot not in self.ends else 0.0,
                                                bool(issued[i]), self.ends.get(slot))

    def _wanted(self) -> set[int]:
        """The slots whose events the trace keeps now (see the module docstring)."""
        wanted = set(self.forever)
        wanted.update(s for s, *_ in self.tail)
        if self.last_done is not None:
            wanted.add(self.last_done[0])
        first_open: dict[int, int] = {}
        for slot, (gi, _, _) in self.open.items():
            if slot < first_open.get(gi, slot + 1):
                first_open[gi] = slot
        wanted.update(first_open.values())
        if self.open:
            wanted.add(min(self.open))
        wanted.update(g.last[0] for g in self.groups if g.last is not None)
        return wanted

    def _trace(self, incomplete: Incomplete | None, finished: dict[str, Any] | None,
               state: trace_slots.HeaderState | None) -> RankTrace:
        wanted = self._wanted()
        for slot in [s for s in self.kept if s not in wanted]:
            del self.kept[slot]
        missing = [s for s in wanted if s not in self.kept]
        if missing:  # an open record that ended since, or the first open of a group: read back one by one
            where = {s: (gi, pos, sig) for s, (gi, pos, sig) in self.open.items()}
            if self.last_done is not None:
                where[self.last_done[0]] = self.last_done[1:]
            try:
                with trace_reader.RecordFile(self.bin_path) as records:
                    for slot in missing:
                        if slot not in where:
                            continue
                        _, pos, sig = where[slot]
                        _, flags, _, t, t_end = trace_slots.SLOT.unpack(records.read(slot, 1))
                        self.kept[slot] = _record_event(self.rank, self.lines.sigs[sig], slot, pos, t, t_end,
                                                        bool(flags & trace_slots.ISSUED), self.ends.get(slot))
            except (OSError, ValueError):
                pass
        sequences = {g.key: SequenceSummary(g.key, g.count, g.completed, g.first_difference, list(g.checkpoints))
                     for g in self.groups if g.key is not None and g.count}
        kept = dict(self.kept)
        summary = TraceSummary(self.started, self.completed, self.failed, self.issued_only, len(self.open),
                               sequences, self.rank, str(self.bin_path), self.lines.sigs, dict(self.ends),
                               self.until if self.lost_from is None else self.lost_from, kept)
        events = [kept[s] for s in sorted(kept)]
        return RankTrace(self.rank, events, list(self.lines.errors), self.lines.meta, finished, incomplete,
                         exit_recordable=state is not None, summary=summary)


class TraceFollower:
    """The summarized traces of one report directory, kept between loads (see the module docstring)."""

    def __init__(self, report_dir: str | os.PathLike) -> None:
        self.report_dir = Path(report_dir)
        self.lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self.aligner = Aligner()
        self.ranks: dict[int, RankFollower] = {}

    def load(self, paths: dict[int, Path]) -> dict[int, RankTrace] | None:
        """Every rank's trace (``paths``: its trace file, by rank); None when one cannot be summarized."""
        with self.lock:
            try:
                return self._load(paths)
            except _NewRun:
                self._start()
                return self._load(paths)

    def _load(self, paths: dict[int, Path]) -> dict[int, RankTrace] | None:
        out: dict[int, RankTrace] = {}
        for rank in [r for r in self.ranks if r not in paths]:
            del self.ranks[rank]
        for rank, path in paths.items():
            follower = self.ranks.get(rank)
            if follower is None or follower.trace_path != Path(path):
                follower = self.ranks[rank] = RankFollower(rank, Path(path), self.aligner)
            trace = follower.read()
            if trace is None:
                return None
            out[rank] = trace
        return out


_FOLLOWERS: dict[str, TraceFollower] = {}
_FOLLOWERS_LOCK = threading.Lock()


def follower(report_dir: str | os.PathLike) -> TraceFollower:
    """The follower of a report directory, the same one for every load of it in this process."""
    key = trace_reader.directory_key(report_dir)
    with _FOLLOWERS_LOCK:
        hit = _FOLLOWERS.get(key)
        if hit is None:
            while len(_FOLLOWERS) >= FOLLOWED_DIRS:
                _FOLLOWERS.pop(next(iter(_FOLLOWERS)))
            hit = _FOLLOWERS[key] = TraceFollower(key)
        return hit
