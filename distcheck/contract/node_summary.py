"""What one node's watcher tells node 0 through torchrun's store: :class:`NodeSummary`, bounded per node.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m distcheck run -- train.py   # every node's watcher publishes one

The writer and the reader are the node watchers (supervise/node_exchange.py: ``StoreChannel.publish`` encodes,
``StoreChannel.summaries`` decodes); what the summary holds is there: each rank's end (:class:`RankState`, with a
failed rank's error and the last lines of its stderr), each rank's progress (analysis/progress.RankProgress's
JSON), after a hang the node's stacks.json document, at the end its ranks' time inside their last collectives.
Plain JSON, with its own format number; past MAX_SUMMARY_BYTES the stacks and times stay on the node.

The ranks of a node that issued the same collectives send their digests once (``digest_table``; each rank's
group points there by index): 8 ranks' identical digests were 94% of a 12,500-node job's summaries, which node 0
decodes. A group of more than GROUP_INLINE ranks is listed once, in ``groups``, and every progress entry of it says
``"pg": "@<index>"``; a group whose ranks are a range (the world, a data-parallel group of a 2-D mesh) is sent as
``{"range": [start, stop, step]}``. A 100,000-rank world listed in each rank's three refs made a node's summary
13.5 MB; node 0 shares one list per group over all the summaries it reads.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from distcheck.contract import atomic_file

# 3: big groups named once in "groups" (2: digests, findings and the job's shape added; 1 and 2 are still read)
SUMMARY_FORMAT = 3
GROUP_INLINE = 64  # a progress entry's group of more ranks is named (analysis/rank_trace.PG_INLINE's size)
MAX_SUMMARY_BYTES = 4 << 20  # a node's summary, stacks included; past it the stacks stay on the node
RUNNING = "running"


@dataclass
class RankState:
    """How one rank ended (or that it still runs), as its node saw it."""

    rank: int
    state: str  # RUNNING, or a trace_align STATE_*
    exit_code: int | None = None
    signal: str | None = None
    error: dict[str, Any] | None = None  # analysis/trace_events.RankError's fields
    stderr_tail: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, [])}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankState:
        return cls(int(d["rank"]), str(d.get("state", RUNNING)), d.get("exit_code"), d.get("signal"),
                   d.get("error"), list(d.get("stderr_tail") or []))


@dataclass
class NodeSummary:
    node: int
    host: str
    ranks: list[int]
    states: dict[int, RankState]
    progress: dict[str, Any] = field(default_factory=dict)  # {rank: RankProgress.to_json()} of the node's ranks
    stacks: dict[str, Any] | None = None  # the node's stacks.json document, after a hang
    hung: bool = False
    final: bool = False  # every rank of the node has ended
    note: str = ""
    report_dir: str = ""  # on that node: its ranks' files and its stacks (node-<host>/)
    # {position: {rank: seconds inside the collective}} of its ranks' last positions (analysis/stragglers.durations):
    # node 0 compares ranks of several hosts by it, their clocks being another matter
    durations: dict[str, dict[str, float]] = field(default_factory=dict)
    # {rank: {group: [count, [digest per window]]}} of its ranks' collective signatures (analysis/collective_digests):
    # node 0 compares collectives across nodes by them, and asks for one window's signatures where they differ
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)
    # what the node's own report found about its ranks alone (a local collective_mismatch, a zero-code check),
    # bounded: node 0's report carries them beside the causes it composes from the states
    findings: list[dict[str, Any]] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)  # the job as this node saw it: world_size, nnodes, ...

    def to_json(self) -> dict[str, Any]:
        progress, groups = _named_groups(self.progress)
        return {"format": SUMMARY_FORMAT, "node": self.node, "host": self.host, "ranks": self.ranks,
                "states": [s.to_json() for s in self.states.values()], "progress": progress, "groups": groups,
                "stacks": self.stacks, "hung": self.hung, "final": self.final, "note": self.note,
                "report_dir": self.report_dir, "durations": self.durations,
                **_shared_digests(self.digests), "findings": self.findings, "job": self.job}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeSummary:
        states = [RankState.from_json(s) for s in d.get("states") or []]
        progress = _listed_groups(dict(d.get("progress") or {}), d.get("groups") or [])
        return cls(int(d["node"]), str(d.get("host", "")), [int(r) for r in d.get("ranks") or []],
                   {s.rank: s for s in states}, progress, d.get("stacks"),
                   bool(d.get("hung")), bool(d.get("final")), str(d.get("note", "")), str(d.get("report_dir", "")),
                   {str(k): dict(v) for k, v in (d.get("durations") or {}).items()},
                   _digests_back(d.get("digests") or {}, d.get("digest_table") or []),
                   [dict(f) for f in d.get("findings") or []], dict(d.get("job") or {}))

    def encode(self, limit: int = MAX_SUMMARY_BYTES) -> bytes:
        """The JSON, bounded: past ``limit`` the stacks stay on the node (its stacks.json) and a note says so."""
        data = json.dumps(self.to_json(), separators=(",", ":")).encode()
        if len(data) <= limit or (self.stacks is None and not self.durations and len(self.findings) <= 4):
            return data
        slim = dataclasses.replace(self, stacks=None, durations={}, findings=self.findings[:4],
                                   note=(self.note + "; " if self.note else "") +
                                   f"its stacks and collective times ({len(data)} bytes) are too large to send: "
                                   f"see stacks.txt and the traces on {self.host}")
        return json.dumps(slim.to_json(), separators=(",", ":")).encode()




# --- big groups, named once ------------------------------------------------------------------------------------

_REFS = ("last_started", "last_completed", "first_open", "last_failed")


def _entries(p: Mapping[str, Any]):
    """A rank's progress JSON's dicts that hold a "pg": its refs and its groups."""
    for key in _REFS:
        if isinstance(p.get(key), dict):
            yield p[key]
    yield from (g for g in (p.get("groups") or {}).values() if isinstance(g, dict))


def _spec(ranks: list[int]) -> dict[str, Any]:
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return {"range": [ranks[0], ranks[-1] + step, step]}
    return {"ranks": list(ranks)}


def _named_groups(progress: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The progress with every group of more than GROUP_INLINE ranks as "@<index>" into the groups it returns.
    The refs of one group share one list (analysis/progress._ranks_list): each is looked at once, by identity."""
    groups: list[dict[str, Any]] = []
    # id(list) -> index (the lists stay alive in ``progress`` while this runs), then the ranks' tuple -> index for
    # equal lists that are not shared
    index: dict[Any, int] = {}
    out: dict[str, Any] = {}
    for rank, p in progress.items():
        if not isinstance(p, dict):
            out[rank] = p
            continue
        p = {**p, **{k: dict(p[k]) for k in _REFS if isinstance(p.get(k), dict)}}
        if isinstance(p.get("groups"), dict):
            p["groups"] = {g: dict(v) if isinstance(v, dict) else v for g, v in p["groups"].items()}
        for entry in _entries(p):
            pg = entry.get("pg")
            if not isinstance(pg, list) or len(pg) <= GROUP_INLINE:
                continue
            i = index.get(id(pg))
            if i is None:
                ranks = tuple(pg)
                i = index.get(ranks)
                if i is None:
                    i = index[ranks] = len(groups)
                    groups.append(_spec(pg))
                index[id(pg)] = i
            entry["pg"] = f"@{i}"
        out[rank] = p
    return out, groups


