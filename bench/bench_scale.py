"""The trace analysis at scale: W ranks x C collectives, what the supervisor runs after the ranks end, timed.

    .venv/bin/python bench/bench_scale.py --world 512 --coll 1000
    .venv/bin/python bench/bench_scale.py --world 4096 --coll 20000 --dir /tmp/dcscale   # ~2 GB of records
    .venv/bin/python bench/bench_scale.py --world 512 --coll 1000 --flight   # with every rank's Flight dump
    .venv/bin/python bench/bench_scale.py --world 512 --coll 1000 --flight entries   # ... holding its ring

Writes a report directory per shape with the project's own writers (contract/trace_lines.py's ``LineWriter`` for the
meta/sig/exit lines, contract/trace_slots.py's header and record layout for ``trace-rank<R>.bin``), FSDP2-like on
the world group: per step, a forward all_gather per layer, then per layer in reverse a backward all_gather and a
reduce_scatter, then an all_reduce. Three shapes:

* ``ok``: every rank issues the same C collectives and finishes;
* ``diverge``: one rank's all_gather at collective C/2 has another shape (every rank finishes);
* ``hang``: every rank waits in its last collective, except one that stopped one collective early; every rank's
  stack dump (bench/_scale_hang.py: ~30 frames, 3 distinct stacks) is diagnosed as the watch loop does.

Each shape is analysed in a fresh process (``--analyse``): load the traces, the outcomes, the hang diagnosis from
the dumps (hang), the report (run_report.build_report: alignment, findings, trace.json) and its files. It prints

    scale world=W coll=C shape=S seconds=X peak_mb=Y report_mb=Z

where seconds is that analysis end to end, peak_mb the process's peak RSS (``ru_maxrss``) and report_mb the size of
everything the analysis wrote. ``--poll`` adds ``poll ... seconds=X``: one more stop check of the watch loop
(load_traces and provably_stuck) after that, with nothing appended, which reads only what was appended.
``--flight`` also writes every rank's Flight Recorder dump, as a rank whose ring holds nothing untraced writes it
(rank/flight_recorder.py: counters and ``all_traced``), and prints ``flight_check ... seconds=X``: rank 0's check
of its ring (its last 10000 entries) against its trace files, what the exit dump adds to a rank; ``--flight
entries`` writes the dumps with their entries, as every rank did before that check (the load is then not
summarized). Targets (2 cores): W=4096 C=20000: <= 30 s, <= 2048 MB, <= 20 MB each;
W=512 C=1000: <= 3 s.

Many nodes (``--nodes N --ranks-per-node P``, W = N*P ranks, one world group):

    .venv/bin/python bench/bench_scale.py --nodes 16 --coll 1000 --verbose
    .venv/bin/python bench/bench_scale.py --nodes 12500 --ranks-per-node 8 --coll 20000 --verbose

prints per shape ``scale nodes=N ranks=W coll=C shape=S seconds=X peak_mb=Y node_seconds=Z node_mb=M``: seconds
and peak_mb are node 0 composing the job's report (node_watcher._deliver_job_report: gather, compare_nodes,
remote_findings, merge_summaries, node_report.compose, deliver) in a fresh process; node_seconds / node_mb the
slowest / largest summary a real node built (summarize_node(..., final=True, digests=True), or on a hang
summarize_node(..., hung=True) with its ranks running, and ``summary.encode()``), each in a fresh process.
Targets: node 0 <= 30 s and <= 2 GB, each summary <= 1 s and <= 1 MB. The simulation:

* only a few nodes' files are written, with ``generate`` (the project's writers, the tracer's sig lines: pg the
  whole group "0,1,...,W-1" as rank/tracer.py writes it, pg_name "0"): node 0's, one typical node's (node 1), the
  diverging node's (diverge: node min(7000, N/2), its local rank 2's all_gather at C/2 has another shape), the
  hung node's (hang: the last node, whose rank W-2 stopped one collective early; every other rank waits in its
  last collective). Each is summarized for real; every other node's summary is node 1's re-labelled (node,
  host, ranks, report dir, job, and the rank keys of states, progress, durations, digests), all written one
  encoded summary a line, which node 0 decodes as StoreChannel.summaries does;
* node 0's channel (BenchChannel) has no store: the windows compare_nodes asks are encoded as the real
  ask_windows does; a real node answers with node_exchange.window_answer on its own directory, a re-labelled one
  with the typical node's answer re-keyed; node 0 decodes each answer as StoreChannel.answers does. What the
  simulated nodes do is timed apart and not counted in node 0's seconds;
* on a hang, node 0's own ranks count as still running (local_ranks is given their pids: the simulation has no
  live processes); no node sends stacks (a real hung node sends its stacks.json document): the ranks are placed
  by their progress alone;
* a summary names each group of more than 64 ranks once (contract/node_summary.py: the world as a range), and
  node 0 shares one list per group over the summaries it reads.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ("ok", "diverge", "hang")
LAYERS = 4
USER_FILE = "/home/user/job/fsdp_step.py"
# (op, line, reduce_op) of the workload's calls; shapes per layer below.
FWD_AG, BWD_AG, RS, AR = ("all_gather_into_tensor", 40, None), ("all_gather_into_tensor", 52, None), \
    ("reduce_scatter_tensor", 61, "SUM"), ("all_reduce", 18, "SUM")


def layer_numel(layer: int) -> int:
    return 1 << (16 + layer)  # layers of different sizes: each call site has one sig per layer


def workload(coll: int) -> list[tuple[tuple, int]]:
    """The first ``coll`` collectives of the step loop: (call, layer) each (layer -1: the step's all_reduce)."""
    step: list[tuple[tuple, int]] = [(FWD_AG, layer) for layer in range(LAYERS)]
    for layer in reversed(range(LAYERS)):
        step += [(BWD_AG, layer), (RS, layer)]
    step.append((AR, -1))
    out: list[tuple[tuple, int]] = []
    while len(out) < coll:
        out += step
    return out[:coll]


def sig_line(call: tuple, layer: int, world: int, pg: str, odd: bool = False) -> dict:
    op, line, reduce_op = call
    n = layer_numel(layer) if layer >= 0 else 1024
    if op == "all_gather_into_tensor":
        shapes = [[n * world], [n + (1 if odd else 0)]]
    elif op == "reduce_scatter_tensor":
        shapes = [[n], [n * world]]
    else:
        shapes = [[n]]
    file = USER_FILE if op != "all_reduce" else "/home/user/job/metrics.py"
    return {"op": op, "pg": pg, "pg_name": "0", "shapes": shapes, "dtypes": ["bfloat16"] * len(shapes),
            "reduce_op": reduce_op, "peer": None, "root": None, "site": f"{os.path.basename(file)}:{line}",
            "file": file, "line": line}


def generate(report_dir: Path, world: int, coll: int, shape: str, flight: str | None = None,
             ranks: range | None = None, odd_rank: int | None = None, stop_rank: int | None = None) -> dict:
    """Write every rank's trace files (and, for the hang, the stack dumps; with ``flight``, the Flight Recorder
    dumps of rings that hold nothing untraced); returns what the bench needs to know. ``ranks``: only these
    global ranks of the ``world`` (one node's, --nodes: no stack dumps then), ``odd_rank``/``stop_rank``: the
    diverging / stopped rank (by default world//3 and world-2)."""
    import numpy as np

    from distcheck.contract import files
    from distcheck.contract import trace_slots
    from distcheck.contract.trace_lines import LineWriter

    report_dir.mkdir(parents=True, exist_ok=True)
    pg = ",".join(map(str, range(world)))
    calls = workload(coll)
    keys = sorted({c for c in calls}, key=lambda c: (c[0][1], c[1]))
    sig_of = {k: i + 1 for i, k in enumerate(keys)}
    odd_rank = world // 3 if odd_rank is None else odd_rank
    odd_at = coll // 2
    while shape == "diverge" and calls[odd_at][0][0] != "all_gather_into_tensor":
        odd_at += 1
    if stop_rank is None:
        stop_rank = world - 2  # the hang's rank that stopped early (bench/_scale_hang.py's loader rank)
    dtype = np.dtype([("kind", "u1"), ("flags", "u1"), ("pad", "V2"), ("sig", "<u4"), ("t", "<f8"),
                      ("t_end", "<f8")])
    assert dtype.itemsize == trace_slots.SIZE == trace_slots.SLOT.size
    base = np.zeros(coll, dtype)
    base["kind"] = trace_slots.START
    base["sig"] = [sig_of[c] for c in calls]
    t0 = 1.7e9
    base["t"] = t0 + np.arange(coll) * 1e-3
    base["t_end"] = base["t"] + 5e-4
    header = np.frombuffer(trace_slots.header(files.FORMAT), dtype)
    for rank in (range(world) if ranks is None else ranks):
        lines = LineWriter(files.rank_file(report_dir, "trace", rank))
        lines.write({"ev": "meta", files.FORMAT_KEY: files.FORMAT, "rank": rank, "pid": 100_000 + rank,
                     "ppid": 1, "t": t0 - 1, "argv": ["fsdp_step.py"], "torch": "2.13.0", "hot_path": "c"})
        recs = base
        n = coll
        for (call, layer), sig in sig_of.items():
            lines.write({"ev": "sig", "sig": sig, **sig_line(call, layer, world, pg)})
        if shape == "diverge" and rank == odd_rank:
            odd_sig = len(sig_of) + 1
            call, layer = calls[odd_at]
            lines.write({"ev": "sig", "sig": odd_sig, **sig_line(call, layer, world, pg, odd=True)})
            recs = base.copy()
            recs["sig"][odd_at] = odd_sig
        if shape == "hang":
            n = coll - 1 if rank == stop_rank else coll
            recs = base[:n].copy()
            if rank != stop_rank:
                recs["t_end"][-1] = 0.0  # waits in its last collective
        else:
            lines.write({"ev": "exit", "ok": True, "code": 0, "t": t0 + coll * 1e-3})
        lines.close()
        with open(files.rank_file(report_dir, "trace_events", rank), "wb") as fh:
            head = header.copy()
            if shape != "hang":
                raw = bytearray(head.tobytes())
                trace_slots.EXIT.pack_into(raw, trace_slots.EXIT_OFFSET, trace_slots.EXIT_RETURNED, 0)
                head = np.frombuffer(bytes(raw), dtype)
            head.tofile(fh)
            recs[:n].tofile(fh)
    if shape == "hang" and ranks is None:
        from _scale_hang import write_dumps

        write_dumps(report_dir, world, loader_rank=stop_rank, barrier_rank=world - 1)
    out = {"odd_rank": odd_rank, "odd_at": odd_at + 1, "stop_rank": stop_rank}
    if flight:
        out["check_s"] = write_flight_dumps(report_dir, world, calls, base, stop_rank if shape == "hang" else None,
                                            "requested" if shape == "hang" else "exit", flight == "entries")
    return out


RING = 10000  # TORCH_FR_BUFFER_SIZE's default under distcheck (rank/flight_recorder.DEFAULT_ENTRIES)


def write_flight_dumps(report_dir: Path, world: int, calls: list, base, short_rank: int | None, reason: str,
                       keep_entries: bool = False) -> float:
    """Every rank's ``flight-rank<R>.json`` as rank/flight_recorder.py writes it for a ring that recorded exactly
    the traced calls: rank 0's ring (its last RING entries, as gloo records them) is held against rank 0's trace
    files by analysis/flight_recorder.all_traced, which must say all traced; every rank then writes the document
    rank/flight_recorder.document makes of it (with a world-sized group list and a backward phase per step, which
    an all-traced dump leaves out; ``keep_entries``: the whole document, as every dump was before all_traced).
    Returns the seconds rank 0's check took (what the exit dump adds)."""
    from distcheck.analysis import flight_recorder as fr
    from distcheck.contract import files, flight_dump_file
    from distcheck.rank import flight_recorder as rank_fr

    coll = len(calls)
    first = max(0, coll - RING)
    entries = [{"ring": "c10d", "record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"],
                "collective_seq_id": i + 1, "p2p_seq_id": 0, "is_p2p": False,
                "profiling_name": "gloo:" + {"all_gather_into_tensor": "_allgather_base",
                                             "reduce_scatter_tensor": "_reduce_scatter_base"}.get(calls[i][0][0],
                                                                                                  calls[i][0][0]),
                "input_sizes": [[layer_numel(max(calls[i][1], 0))]], "input_dtypes": ["BFloat16"],
                "output_sizes": [[layer_numel(max(calls[i][1], 0))]], "output_dtypes": ["BFloat16"],
                "time_created_ns": int((float(base["t"][i]) + 1e-4) * 1e9), "time_discovered_completed_ns": 0,
                "state": "scheduled", "thread_id": "140000000000000"} for i in range(first, coll)]
    status = {"c10d:0": {"last_enqueued_collective": str(coll), "last_completed_collective": str(coll),
                         "last_started_collective": "-1"}}
    steps = [{"kind": "backward", "file": USER_FILE, "line": 50, "t0": float(base["t"][i]), "t1": float(base["t"][i])}
             for i in range(coll) if calls[i][0] is AR][-4096:]
    snapshot = {"phases": steps, "graphs": {}, "seen": ["backward"]}
    t0 = time.perf_counter()
    traced = fr.all_traced(entries, status, files.rank_file(report_dir, "trace", 0).read_text().splitlines(),
                           files.rank_file(report_dir, "trace_events", 0).read_bytes(), snapshot)
    check_s = time.perf_counter() - t0
    assert traced, "rank 0's ring, made of its own traced calls, was not found all traced"
    groups = {"0": list(range(world))}
    for rank in range(world):
        rank_status = status
        if rank == short_rank:
            rank_status = {"c10d:0": {**status["c10d:0"], "last_enqueued_collective": str(coll - 1)}}
        doc = rank_fr.document(rank, reason, entries, rank_status, groups, snapshot, not keep_entries)
        flight_dump_file.write(report_dir, rank, doc)
    return check_s


