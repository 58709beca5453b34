"""Many nodes, one report: the node watchers exchange what the report needs through torchrun's rendezvous store.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m distcheck run -- train.py

Each node's watcher (supervise/node_watcher.py) reads only its own node's files. Under torchrun every node already
reaches one TCPStore: the agent of node 0 (the node of global rank 0) hosts it at MASTER_ADDR:MASTER_PORT for the
ranks' process group. The watchers connect to it as clients (supervise/store_client.py, which needs no torch),
under a key prefix of their own (``distcheck/<run id>/<restart>/``), every call bounded by a timeout, and never touch
the ranks' keys.

What travels is bounded per node, whatever the job's length: a NodeSummary (contract/node_summary.py) holds the
node's ranks' exit states (with a failed rank's error and the last lines of its stderr), each rank's progress
summary (analysis/progress.RankProgress: last started/completed collective, the one it waits on, per-group counts),
at the end its ranks' time inside each of their last collectives (analysis/stragglers.durations: node 0 names a
straggler of another host by it) and, after a hang, the node's grouped stacks (its stacks.json document, whose
distinct stacks are stored once with the ranks' ranges). Three small counters and flags make the rest O(1) per poll
and per node: a progress counter each node bumps when its ranks' traces grow (so no node declares a hang while
another still progresses), a hang flag (the first node to see the job hung makes every node dump at once) and the
report's location (node 0 writes the one complete report; every other node prints one line saying where it is).

Node 0 gathers the summaries with a deadline; a node that sent nothing by then is named once ("node 3 sent
nothing"), never each of its ranks as failed. The merge itself (:func:`merge_summaries`,
:func:`merge_stack_documents`) is pure and shared with ``distcheck report DIR...`` (commands/report.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from distcheck.analysis.collective_digests import WindowAsk
from distcheck.analysis.progress import RankProgress
from distcheck.analysis.rank_outcomes import (STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, STATE_STOPPED,
                                              RankOutcome)
from distcheck.analysis.trace_events import RankError
from distcheck.contract.findings import Finding, format_ranks
from distcheck.contract.node_summary import RUNNING, NodeSummary, RankState

log = logging.getLogger("distcheck")

STORE_TIMEOUT = 5.0  # seconds any one store call may take (the store is one TCP round trip away)
GATHER_TIMEOUT = 30.0  # how long node 0 waits for the other nodes' summaries after a hang or at the end
POLL = 1.0  # seconds between a watcher's store polls: a few small calls per node and second
EXCHANGE_KEY = "exchange"  # in torchrun's store: where node 0's own exchange store listens ("addr,addr:port")
AFTER_AGENT = 1.5  # seconds a watcher may still wait for the exchange once its torchrun agent has ended
EXCHANGE_POLL = 0.1  # seconds between a watcher's looks for the exchange store, until it is on it
EXCHANGE_GIVE_UP = 20.0  # seconds after which a watcher stops holding failed ranks for the exchange


# --- the records that travel ----------------------------------------------------------------------------------


@dataclass
class NodeEnv:
    """Where this node is in the job, from the torchrun environment the watcher inherited from local rank 0."""

    node: int  # torchrun's GROUP_RANK
    nnodes: int
    first_rank: int
    local_world_size: int
    world_size: int
    host: str
    store_host: str
    store_port: int
    prefix: str

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.local_world_size))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeEnv:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

    @property
    def reports(self) -> bool:
        """Whether this node writes the job's report: the node of global rank 0."""
        return self.first_rank == 0

    def node_ranks(self, node: int) -> list[int]:
        """Another node's ranks: torchrun numbers ranks node by node, LOCAL_WORLD_SIZE each."""
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    @classmethod
    def from_env(cls, env: Mapping[str, str], host: str) -> NodeEnv | None:
        """None unless this is one node of several under torchrun (single-node jobs need no exchange)."""
        try:
            world = int(env["WORLD_SIZE"])
            local = int(env["LOCAL_WORLD_SIZE"])
            nnodes = int(env.get("GROUP_WORLD_SIZE") or max(1, world // max(local, 1)))
            node = int(env.get("GROUP_RANK", "0"))
            first = int(env.get("RANK", "0")) - int(env.get("LOCAL_RANK", "0"))
            port = int(env["MASTER_PORT"])
        except (KeyError, ValueError):
            return None
        if nnodes <= 1 or world <= local:
            return None
        prefix = f"distcheck/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        return cls(node, nnodes, first, local, world, host, env.get("MASTER_ADDR", "127.0.0.1"), port, prefix)


def rank_outcome(state: RankState, hung: bool) -> RankOutcome:
    """How a rank ended, as the report's outcome (a rank still running: hung, or stopped with its job)."""
    if state.state == RUNNING:
        return RankOutcome(state.rank, STATE_HUNG if hung else STATE_STOPPED)
    err = None
    if state.error:
        try:
            err = RankError(**{f.name: state.error.get(f.name) for f in dataclasses.fields(RankError)})
        except TypeError:
            err = None
    return RankOutcome(state.rank, state.state, state.exit_code, state.signal, err)


# --- the pure merge -------------------------------------------------------------------------------------------


@dataclass
class MergedNodes:
    """What the other nodes' summaries add to node 0's view."""

    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    progress: dict[int, RankProgress] = field(default_factory=dict)
    stderr_tails: dict[int, list[str]] = field(default_factory=dict)
    stack_docs: list[dict[str, Any]] = field(default_factory=list)
    hosts: dict[int, str] = field(default_factory=dict)  # node -> host
    dirs: dict[int, str] = field(default_factory=dict)  # node -> its report dir (on that node)
    silent: dict[int, list[int]] = field(default_factory=dict)  # node -> its ranks, for nodes that sent nothing
    notes: list[str] = field(default_factory=list)
    durations: dict[str, dict[str, float]] = field(default_factory=dict)  # position -> {rank: seconds inside}

    @property
    def ranks(self) -> set[int]:
        return set(self.outcomes)


def merge_summaries(summaries: Mapping[int, NodeSummary], expected: Iterable[int],
                    node_ranks: Callable[[int], list[int]], hung: bool) -> MergedNodes:
    """The other nodes' ranks' outcomes, progress, stderr tails and stack documents; ``expected``: the nodes whose
    summary node 0 waited for (a missing one is ``silent``, its ranks in no outcome)."""
    merged = MergedNodes()
    for node in sorted(expected):
        summary = summaries.get(node)
        if summary is None:
            merged.silent[node] = node_ranks(node)
            continue
        merged.hosts[node] = summary.host
        merged.dirs[node] = summary.report_dir
        # A node whose last summary is not its final one (its watcher was killed, or ended before it sent the
        # last): how its ended ranks ended is known, where the others were at the end is not.
        partial = not (summary.final or summary.hung or hung)
        for rank in summary.ranks:
            state = summary.states.get(rank, RankState(rank, RUNNING))
            if partial and state.state == RUNNING:
                merged.silent.setdefault(node, []).append(rank)
                continue
            merged.outcomes[rank] = rank_outcome(state, hung or summary.hung)
            if state.stderr_tail:
                merged.stderr_tails[rank] = state.stderr_tail
        merged.progress.update({int(r): RankProgress.from_json(int(r), p) for r, p in summary.progress.items()})
        for position, times in summary.durations.items():
            merged.durations.setdefault(position, {}).update(times)
        if summary.stacks is not None:
            merged.stack_docs.append(summary.stacks)
        if summary.note:
            merged.notes.append(f"node {node} ({summary.host}): {summary.note}")
    return merged


def nodes_json(merged: MergedNodes, env: NodeEnv, report_dir: str) -> dict[str, Any]:
    """report.json's "nodes": where each node's files are (its ranks' traces and its stacks stay there)."""
    out = {env.host: {"node": env.node, "ranks": format_ranks(env.ranks), "report_dir": report_dir}}
    for node, host in sorted(merged.hosts.items()):
        out[host] = {"node": node, "ranks": format_ranks(env.node_ranks(node)), "report_dir": merged.dirs.get(node)}
    for node, ranks in sorted(merged.silent.items()):
        out[f"node {node}"] = {"node": node, "ranks": format_ranks(ranks), "report_dir": None}
    return out


def silent_nodes_finding(silent: Mapping[int, list[int]], waited: float, store: str,
                         hosts: Mapping[int, str] | None = None, dirs: Mapping[int, str] | None = None
                         ) -> Finding | None:
    """One finding for every node whose part never arrived by the deadline (nothing, or not its last summary):
    those ranks' state is unknown, which is not the same as each of them having failed. Names where each such
    node's own report is, when the node said so."""
    if not silent:
        return None
    hosts, dirs = hosts or {}, dirs or {}
    nodes = sorted(silent)
    ranks = sorted(r for n in nodes for r in silent[n])
    names = ", ".join(f"{n} ({hosts[n]})" if n in hosts else str(n) for n in nodes[:16]) + (
        f" and {len(nodes) - 16} more" if len(nodes) > 16 else "")
    known = [n for n in nodes[:4] if dirs.get(n)]
    where = ("; " + "; ".join(f"{hosts.get(n, f'node {n}')}'s own report: {dirs[n]}/node-{hosts.get(n, '')}/"
                              f"report.txt" for n in known)) if known else "; look at the report dir on that node"
    partial = any(n in hosts for n in nodes)
    message = (f"node{'s' if len(nodes) > 1 else ''} {names} (torchrun's GROUP_RANK; {format_ranks(ranks)}) "
               f"{'did not send its last summary' if partial else 'sent nothing'} by the deadline ({waited:.0f}s): "
               f"where {'these ranks' if len(ranks) > 1 else 'this rank'} ended is unknown here. The node or its "
               f"distcheck watcher went down first, or cannot reach the exchange store ({store}){where}.")
    return Finding("rank_failure", ranks, message, {"silent_nodes": {str(n): silent[n] for n in nodes},
                                                    "waited_seconds": round(waited, 1),
                                                    "node_reports": {str(n): dirs[n] for n in known}})


def merge_stack_documents(docs: Sequence[tuple[list, list, dict[str, Any]]]):
    """Several nodes' stack dumps (supervise/stacks.load_stacks_document's triples) as one: every rank's stack
    once (a rank dumped on two hosts is a clash, the first kept), the dump errors, each rank's progress."""
    by_rank: dict[int, Any] = {}
    clashes: list[str] = []
    errors: list = []
    progress: dict[int, RankProgress] = {}
    for stacks, errs, doc in docs:
        errors.extend(errs)
        for s in stacks:
            if s.rank in by_rank and (by_rank[s.rank].host, by_rank[s.rank].pid) != (s.host, s.pid):
                clashes.append(f"rank {s.rank} appears on {by_rank[s.rank].host} and {s.host}; kept the first")
                continue
            by_rank[s.rank] = s
        for rank, p in (doc.get("last_collectives") or {}).items():
            progress[int(rank)] = RankProgress.from_json(int(rank), p)
    return [by_rank[r] for r in sorted(by_rank)], errors, progress, clashes


def stacks_from_document(doc: dict[str, Any]):
    """stacks.json's document (as sent in a summary) back to (stacks, errors, doc), like load_stacks_document."""
    import tempfile

    from distcheck.supervise.stacks import load_stacks_document

    # The one reader of stacks.json (either form, both versions of last_collectives) reads a file.
    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
        json.dump(doc, fh)
        fh.flush()
        return load_stacks_document(fh.name)


# --- this node's summary, from its files ----------------------------------------------------------------------


def read_signatures(report_dir: str | os.PathLike, rank: int) -> tuple[dict[int, dict[str, Any]], Any]:
    """A rank's sig lines (``{sig id: desc}``) and the sig id of each collective it started, in order (its record
    slots, read as a numpy array): what its digests and its window answers are computed from."""
    import numpy as np

    from distcheck.contract import files, trace_lines, trace_slots

    sigs: dict[int, dict[str, Any]] = {}
    try:
        with open(files.rank_file(report_dir, "trace", rank), "rb") as fh:
            for rec in trace_lines.read_records(fh):
                if rec.get("ev") == trace_lines.SIG and "sig" in rec:
                    sigs[int(rec["sig"])] = rec
        data = trace_slots.read_records(files.rank_file(report_dir, "trace_events", rank))
    except (OSError, ValueError):
        return sigs, np.zeros(0, np.uint32)
    body = data[trace_slots.SIZE:]
    arr = np.frombuffer(body, trace_slots.slot_dtype(), count=len(body) // trace_slots.SIZE)
    return sigs, arr["sig"][arr["kind"] != 0]


def node_digests(report_dir: str | os.PathLike, ranks: Iterable[int]) -> dict[str, dict[str, Any]]:
    """``{rank: {group: [count, digests]}}`` of this node's ranks (analysis/collective_digests.py)."""
    from distcheck.analysis.collective_digests import rank_digests

    out: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        sigs, numbers = read_signatures(report_dir, rank)
        if len(numbers):
            out[str(rank)] = {g: d.to_json() for g, d in rank_digests(sigs, numbers, rank).items()}
    return out


def window_answer(report_dir: str | os.PathLike, asks: Sequence[WindowAsk], ranks: Iterable[int]) -> dict[str, Any]:
    """What this node's ranks issued in the windows node 0 asked about: ``{rank: {group: {position: event}}}``."""
    from distcheck.analysis.collective_digests import events_json, group_of
    from distcheck.analysis.rank_trace import _event

    mine = set(ranks)
    out: dict[str, Any] = {}
    for ask in asks:
        for rank in sorted(mine & set(ask.ranks)):
            sigs, numbers = read_signatures(report_dir, rank)
            pos, found = 0, []
            for number in numbers.tolist():
                desc = sigs.get(int(number))
                if desc is None or group_of(desc) != ask.group:
                    continue
                if ask.lo <= pos < ask.hi:
                    found.append((pos, _event(rank, desc, 0, pos + 1, 0.0)))
                pos += 1
                if pos >= ask.hi:
                    break
            out.setdefault(str(rank), {})[ask.group] = events_json(found)
    return out


def summarize_node(env: NodeEnv, report_dir: str | os.PathLike, running: set[int], hung: bool = False,
                   stacks_path: Path | None = None, final: bool = False, findings: Sequence[Finding] = (),
                   digests: bool = False, stopped: Iterable[int] = ()) -> NodeSummary:
    """This node's ranks as its files tell: the exit line of each rank's trace, else RUNNING when its process
    still runs, else died; progress from the traces; the stacks document when a dump was written."""
    from distcheck.analysis import stragglers
    from distcheck.analysis.progress import progress_by_rank
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract import files
    from distcheck.contract.stderr_file import tail

    traces = {r: t for r, t in load_traces(report_dir).items() if r in set(env.ranks)}
    stopped_ranks = set(stopped)
    states: dict[int, RankState] = {}
    for r in env.ranks:
        t = traces.get(r)
        if t is not None and t.finished is not None:
            ok = bool(t.finished.get("ok"))
            err = t.errors[-1] if t.errors else None
            states[r] = RankState(r, STATE_OK if ok else STATE_ERROR, 0 if ok else int(t.finished.get("code", 1) or 1),
                                  error=_error_json(err))
        elif r in running or t is None and not final:
            states[r] = RankState(r, RUNNING)
        elif r in stopped_ranks:  # torchrun stopped it (its stop-signal dump says where it was)
            states[r] = RankState(r, STATE_STOPPED)
        else:
            err = t.errors[-1] if t is not None and t.errors else None
            states[r] = RankState(r, STATE_ERROR if err else STATE_DIED, error=_error_json(err))
        if states[r].state not in (RUNNING, STATE_OK):
            states[r].stderr_tail = tail(files.rank_file(report_dir, "stderr", r))
    stacks = None
    if stacks_path is not None and stacks_path.exists():
        try:
            stacks = json.loads(stacks_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s: %s", stacks_path, exc)
    # One node's ranks (LOCAL_WORLD_SIZE of them): each rank's progress as is, a few KiB each.
    progress = {str(r): p.to_json() for r, p in progress_by_rank(traces).items()}
    late = stragglers.durations(traces) if final else {}  # the whole run's, once it is over
    return NodeSummary(env.node, env.host, env.ranks, states, progress, stacks, hung, final,
                       report_dir=str(Path(report_dir).resolve()), durations=late,
                       digests=node_digests(report_dir, env.ranks) if digests else {},
                       findings=[_bounded(f) for f in findings[:MAX_FINDINGS]], job=env.to_json())


MAX_FINDINGS = 20  # a node's own findings that travel (each bounded): node 0's report names the first causes


def _bounded(f: Finding) -> dict[str, Any]:
    out = f.to_json()
    out["message"] = out["message"][:2000]
    detail = json.dumps(out.get("detail") or {})
    if len(detail) > 8000:
        out["detail"] = {k: v for k, v in (out.get("detail") or {}).items() if k in ("file", "line", "group",
                                                                                      "position", "fields")}
    return out


def _error_json(err: RankError | None) -> dict[str, Any] | None:
    if err is None:
        return None
    out = dataclasses.asdict(err)
    out["traceback"] = (out.get("traceback") or "")[-8000:]  # bounded: the end of a traceback names the line
    out.pop("context", None)
    return out


# --- the store ------------------------------------------------------------------------------------------------


class StoreChannel:
    """The watchers' keys in torchrun's store: a client connection, every call bounded and never raising."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix
        self.lock = threading.Lock()
        self.failures = 0
        self.last: NodeSummary | None = None  # the last summary published: sent again after a switch
        self.exchange = False  # whether this is node 0's exchange store (else torchrun's rendezvous store)

    def switch(self, store: Any) -> None:
        """From torchrun's store to node 0's exchange store (:class:`ExchangeHost`), which outlives the agents:
        what this node published before goes again."""
        with self.lock:
            self.fallback, self.fallback_failures = self.store, 0
            self.store, self.failures, self.exchange = store, 0, True
        if self.last is not None:
            self.send_summary(self.last)

    def _from_fallback(self, key: str) -> bytes | None:
        """A key from torchrun's store, once this channel moved to the exchange: what a node that never found the
        exchange store published (node 0 reads it there, while that store is up)."""
        store = getattr(self, "fallback", None)
        if store is None or self.fallback_failures >= 3:
            return None
        with self.lock:
            try:
                if not store.check([self.prefix + key]):
                    return None
                return store.get(self.prefix + key)
            except Exception as exc:
                self.fallback_failures += 1
                log.info("torchrun's store: get %s failed: %s", key, exc)
                return None

    @classmethod
    def connect_exchange(cls, env: NodeEnv, rendezvous: StoreChannel, deadline: float,
                         timeout: float = STORE_TIMEOUT) -> StoreChannel | None:
        """Node 0's exchange store (:class:`ExchangeHost`), found through torchrun's store;
        None when node 0 did not publish it by ``deadline`` or none of its addresses answers."""
        from distcheck.supervise.store_client import StoreClient

        while True:
            raw = rendezvous._get(EXCHANGE_KEY)
            if raw is not None or rendezvous.broken or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if raw is None:
            return None
        hosts, _, port = raw.decode(errors="replace").rpartition(":")
        for host in filter(None, hosts.split(",")):
            try:
                client = StoreClient(host, int(port), timeout)
                client.check([env.prefix + "probe"])
            except (OSError, ValueError) as exc:
                log.info("exchange store at %s:%s does not answer: %s", host, port, exc)
                continue
            return cls(client, env.prefix)
        return None

    @classmethod
    def connect(cls, env: NodeEnv, timeout: float = STORE_TIMEOUT) -> StoreChannel | None:
        """A client of torchrun's store: distcheck's own (store_client.py: no torch to import), or torch's when
        the store does not answer that one's handshake (a protocol that changed)."""
        from distcheck.supervise.store_client import ProtocolError, StoreClient

        try:
            try:
                store: Any = StoreClient(env.store_host, env.store_port, timeout)
            except ProtocolError as exc:
                log.info("%s: using torch's TCPStore client", exc)
                from torch.distributed import TCPStore

                store = TCPStore(env.store_host, env.store_port, None, False, timedelta(seconds=timeout),
                                 wait_for_workers=False)
        except Exception as exc:  # no store, no exchange: this node's report stays on the node
            log.warning("cannot reach torchrun's store at %s:%d: %s", env.store_host, env.store_port, exc)
            return None
        return cls(store, env.prefix)

    @property
    def broken(self) -> bool:
        return self.failures >= 3  # the store's host (node 0's torchrun) has gone

    def _call(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        if self.broken:
            return default
        with self.lock:
            try:
                out = fn()
            except Exception as exc:
                self.failures += 1
                log.info("store %s failed: %s", what, exc)
                return default
        self.failures = 0
        return out

    def _has(self, key: str) -> bool:
        return bool(self._call(f"check {key}", lambda: self.store.check([self.prefix + key]), False))

    def _get(self, key: str) -> bytes | None:
        if not self._has(key):
            return None
        return self._call(f"get {key}", lambda: self.store.get(self.prefix + key))

    def send_summary(self, summary: NodeSummary) -> bool:
        self.last = summary
        data = summary.encode()
        done = self._call("set summary", lambda: self.store.set(f"{self.prefix}node/{summary.node}", data) or True)
        if done:
            self._call("add version", lambda: self.store.add(self.prefix + "version", 1))
        return bool(done)

    def version(self) -> int | None:
        return self._call("version", lambda: self.store.add(self.prefix + "version", 0))

    def bump_progress(self) -> int | None:
        return self._call("add progress", lambda: self.store.add(self.prefix + "progress", 1))

    def progress_count(self) -> int | None:
        return self._call("progress", lambda: self.store.add(self.prefix + "progress", 0))

    def announce_hang(self, node: int, host: str) -> None:
        """The first node to see the job hung says so (its index: hosts may share a name)."""
        if not self._has("hang"):
            self._call("set hang", lambda: self.store.set(self.prefix + "hang", f"{node}:{host}"))

    def hang_announced(self) -> tuple[int, str] | None:
        """(node index, host) of the node that declared the job hung, if one did."""
        raw = self._get("hang")
        if raw is None:
            return None
        node, _, host = raw.decode(errors="replace").partition(":")
        try:
            return int(node), host
        except ValueError:
            return None

    def summaries(self, nodes: Iterable[int]) -> dict[int, NodeSummary]:
        out: dict[int, NodeSummary] = {}
        for node in nodes:
            raw = self._get(f"node/{node}") or self._from_fallback(f"node/{node}")
            if raw is None:
                continue
            try:
                out[node] = NodeSummary.from_json(json.loads(raw))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("node %d sent an unreadable summary: %s", node, exc)
        return out

    def gather(self, nodes: Sequence[int], deadline: float, ready: Callable[[NodeSummary], bool],
               poll: float = 0.05, stop: Callable[[], bool] | None = None) -> dict[int, NodeSummary]:
        """The nodes' summaries once each is ``ready``, or has said bye (its watcher ended: what it sent is all
        there is), or the deadline passed, or ``stop()``: polled by the version counter, so a poll is one call
        while nothing changed (and one per node not ready)."""
        got: dict[int, NodeSummary] = {}
        seen_version = -1
        done: set[int] = set()
        while True:
            version = self.version()
            if version is None and self.broken:
                return got
            if version != seen_version:
                seen_version = version if version is not None else -1
                got.update(self.summaries([n for n in nodes if n not in got or not ready(got[n])]))
            pending = [n for n in nodes if n not in done and not (n in got and ready(got[n]))]
            if pending:
                left = self.gone(pending)
                if left:
                    got.update(self.summaries(sorted(left)))
                    done |= left
                    pending = [n for n in pending if n not in left]
            if not pending or time.monotonic() >= deadline or stop is not None and stop():
                return got
            time.sleep(poll)

    def say_bye(self, node: int) -> None:
        """This node's watcher is ending: node 0 waits no longer for what it did not send."""
        self._call("set bye", lambda: self.store.set(f"{self.prefix}bye/{node}", b"1"))

    def gone(self, nodes: Iterable[int]) -> set[int]:
        """Which of ``nodes`` said bye."""
        return {n for n in nodes if self._has(f"bye/{n}")}

    def ask_windows(self, node: int, asks: Sequence[WindowAsk]) -> None:
        """Node 0 asks a node for its ranks' signatures in the windows where the digests differ."""
        data = json.dumps([a.to_json() for a in asks]).encode()
        self._call("set ask", lambda: self.store.set(f"{self.prefix}ask/{node}", data))

    def asked(self, node: int) -> list[WindowAsk] | None:
        raw = self._get(f"ask/{node}")
        if raw is None:
            return None
        try:
            return [WindowAsk.from_json(d) for d in json.loads(raw)]
        except (ValueError, KeyError, TypeError):
            return None

    def answer_windows(self, node: int, answer: Mapping[str, Any]) -> None:
        data = json.dumps(answer, separators=(",", ":")).encode()
        self._call("set answer", lambda: self.store.set(f"{self.prefix}answer/{node}", data))

    def answers(self, nodes: Iterable[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for node in nodes:
            raw = self._get(f"answer/{node}")
            if raw is not None:
                try:
                    out[node] = json.loads(raw)
                except ValueError:
                    pass
        return out

    def post_report_path(self, host: str, path: str) -> None:
        self._call("set report", lambda: self.store.set(self.prefix + "report", f"{host}:{path}"))
        store = getattr(self, "fallback", None)
        if store is not None and self.fallback_failures < 3:  # a node still on torchrun's store looks there
            try:
                store.set(self.prefix + "report", f"{host}:{path}")
            except Exception:
                self.fallback_failures += 1

    def report_location(self) -> str | None:
        """The report's ``host:path`` once node 0 published it; the first read acknowledges it (node 0 waits for
        the acknowledgements, bounded, before its torchrun and the store end)."""
        raw = self._get("report")
        if raw is None:
            return None
        if not getattr(self, "_acked", False):
            self._acked = self._call("ack report", lambda: self.store.add(self.prefix + "report_seen", 1)) is not None
        return raw.decode(errors="replace")

    def await_report_seen(self, nodes: int, deadline: float, poll: float = 0.05) -> int:
        """How many of ``nodes`` other nodes read the report's location, waiting for all of them until the
        deadline."""
        while True:
            seen = self._call("report_seen", lambda: self.store.add(self.prefix + "report_seen", 0), 0) or 0
            if seen >= nodes or self.broken or time.monotonic() >= deadline:
                return seen
            time.sleep(poll)


class ExchangeHost:
    """Node 0's own store for the exchange, which outlives torchrun's agents.

    torchrun's rendezvous store lives in one agent (whichever bound the rendezvous endpoint, not always node 0's)
    and ends with it, often before another node's watcher has read what a crashed node sent: the report then came
    15 s late and blamed the rank that lost its peer. This store is torch's TCPStore, served by a process global
    rank 0 forks first thing (rank/exchange_host.py), which serves as long as node 0's watcher runs; its port is in
    ``exchange-<host>-<attempt>.json``. Its address goes through torchrun's store (:data:`EXCHANGE_KEY`), and every
    watcher moves its keys here once it finds it (StoreChannel.switch). No watcher imports torch for it."""

    def __init__(self, report_dir: str | os.PathLike, attempt: int) -> None:
        self.report_dir, self.attempt = report_dir, attempt
        self._client: Any = None

    def port(self) -> int | None:
        from distcheck.contract import exchange_file

        from distcheck.processes import alive

        found = exchange_file.read(self.report_dir, self.attempt)
        return found[0] if found is not None and alive(found[1]) else None  # not a stale file of another job

    def store(self, timeout: float = STORE_TIMEOUT) -> Any:
        """A client of it (this node's, on the loopback), or None when it is not up (yet)."""
        if self._client is None:
            port = self.port()
            if port is None:
                return None
            from distcheck.supervise.store_client import StoreClient

            try:
                self._client = StoreClient("127.0.0.1", port, timeout)
            except OSError as exc:
                log.info("the exchange store on port %d does not answer: %s", port, exc)
                return None
        return self._client


def reachable_addresses(env: NodeEnv) -> list[str]:
    """This node's addresses as the other nodes may reach it: the one its route to torchrun's store leaves from
    (the network the job already uses), then its names."""
    import socket

    out: list[str] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((env.store_host, env.store_port))  # no packet: picks the route's source address
            out.append(probe.getsockname()[0])
    except OSError:
        pass
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and name not in out:
            out.append(name)
    return out


# --- the watcher's side of the exchange, while its ranks run ---------------------------------------------------


class NodeLink(threading.Thread):
    """Polls the store every POLL seconds for one node's watcher: bumps the progress counter when this node's
    traces grew, notes when another node's did, sees a hang another node declared (and cancels the watch loop);
    on node 0 it publishes the report's location once the report is written, on the other nodes it notes it."""

    def __init__(self, env: NodeEnv, channel: StoreChannel, report_dir: str | os.PathLike,
                 token: Callable[[], Any], cancel: threading.Event, poll: float = POLL,
                 on_exchange: Callable[[], None] | None = None) -> None:
        super().__init__(name="distcheck-node-link", daemon=True)
        self.on_exchange = on_exchange  # called once the exchange is in place (every node on it), or given up
        self.host: ExchangeHost | None = None  # node 0: the exchange store rank 0 forked
        self.exchange_done = False
        self.exchange_since = time.monotonic()
        self.env, self.channel, self.report_dir = env, channel, Path(report_dir)
        self.token, self.cancel, self.poll = token, cancel, poll
        self.stop = threading.Event()
        self.remote_hang: str | None = None
        self.report: str | None = None
        self.others_progressed = 0.0  # monotonic time another node last progressed (0: not seen)
        self.local_progressed = time.monotonic()  # this node's, as seen by this thread's polls
        self._seen_token: Any = None
        self._own = 0
        self._others: int | None = None
        self._last_token: Any = None
        self._last_bump = 0.0
        self.started_wall = time.time()

    def _report_written(self) -> bool:
        try:
            return (self.report_dir / "report.json").stat().st_mtime >= self.started_wall - 1.0
        except OSError:
            return False

    def job_idle(self) -> float:
        """Seconds since any node's ranks last progressed (to this thread's poll's precision)."""
        return time.monotonic() - max(self.local_progressed, self.others_progressed)

    def run(self) -> None:
        while not self.stop.wait(self.poll if self.exchange_done else EXCHANGE_POLL):
            try:
                self.step()
            except Exception:  # the exchange must never be what breaks the watcher
                log.exception("node exchange step failed")
            if self.channel.broken:
                log.warning("torchrun's store stopped answering: no more exchange with the other nodes")
                return

    def find_exchange(self) -> bool:
        """Move this node's keys to node 0's exchange store (:class:`ExchangeHost`) once it is up: node 0 publishes
        its address in torchrun's store, the others look it up there. Whether the channel is on it now."""
        if self.channel.exchange:
            return True
        if self.env.reports:
            if self.host is None:
                return False
            port, store = self.host.port(), self.host.store()
            if port is None or store is None:
                return False
            value = f"{','.join(reachable_addresses(self.env))}:{port}"
            rdzv = self.channel
            if rdzv._call("set exchange", lambda: rdzv.store.set(rdzv.prefix + EXCHANGE_KEY, value) or True):
                log.info("hosting the nodes' exchange at %s", value)
                self.channel.switch(store)
        else:
            found = StoreChannel.connect_exchange(self.env, self.channel, time.monotonic())
            if found is not None:
                log.info("exchanging through node 0's store")
                self.channel.switch(found.store)
                self.channel._call("add switched", lambda: self.channel.store.add(self.channel.prefix + "switched", 1))
        return self.channel.exchange

    def _exchange_step(self) -> None:
        """Until the exchange is in place: move to it; node 0 waits until every node has (the count of nodes on it),
        then says so once (a failed rank waits for that before it exits: rank/entry.py)."""
        if self.exchange_done:
            return
        ready = False
        if self.find_exchange():
            if self.env.reports:
                count = self.channel._call("switched", lambda: self.channel.store.add(self.channel.prefix + "switched",
                                                                                      0))
                ready = count is not None and count >= self.env.nnodes - 1
            else:
                ready = True
        if not ready and time.monotonic() - self.exchange_since >= EXCHANGE_GIVE_UP:
            log.warning("the exchange is not in place after %.0fs: what a node sends once torchrun's store is gone "
                        "may be lost", EXCHANGE_GIVE_UP)
            ready = True
        if ready:
            self.exchange_done = True
            if self.on_exchange is not None:
                self.on_exchange()

    def step(self) -> None:
        self._exchange_step()
        now = time.monotonic()
        token = self.token()
        if token != self._seen_token:
            self._seen_token, self.local_progressed = token, now
        if token != self._last_token and now - self._last_bump >= 1.0:
            self._last_token, self._last_bump = token, now
            if self.channel.bump_progress() is not None:
                self._own += 1
        count = self.channel.progress_count()
        if count is not None:
            others = count - self._own
            if self._others is not None and others != self._others:
                self.others_progressed = now
            self._others = others
        if self.remote_hang is None:
            hang = self.channel.hang_announced()
            if hang is not None and hang[0] != self.env.node:
                log.warning("node %d (%s) declared the job hung: dumping this node's ranks", *hang)
                self.remote_hang = hang[1]
                self.cancel.set()
        if self.env.reports:
            if self.report is None and self._report_written():
                # Published at once: node 0's torchrun, and the store with it, ends soon after its ranks.
                self.report = str(self.report_dir.resolve() / "report.txt")
                self.channel.post_report_path(self.env.host, self.report)
        elif self.report is None:
            self.report = self.channel.report_location()


def wait_for_report(channel: StoreChannel, link: NodeLink | None, deadline: float, poll: float = 0.2) -> str | None:
    """The report's location ``host:path`` once node 0 published it, or None at the deadline (or when the store
    went away with node 0's torchrun)."""
    while True:
        found = link.report if link is not None and link.report else channel.report_location()
        if found or channel.broken or time.monotonic() >= deadline:
            return found
        time.sleep(poll)


def where_line(location: str | None, waited: float, env: NodeEnv | None = None, gone: bool = False,
               own: Path | None = None) -> str:
    """The one line a node other than node 0 prints (``own``: this node's own report, when it wrote one)."""
    if location:
        host, _, path = location.partition(":")
        return f"distcheck: the report of this job is on {host}: {path}\n"
    node0 = f"node 0 ({env.store_host}, the node of rank 0)" if env is not None else "node 0"
    mine = f"; this node's own report: {own}" if own is not None else ""
    if gone:
        return (f"distcheck: {node0} ended before it said where its report is: look in its --report-dir "
                f"there{mine}\n")
    if waited:
        return f"distcheck: {node0} published no report within {waited:.0f}s{mine}\n"
    return f"distcheck: {node0} did not say where the job's report is before this node's torchrun ended{mine}\n"
