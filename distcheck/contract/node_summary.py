"""What one node's watcher tells node 0 through torchrun's store: :class:`NodeSummary`, bounded per node.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m distcheck run -- train.py   # every node's watcher publishes one

The writer and the reader are the node watchers (supervise/node_exchange.py: ``StoreChannel.publish`` encodes,
``StoreChannel.summaries`` decodes); what the summary holds is there: each rank's end (:class:`RankState`, with a
failed rank's error and the last lines of its stderr), each rank's progress (analysis/progress.RankProgress's
JSON), after a hang the node's stacks.json document, at the end its ranks' time inside their last collectives.
Plain JSON, with its own format number; past MAX_SUMMARY_BYTES the stacks and times stay on the node.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SUMMARY_FORMAT = 2  # 2: digests, findings and the job's shape added (1 is still read)
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
        return {"format": SUMMARY_FORMAT, "node": self.node, "host": self.host, "ranks": self.ranks,
                "states": [s.to_json() for s in self.states.values()], "progress": self.progress,
                "stacks": self.stacks, "hung": self.hung, "final": self.final, "note": self.note,
                "report_dir": self.report_dir, "durations": self.durations, "digests": self.digests,
                "findings": self.findings, "job": self.job}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeSummary:
        states = [RankState.from_json(s) for s in d.get("states") or []]
        return cls(int(d["node"]), str(d.get("host", "")), [int(r) for r in d.get("ranks") or []],
                   {s.rank: s for s in states}, dict(d.get("progress") or {}), d.get("stacks"),
                   bool(d.get("hung")), bool(d.get("final")), str(d.get("note", "")), str(d.get("report_dir", "")),
                   {str(k): dict(v) for k, v in (d.get("durations") or {}).items()},
                   {str(k): dict(v) for k, v in (d.get("digests") or {}).items()},
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




FILE = "summary.json"  # in a node's own folder (node-<host>/): what it sent, or would have sent, to node 0


def write(folder: str | os.PathLike, summary: NodeSummary) -> Path:
    """The summary beside the node's own report, whole or not at all: ``distcheck report`` merges the nodes' folders
    from it into the report node 0 would have written. Raises OSError."""
    target = Path(folder) / FILE
    tmp = target.with_name(f"{FILE}.{os.getpid()}.tmp")
    tmp.write_bytes(summary.encode())
    tmp.replace(target)
    return target


def read(folder: str | os.PathLike) -> NodeSummary | None:
    """The node summary a node's folder holds, or None (none, or not one)."""
    try:
        return NodeSummary.from_json(json.loads((Path(folder) / FILE).read_bytes()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
