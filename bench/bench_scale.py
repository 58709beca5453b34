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


def generate(report_dir: Path, world: int, coll: int, shape: str, flight: str | None = None) -> dict:
    """Write every rank's trace files (and, for the hang, the stack dumps; with ``flight``, the Flight Recorder
    dumps of rings that hold nothing untraced); returns what the bench needs to know."""
    import numpy as np

    from distcheck.contract import files
    from distcheck.contract import trace_slots
    from distcheck.contract.trace_lines import LineWriter

    report_dir.mkdir(parents=True, exist_ok=True)
    pg = ",".join(map(str, range(world)))
    calls = workload(coll)
    keys = sorted({c for c in calls}, key=lambda c: (c[0][1], c[1]))
    sig_of = {k: i + 1 for i, k in enumerate(keys)}
    odd_rank, odd_at = world // 3, coll // 2
    while shape == "diverge" and calls[odd_at][0][0] != "all_gather_into_tensor":
        odd_at += 1
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
    for rank in range(world):
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
    if shape == "hang":
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
    from distcheck.contract.report import write_report
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
    write_report(report, report_dir)
    seconds = time.perf_counter() - t_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    after = _snapshot(report_dir)
    written = sum(size for path, (size, m) in after.items() if before.get(path) != (size, m))
    return seconds, peak, written / 2**20, report.findings


def poll(report_dir: Path) -> float:
    """Seconds of one more stop check of the watch loop (load the traces, ask whether the run can progress) once
    they were loaded: what each check costs while the ranks append nothing."""
    from distcheck.analysis.trace_align import provably_stuck
    from distcheck.analysis.trace_events import load_traces

    t0 = time.perf_counter()
    provably_stuck(load_traces(report_dir), set())
    return time.perf_counter() - t0


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
    args = ap.parse_args()
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