def _snapshot(report_dir: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _, names in os.walk(report_dir):
        for name in names:
            st = os.stat(os.path.join(root, name))
            out[os.path.join(root, name)] = (st.st_size, st.st_mtime_ns)
    return out


def analyse(report_dir: Path, world: int, shape: str) -> tuple[float, float, float, list]:
    """What the supervisor runs once the ranks ended (supervise/supervised_run.py), on ``report_dir``: seconds,
    peak MB, MB written, the findings."""
    before = _snapshot(report_dir)
    t_start = time.perf_counter()
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract.report import publish
    from distcheck.supervise import run_report

    hang_findings = []
    if shape == "hang":
        try:
            import _scale_hang
        except ImportError as exc:
            raise SystemExit(f"bench/_scale_hang.py (the hang diagnosis's dumps) is missing: {exc}")
        hang_findings = _scale_hang.diagnose(report_dir, world)  # the watch loop's diagnosis, before the ends
    traces = load_traces(report_dir)
    killed = "hang" if shape == "hang" else None
    exits = {r: SimpleNamespace(killed=killed, returncode=None if killed else 0, signal=None) for r in range(world)}
    outcomes, notes = run_report.outcomes_from_exits(exits, traces, report_dir)
    report = run_report.build_report(report_dir, "bench_scale", world, traces, outcomes, 600.0, 1.0,
                                     hang_findings, None, notes)
    for finding in hang_findings:
        report.artifacts.update(finding.detail.get("artifacts", {}))
    run_report.write_trace_view(report, report_dir, traces)  # what supervised_run publishes with the report
    publish(report, report_dir)
    seconds = time.perf_counter() - t_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    after = _snapshot(report_dir)
    written = sum(size for path, (size, m) in after.items() if before.get(path) != (size, m))
    return seconds, peak, written / 2**20, report.findings


def poll(report_dir: Path) -> float:
    """Seconds of one more stop check of the watch loop (load the traces, ask whether the run can progress) once
    they were loaded: what each check costs while the ranks append nothing."""
    from distcheck.analysis.stop_rule import provably_stuck
    from distcheck.analysis.trace_events import load_traces

    t0 = time.perf_counter()
    provably_stuck(load_traces(report_dir), set())
    return time.perf_counter() - t0


# --- --nodes N --ranks-per-node R: node 0 composing the job's report from N node summaries ---------------------

HOST = "node{:05d}"  # a node's host name in the simulation


def node_env(node: int, nnodes: int, per_node: int):
    """The NodeEnv a node's watcher gets from torchrun (node_exchange.NodeEnv.from_env's fields)."""
    from distcheck.supervise.node_exchange import NodeEnv

    return NodeEnv(node, nnodes, node * per_node, per_node, nnodes * per_node, HOST.format(node), "10.0.0.1",
                   29400, "distcheck/bench/0/")


def node_layout(nnodes: int, per_node: int, shape: str) -> dict:
    """Which nodes are written for real: node 0, one typical node (1), the diverging node (diverge: 7000 or N/2;
    its local rank 2 diverges) or the hung node (hang: the last, whose local rank R-2 stopped early)."""
    world = nnodes * per_node
    odd_node = min(7000, nnodes // 2) if nnodes >= 4 else nnodes - 1
    stop_node = nnodes - 1
    real = {0: "own", 1: "typical"}
    if shape == "diverge":
        real[odd_node] = "diverging"
    if shape == "hang":
        real[stop_node] = "hung"
    return {"world": world, "real": real, "odd_rank": odd_node * per_node + min(2, per_node - 1),
            "stop_rank": world - 2, "odd_node": odd_node, "stop_node": stop_node}


def node_dir(base: Path, node: int) -> Path:
    return base / f"node-{node:05d}"


def summarize(base: Path, node: int, nnodes: int, per_node: int, shape: str) -> dict:
    """One node's watcher building its summary from its ranks' files (fresh process): what ``_watch_nodes`` calls
    once its ranks ended (``summarize_node(..., final=True, digests=True)``), or on a hang what ``_report_hang``
    sends (not final, hung, its ranks still running). Writes the encoded summary to ``summary-<node>.json``."""
    from distcheck.supervise import node_exchange, node_watcher

    node_watcher._warm_imports()  # what the watcher imports while its ranks run

    env = node_env(node, nnodes, per_node)
    t0 = time.perf_counter()
    if shape == "hang":
        summary = node_exchange.summarize_node(env, node_dir(base, node), set(env.ranks), hung=True)
    else:
        summary = node_exchange.summarize_node(env, node_dir(base, node), set(), final=True, findings=[],
                                               digests=True)
    data = summary.encode()
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "mb": len(data) / 2**20,
           "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    (base / f"summary-{node}.json").write_bytes(data)
    return out


def relabel(summary: dict, node: int, typical: int, per_node: int) -> dict:
    """The typical node's summary JSON as node ``node``'s: its index, host, ranks, report dir, job, and every rank
    key (states, progress, durations, digests) moved by (node - typical) * per_node."""
    shift = (node - typical) * per_node
    host = HOST.format(node)

    def moved(d: dict) -> dict:
        return {str(int(r) + shift): v for r, v in d.items()}

    out = dict(summary)
    out["node"], out["host"] = node, host
    out["ranks"] = [r + shift for r in summary["ranks"]]
    out["states"] = [{**s, "rank": s["rank"] + shift} for s in summary["states"]]
    out["progress"] = moved(summary["progress"])
    out["digests"] = moved(summary["digests"])
    out["durations"] = {pos: moved(times) for pos, times in summary["durations"].items()}
    out["report_dir"] = summary["report_dir"].replace(HOST.format(typical), host)
    out["job"] = {**summary["job"], "node": node, "first_rank": node * per_node, "host": host}
    return out


def write_others(base: Path, nnodes: int, per_node: int, shape: str) -> None:
    """Every node's summary but node 0's, one encoded summary a line, as node 0 gets them from the store: the real
    nodes' own, every other one the typical node's re-labelled."""
    layout = node_layout(nnodes, per_node, shape)
    typical = json.loads((base / "summary-1.json").read_bytes())
    with open(base / "others.jsonl", "wb") as fh:
        for node in range(1, nnodes):
            if node in layout["real"]:
                data = (base / f"summary-{node}.json").read_bytes()
            else:
                data = json.dumps(relabel(typical, node, 1, per_node), separators=(",", ":")).encode()
            fh.write(data + b"\n")


class BenchChannel:
    """The StoreChannel node 0's ``_deliver_job_report`` talks to, without a store: ``gather`` decodes the other
    nodes' encoded summaries (others.jsonl) as ``StoreChannel.summaries`` does; ``ask_windows`` encodes the asks
    as the real one does; ``answers`` serves each node's answer as JSON bytes, decoded as the real one does: a real
    node's computed by node_exchange.window_answer on its directory, a re-labelled node's the typical node's answer
    re-keyed by rank. What the simulated nodes do (their window_answer, the re-keying) is timed in ``remote_s``,
    which the bench takes off node 0's seconds."""

    broken = False

    def __init__(self, base: Path, nnodes: int, per_node: int, shape: str) -> None:
        self.base, self.nnodes, self.per_node = base, nnodes, per_node
        self.layout = node_layout(nnodes, per_node, shape)
        self.asked: dict[int, bytes] = {}
        self.ask_bytes = 0
        self.remote_s = 0.0
        self.window_s: dict[int, float] = {}  # real node -> seconds of its window_answer
        self._typical: dict[tuple, dict[int, bytes]] = {}

    def gather(self, nodes, deadline, ready, poll=0.05, stop=None):
        from distcheck.contract.node_summary import NodeSummary

        wanted, got = set(nodes), {}
        with open(self.base / "others.jsonl", "rb") as fh:
            for raw in fh:
                summary = NodeSummary.from_json(json.loads(raw))
                if summary.node in wanted:
                    got[summary.node] = summary
        return got

    def ask_windows(self, node, asks) -> None:
        data = json.dumps([a.to_json() for a in asks]).encode()  # what StoreChannel.ask_windows sets
        self.ask_bytes += len(data)
        self.asked[node] = data

    def _answer(self, node: int) -> bytes:
        """What node ``node``'s watcher answers (``_serve_node0``: window_answer of the asks it read)."""
        from distcheck.analysis.collective_digests import WindowAsk
        from distcheck.supervise.node_exchange import window_answer

        asks = [WindowAsk.from_json(d) for d in json.loads(self.asked[node])]
        ranks = range(node * self.per_node, (node + 1) * self.per_node)
        if node in self.layout["real"]:
            t0 = time.perf_counter()
            answer = window_answer(node_dir(self.base, node), asks, ranks)
            self.window_s[node] = time.perf_counter() - t0
            return json.dumps(answer, separators=(",", ":")).encode()
        shift = (node - 1) * self.per_node
        mine = [WindowAsk(a.group, a.lo, a.hi, [r - shift for r in a.ranks if r in ranks]) for a in asks]
        key = tuple((a.group, a.lo, a.hi, tuple(a.ranks)) for a in mine)
        if key not in self._typical:
            answer = window_answer(node_dir(self.base, 1), mine, range(self.per_node, 2 * self.per_node))
            self._typical[key] = {int(r): json.dumps(v, separators=(",", ":")).encode() for r, v in answer.items()}
        parts = [b'"%d":%s' % (r + shift, v) for r, v in self._typical[key].items()]
        return b"{" + b",".join(parts) + b"}"

    def answers(self, nodes):
        out = {}
        for node in nodes:
            if node not in self.asked:
                continue
            t0 = time.perf_counter()
            raw = self._answer(node)
            self.remote_s += time.perf_counter() - t0
            out[node] = json.loads(raw)  # StoreChannel.answers
        return out

    def post_report_path(self, host, path) -> None:
        pass

    def await_report_seen(self, nodes, deadline, poll=0.05) -> int:
        return nodes


def compose_job(base: Path, nnodes: int, per_node: int, shape: str) -> dict:
    """Node 0 composing the job's report (fresh process): node_watcher._deliver_job_report, as ``_watch_nodes``
    calls it once its ranks ended (``own``: its own summary) or ``_report_hang`` on a hang, with the channel
    above. Seconds, peak MB, and the report's findings."""
    from distcheck.contract.node_summary import NodeSummary
    from distcheck.supervise import node_watcher
    from distcheck.supervise.node_report import ENDED, HANG, Evidence

    env = node_env(0, nnodes, per_node)
    own_dir = node_dir(base, 0)
    channel = BenchChannel(base, nnodes, per_node, shape)
    own = None if shape == "hang" else NodeSummary.from_json(json.loads((base / "summary-0.json").read_bytes()))
    t_start = time.perf_counter()
    if shape == "hang":
        evidence = Evidence(HANG, own_dir, own_dir, env.world_size, 600.0, 700.0, time.time(),
                            note="no progress for 600s")
    else:
        evidence = Evidence(ENDED, own_dir, own_dir / f"node-{env.host}", env.world_size, 600.0, 700.0, time.time(),
                            command="distcheck run -- fsdp_step.py", running=set())
    if shape == "hang":
        # On a real node 0 its hung ranks still run when the report is composed (they are ended after it):
        # local_ranks finds them by their hook files and live pids, which the simulation has not.
        node_watcher.local_ranks = lambda report_dir, host=None, attempt=None: {r: 100_000 + r for r in env.ranks}
    saved_stderr = sys.stderr
    sys.stderr = open(os.devnull, "w")  # publish prints the report to the job's console
    try:
        node_watcher._deliver_job_report(evidence, env, channel, False, 0, None, own)
    finally:
        sys.stderr.close()
        sys.stderr = saved_stderr
    seconds = time.perf_counter() - t_start - channel.remote_s
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = json.loads((own_dir / "report.json").read_text())
    return {"seconds": seconds, "peak_mb": peak, "remote_s": channel.remote_s, "window_s": channel.window_s,
            "asked_nodes": len(channel.asked), "ask_mb": channel.ask_bytes / 2**20,
            "findings": [(f["kind"], f["ranks"][:8], len(f["ranks"]), f["message"][:600],
                          {k: f.get("detail", {}).get(k) for k in ("position", "file", "line", "across_nodes")})
                         for f in report["findings"]]}


def check_findings(shape: str, layout: dict, coll: int, findings: list) -> str:
    """Whether node 0's report names what the shape holds: "" when it does, else what is wrong."""
    if shape == "ok":
        return "" if not findings else f"expected no finding, got {[f[0] for f in findings]}"
    if shape == "diverge":
        hit = [f for f in findings if f[0] == "collective_mismatch" and f[4].get("across_nodes")]
        if not hit:
            return f"no cross-node collective_mismatch: {[f[0] for f in findings]}"
        kind, ranks, n, message, detail = hit[0]
        if ranks != [layout["odd_rank"]] or not detail.get("line"):
            return f"the mismatch names {ranks} ({n} ranks), line {detail.get('line')}; expected [{layout['odd_rank']}]"
        return ""
    hit = [f for f in findings if f[0] == "hang"]
    if not hit:
        return f"no hang finding: {[f[0] for f in findings]}"
    if findings[0][0] != "hang":
        return f"the first finding is a {findings[0][0]}, not the hang"
    stop = layout["stop_rank"]
    if hit[0][1] != [stop]:
        return f"the hang finding names {hit[0][1]} ({hit[0][2]} ranks), not [{stop}]"
    if not hit[0][4].get("line"):
        return "the hang finding names no line"
    return ""


def run_nodes(args) -> int:
    """--nodes: per shape, the real nodes' files, their summaries (each in a fresh process), the others' by
    re-labelling, node 0's report (a fresh process); one line per shape."""
    nnodes, per_node, coll = args.nodes, args.ranks_per_node, args.coll
    base_all = args.dir or Path(tempfile.mkdtemp(prefix="dcnodes-"))
    me = [sys.executable, __file__, "--nodes", str(nnodes), "--ranks-per-node", str(per_node), "--coll", str(coll)]
    failed = 0
    try:
        for shape in args.shapes.split(","):
            base = base_all / f"n{nnodes}x{per_node}-c{coll}-{shape}"
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            layout = node_layout(nnodes, per_node, shape)
            t0 = time.perf_counter()
            for node in layout["real"]:
                generate(node_dir(base, node), layout["world"], coll, shape,
                         ranks=range(node * per_node, (node + 1) * per_node), odd_rank=layout["odd_rank"],
                         stop_rank=layout["stop_rank"])
            gen_s = time.perf_counter() - t0
            built = {}
            for node, role in layout["real"].items():
                res = subprocess.run(me + ["--summarize", f"{shape}:{node}", "--dir", str(base)],
                                     capture_output=True, text=True, timeout=600)
                if res.returncode != 0:
                    sys.stderr.write(res.stdout + res.stderr)
                    return 1
                built[node] = json.loads(res.stdout.strip().splitlines()[-1])
            t0 = time.perf_counter()
            write_others(base, nnodes, per_node, shape)
            relabel_s = time.perf_counter() - t0
            res = subprocess.run(me + ["--compose", shape, "--dir", str(base)], capture_output=True, text=True,
                                 timeout=1800)
            if res.returncode != 0:
                sys.stderr.write(res.stdout + res.stderr)
                return 1
            out = json.loads(res.stdout.strip().splitlines()[-1])
            node_s = max(b["seconds"] for b in built.values())
            node_mb = max(b["mb"] for b in built.values())
            print(f"scale nodes={nnodes} ranks={layout['world']} coll={coll} shape={shape} "
                  f"seconds={out['seconds']:.2f} peak_mb={out['peak_mb']:.0f} node_seconds={node_s:.3f} "
                  f"node_mb={node_mb:.3f}", flush=True)
            problem = check_findings(shape, layout, coll, out["findings"])
            failed += bool(problem)
            if args.verbose or problem:
                roles = ", ".join(f"{role} node {n}: {built[n]['seconds']:.3f}s {built[n]['mb']:.3f}MB "
                                  f"peak {built[n]['peak_mb']:.0f}MB" for n, role in layout["real"].items())
                print(f"    simulated: {len(layout['real'])} nodes written and summarized for real ({roles}); "
                      f"the other {nnodes - len(layout['real'])} summaries are node 1's re-labelled "
                      f"(files {gen_s:.1f}s, re-labelling {relabel_s:.1f}s)")
                if out["asked_nodes"]:
                    ws = ", ".join(f"node {n}: {s:.3f}s" for n, s in out["window_s"].items())
                    print(f"    windows asked of {out['asked_nodes']} nodes ({out['ask_mb']:.1f} MB of asks); "
                          f"window_answer {ws}; simulated nodes' work {out['remote_s']:.2f}s (not counted)")
                for kind, ranks, n, message, detail in out["findings"][:2]:
                    print(f"    {kind} {ranks}{'...' if n > len(ranks) else ''} ({n} ranks) {detail}: "
                          f"{message[:400]}")
                print(f"    verified: {problem or 'yes'}")
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(base_all, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=512)  # make bench (bench/run_all.py) runs the defaults
    ap.add_argument("--coll", type=int, default=1000)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dir", type=Path, default=None, help="where the report directories go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the report directories")
    ap.add_argument("--analyse", metavar="SHAPE", help=argparse.SUPPRESS)  # the fresh process of one shape
    ap.add_argument("--verbose", action="store_true", help="print each shape's findings, first line")
    ap.add_argument("--poll", action="store_true",
                    help="also print the cost of one more stop check of the watch loop on the loaded traces")
    ap.add_argument("--flight", nargs="?", const="traced", choices=("traced", "entries"),
                    help="also write each rank's Flight Recorder dump (what every real run's ranks write at exit): "
                         "all traced (counters only), or 'entries': with its ring's entries, as before all_traced; "
                         "and print rank 0's check of its ring against its trace")
    ap.add_argument("--nodes", type=int, default=None,
                    help="node 0 composing the job's report from N nodes' summaries (see the docstring)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--summarize", metavar="SHAPE:NODE", help=argparse.SUPPRESS)  # one node's summary, fresh
    ap.add_argument("--compose", metavar="SHAPE", help=argparse.SUPPRESS)  # node 0's report, fresh process
    args = ap.parse_args()
    if args.summarize:
        shape, node = args.summarize.split(":")
        print(json.dumps(summarize(args.dir, int(node), args.nodes, args.ranks_per_node, shape)))
        return 0
    if args.compose:
        print(json.dumps(compose_job(args.dir, args.nodes, args.ranks_per_node, args.compose)))
        return 0
    if args.nodes:
        return run_nodes(args)
    if args.analyse:
        seconds, peak, written, findings = analyse(args.dir, args.world, args.analyse)
        print(json.dumps({"seconds": seconds, "peak_mb": peak, "report_mb": written, "poll_s": poll(args.dir),
                          "findings": [(f.kind, f.ranks[:8], f.message[:300]) for f in findings]}))
        return 0
    base = args.dir or Path(tempfile.mkdtemp(prefix="dcscale-"))
    try:
        for shape in args.shapes.split(","):
            report_dir = base / f"w{args.world}-c{args.coll}-{shape}"
            shutil.rmtree(report_dir, ignore_errors=True)
            made = generate(report_dir, args.world, args.coll, shape, args.flight)
            if args.flight:
                print(f"flight_check world={args.world} coll={args.coll} shape={shape} "
                      f"seconds={made['check_s']:.3f}", flush=True)
            res = subprocess.run([sys.executable, __file__, "--analyse", shape, "--world", str(args.world),
                                  "--coll", str(args.coll), "--dir", str(report_dir)],
                                 capture_output=True, text=True, timeout=3600)
            if res.returncode != 0:
                sys.stderr.write(res.stdout + res.stderr)
                return 1
            out = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"scale world={args.world} coll={args.coll} shape={shape} seconds={out['seconds']:.2f} "
                  f"peak_mb={out['peak_mb']:.0f} report_mb={out['report_mb']:.2f}", flush=True)
            if args.poll:
                print(f"poll world={args.world} coll={args.coll} shape={shape} seconds={out['poll_s']:.3f}",
                      flush=True)
            if args.verbose:
                for kind, ranks, message in out["findings"]:
                    print(f"    {kind} {ranks}: {message[:200]}")
            if not args.keep:
                shutil.rmtree(report_dir, ignore_errors=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