# The lists node 0 decodes, shared by every summary: 12,500 nodes' refs of a 100,000-rank world are one list.
_SHARED: dict[tuple, list[int]] = {}


def _ranks_of(spec: Mapping[str, Any]) -> list[int] | None:
    if "range" in spec:
        start, stop, step = (int(v) for v in spec["range"])
        key: tuple = ("range", start, stop, step)
        if key not in _SHARED:
            _SHARED[key] = list(range(start, stop, step))
        return _SHARED[key]
    ranks = tuple(int(r) for r in spec.get("ranks") or [])
    return _SHARED.setdefault(ranks, list(ranks)) if ranks else None


def _listed_groups(progress: dict[str, Any], groups: list[Any]) -> dict[str, Any]:
    """The progress as it was sent, every "@<index>" back to its group's ranks (a summary of format 1 or 2 has
    them inline)."""
    if not groups:
        return progress
    if len(_SHARED) > 4096:
        _SHARED.clear()
    lists = [_ranks_of(g) if isinstance(g, dict) else None for g in groups]
    for p in progress.values():
        if not isinstance(p, dict):
            continue
        for entry in _entries(p):
            pg = entry.get("pg")
            if isinstance(pg, str) and pg.startswith("@"):
                try:
                    entry["pg"] = lists[int(pg[1:])]
                except (ValueError, IndexError):
                    entry["pg"] = None
    return progress


def _shared_digests(digests: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``digests`` with each rank's group as an index into ``digest_table``, which holds each distinct one once."""
    table: list[Any] = []
    index: dict[tuple, int] = {}
    out: dict[str, dict[str, int]] = {}
    for rank, groups in digests.items():
        for group, d in groups.items():
            key = (d[0], tuple(d[1]), *d[2:]) if isinstance(d, (list, tuple)) and len(d) > 1 else (repr(d),)
            i = index.get(key)
            if i is None:
                i = index[key] = len(table)
                table.append(d)
            out.setdefault(str(rank), {})[group] = i
    return {"digests": out, "digest_table": table}


def _digests_back(digests: Mapping[str, Any], table: list[Any]) -> dict[str, dict[str, Any]]:
    """The digests as sent, each index back to its table entry (ranks with the same digests share the entry's
    object: node 0 compares them once); a summary of format 2 holds them inline."""
    out: dict[str, dict[str, Any]] = {}
    for rank, groups in digests.items():
        if not isinstance(groups, Mapping):
            continue
        out[str(rank)] = {g: (table[d] if isinstance(d, int) and 0 <= d < len(table) else d)
                          for g, d in groups.items() if not isinstance(d, int) or 0 <= d < len(table)}
    return out


FILE = "summary.json"  # in a node's own folder (node-<host>/): what it sent, or would have sent, to node 0


def write(folder: str | os.PathLike, summary: NodeSummary) -> Path:
    """The summary beside the node's own report, whole or not at all: ``distcheck report`` merges the nodes' folders
    from it into the report node 0 would have written. Raises OSError."""
    return atomic_file.write_bytes(Path(folder) / FILE, summary.encode())


def read(folder: str | os.PathLike) -> NodeSummary | None:
    """The node summary a node's folder holds, or None (none, or not one)."""
    try:
        return NodeSummary.from_json(json.loads((Path(folder) / FILE).read_bytes()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
