"""The hang shape of the scale bench: every rank's stack dump as py-spy prints it, and the diagnosis the supervisor
runs on them.

    .venv/bin/python bench/_scale_hang.py --world 4096 --out /tmp/hang4096             # write the dumps only
    .venv/bin/python bench/_scale_hang.py --world 4096 --out /tmp/hang4096 --diagnose  # and time the diagnosis
    .venv/bin/python bench/_scale_hang.py --world 4096 --out /tmp/hang4096 --diagnose --progress 20000  # + traces' view

``write_dumps(report_dir, world)`` writes ``report_dir/pyspy-dumps/dumps.jsonl``: one line per rank, ``{"rank",
"pid", "host", "pyspy"}``, where ``pyspy`` is exactly what ``py-spy dump --json --pid PID`` prints for that rank
(two threads: the main thread, about 30 frames, and distcheck's Flight Recorder poll thread). Three distinct
main-thread stacks, as in an FSDP-like job where one rank stopped a collective early:

* every rank but two waits in the all_reduce of its training step (``reduce_metrics``, through distcheck's tracer
  and torch's c10d wrapper);
* ``loader_rank`` (default world-2) is in its DataLoader (``next(loader)`` in ``train_epoch``): it stopped early;
* ``barrier_rank`` (default world-1) is in a barrier of its checkpoint code.

``diagnose(report_dir, world)`` parses those dumps with distcheck's own py-spy parser into the ``DumpResult`` that
``dump_all`` returns, then runs ``supervise.hang.diagnose_dumped``: what the supervisor's hang path runs after the
dumps (the traces' progress when ``report_dir`` holds traces, the diagnosis, stacks.txt/stacks.json, the finding).
The dumps are input, in their own subdirectory: what the analysis writes is everything else (``written_bytes``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import distcheck  # noqa: E402

DUMPS_DIR = "pyspy-dumps"
DUMPS_FILE = "dumps.jsonl"
TIMEOUT = 600.0  # the no-progress timeout the finding's message names
SITE = "/usr/lib/python3.11/site-packages"
PY = "/usr/lib/python3.11"
USER = "/home/user/job"
DC = str(Path(distcheck.__file__).resolve().parent)

# Outermost first (py-spy prints innermost first: reversed when written). (name, file, line)
_ENTRY = [
    ("<module>", f"{PY}/runpy.py", 198),  # python -m distcheck run
    ("_run_module_as_main", f"{PY}/runpy.py", 198),
    ("_run_code", f"{PY}/runpy.py", 88),
    ("<module>", f"{DC}/__main__.py", 4),
    ("main", f"{DC}/cli.py", 120),
    ("run_in_rank", f"{DC}/rank/entry.py", 88),
    ("run_path", f"{PY}/runpy.py", 291),
    ("_run_module_code", f"{PY}/runpy.py", 98),
    ("_run_code", f"{PY}/runpy.py", 88),
    ("<module>", f"{USER}/train.py", 140),
    ("main", f"{USER}/train.py", 131),
    ("fit", f"{USER}/train.py", 118),
]
_STEP = [
    ("train_epoch", f"{USER}/train.py", 96),
    ("train_step", f"{USER}/train.py", 74),
    ("log_metrics", f"{USER}/metrics.py", 31),
    ("reduce_metrics", f"{USER}/metrics.py", 18),
    ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
    ("traced_all_reduce", f"{DC}/rank/tracer.py", 640),
    ("_call", f"{DC}/rank/tracer.py", 602),
    ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2810),
    ("_fn", f"{SITE}/torch/_dynamo/eval_frame.py", 745),
    ("wait", f"{SITE}/torch/distributed/distributed_c10d.py", 2815),
    ("_wait_with_timeout", f"{SITE}/torch/distributed/distributed_c10d.py", 1120),
    ("synchronize", f"{SITE}/torch/cuda/__init__.py", 985),
    ("_lazy_call", f"{SITE}/torch/cuda/__init__.py", 310),
    ("inner", f"{SITE}/torch/utils/_contextlib.py", 115),
    ("sleep", f"{SITE}/torch/distributed/distributed_c10d.py", 1131),
    ("_poll", f"{SITE}/torch/distributed/distributed_c10d.py", 1140),
    ("is_completed", f"{SITE}/torch/distributed/distributed_c10d.py", 1150),
    ("__exit__", f"{SITE}/torch/autograd/profiler.py", 770),
]
_LOADER = [
    ("train_epoch", f"{USER}/train.py", 91),
    ("__next__", f"{SITE}/torch/utils/data/dataloader.py", 701),
    ("_next_data", f"{SITE}/torch/utils/data/dataloader.py", 1448),
    ("_get_data", f"{SITE}/torch/utils/data/dataloader.py", 1402),
    ("_try_get_data", f"{SITE}/torch/utils/data/dataloader.py", 1243),
    ("get", f"{PY}/queue.py", 180),
    ("wait", f"{PY}/threading.py", 331),
    ("_recv_bytes", f"{PY}/multiprocessing/connection.py", 430),
    ("_recv", f"{PY}/multiprocessing/connection.py", 395),
    ("poll", f"{PY}/multiprocessing/connection.py", 257),
    ("_poll", f"{PY}/multiprocessing/connection.py", 440),
    ("wait", f"{PY}/multiprocessing/connection.py", 1136),
    ("select", f"{PY}/selectors.py", 415),
    ("__enter__", f"{PY}/threading.py", 264),
    ("_acquire_restore", f"{PY}/threading.py", 280),
    ("_is_owned", f"{PY}/threading.py", 288),
    ("acquire", f"{PY}/threading.py", 300),
    ("__exit__", f"{PY}/threading.py", 267),
]
_BARRIER = [
    ("train_epoch", f"{USER}/train.py", 103),
    ("save_checkpoint", f"{USER}/checkpoint.py", 44),
    ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
    ("traced_barrier", f"{DC}/rank/tracer.py", 655),
    ("_call", f"{DC}/rank/tracer.py", 602),
    ("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 4620),
    ("_fn", f"{SITE}/torch/_dynamo/eval_frame.py", 745),
    ("wait", f"{SITE}/torch/distributed/distributed_c10d.py", 4651),
    ("_wait_with_timeout", f"{SITE}/torch/distributed/distributed_c10d.py", 1120),
    ("synchronize", f"{SITE}/torch/cuda/__init__.py", 985),
    ("_lazy_call", f"{SITE}/torch/cuda/__init__.py", 310),
    ("inner", f"{SITE}/torch/utils/_contextlib.py", 115),
    ("sleep", f"{SITE}/torch/distributed/distributed_c10d.py", 1131),
    ("_poll", f"{SITE}/torch/distributed/distributed_c10d.py", 1140),
    ("is_completed", f"{SITE}/torch/distributed/distributed_c10d.py", 1150),
    ("__exit__", f"{SITE}/torch/autograd/profiler.py", 770),
    ("__enter__", f"{SITE}/torch/autograd/profiler.py", 760),
    ("_record", f"{SITE}/torch/autograd/profiler.py", 780),
]
_POLL_THREAD = [
    ("_bootstrap", f"{PY}/threading.py", 1002),
    ("_bootstrap_inner", f"{PY}/threading.py", 1045),
    ("run", f"{PY}/threading.py", 982),
    ("_serve", f"{DC}/rank/flight_recorder.py", 170),
    ("sleep", f"{DC}/rank/flight_recorder.py", 182),
]


def _frames(outer_first: list[tuple[str, str, int]]) -> list[dict[str, Any]]:
    return [{"name": name, "filename": file, "module": None, "short_filename": os.path.basename(file),
             "line": line, "locals": None, "is_entry": True} for name, file, line in reversed(outer_first)]


def pyspy_output(rank: int, pid: int, where: str) -> list[dict[str, Any]]:
    """What ``py-spy dump --json --pid PID`` prints for one rank whose main thread is ``where`` (step, loader,
    barrier)."""
    main = _ENTRY + {"step": _STEP, "loader": _LOADER, "barrier": _BARRIER}[where]
    return [
        {"pid": pid, "thread_id": 139_800_000_000_000 + rank * 4096, "thread_name": "MainThread",
         "os_thread_id": pid, "active": False, "owns_gil": False, "frames": _frames(main), "process_info": None},
        {"pid": pid, "thread_id": 139_700_000_000_000 + rank * 4096, "thread_name": "distcheck-flight",
         "os_thread_id": pid + 700_000, "active": False, "owns_gil": False, "frames": _frames(_POLL_THREAD),
         "process_info": None},
    ]


def write_dumps(report_dir: Path, world: int, loader_rank: int | None = None,
                barrier_rank: int | None = None, ranks_per_host: int = 8) -> None:
    """Write every rank's py-spy dump to ``report_dir/pyspy-dumps/dumps.jsonl`` (see the module docstring)."""
    loader_rank = world - 2 if loader_rank is None else loader_rank
    barrier_rank = world - 1 if barrier_rank is None else barrier_rank
    out = Path(report_dir) / DUMPS_DIR
    out.mkdir(parents=True, exist_ok=True)
    with open(out / DUMPS_FILE, "w", encoding="utf-8") as fh:
        for rank in range(world):
            where = "loader" if rank == loader_rank else "barrier" if rank == barrier_rank else "step"
            pid = 100_000 + rank
            fh.write(json.dumps({"rank": rank, "pid": pid, "host": f"node{rank // ranks_per_host:04d}",
                                 "pyspy": pyspy_output(rank, pid, where)}, separators=(",", ":")) + "\n")


def load_dumps(report_dir: Path, world: int):
    """The ``DumpResult`` dump_all would have returned for these dumps (supervise/stacks.pyspy_dump's parse)."""
    from distcheck.analysis.stack_groups import RankStack, parse_pyspy_json
    from distcheck.supervise.stacks import DumpResult

    result = DumpResult()
    with open(Path(report_dir) / DUMPS_DIR / DUMPS_FILE, encoding="utf-8") as fh:
        for line in fh:
            d = json.loads(line)
            result.stacks.append(RankStack(d["rank"], d["pid"], d["host"], "py-spy",
                                           parse_pyspy_json(d["pyspy"], d["pid"]), "RANK", world))
    return result


def synthetic_progress(world: int, coll: int = 20000, loader_rank: int | None = None,
                       barrier_rank: int | None = None, copies: bool = False) -> dict:
    """Each rank's progress as the traces of this hang give it (--progress, for a report dir without traces): every
    rank completed ``coll - 1`` collectives on the world group; all but the loader rank wait in the next one. The
    refs share one list of the group's ranks (analysis/progress.py's refs do); ``copies``: each ref its own list,
    as they did before (W squared ints in memory)."""
    from distcheck.analysis.progress import CollectiveRef, GroupProgress, RankProgress

    shared = list(range(world))

    loader_rank = world - 2 if loader_rank is None else loader_rank
    barrier_rank = world - 1 if barrier_rank is None else barrier_rank
    out = {}
    for rank in range(world):
        def ref(op: str, seq: int, done: bool, site: str) -> CollectiveRef:
            file, line = site.split(":")
            return CollectiveRef(op, seq, list(range(world)) if copies else shared, site, f"{USER}/{file}", int(line),
                                 seq, done, group="default")
        done = ref("reduce_scatter", coll - 1, True, "fsdp_step.py:61")
        p = RankProgress(rank, done, done, coll - 1, coll - 1)
        if rank != loader_rank:
            op, site = ("barrier", "checkpoint.py:44") if rank == barrier_rank else ("all_reduce", "metrics.py:18")
            p.last_started = p.first_open = ref(op, coll, False, site)
            p.open = [p.first_open]
            p.started = coll
        g = p.groups["default"] = GroupProgress("default", list(range(world)) if copies else shared, p.started,
                                                coll - 1)
        g.last, g.first_open = p.last_started, p.first_open
        out[rank] = p
    return out


def diagnose(report_dir: Path, world: int):
    """What the supervisor runs after a hang, on the stored dumps: the hang findings (stacks.txt/.json written)."""
    from distcheck.contract import files
    from distcheck.supervise.hang import diagnose_dumped

    result = load_dumps(report_dir, world)
    return diagnose_dumped(result, [], [], report_dir, False, TIMEOUT, world, files.STACKS_STEM, None,
                           f"no progress for {TIMEOUT:g}s: ")


def written_bytes(report_dir: Path) -> int:
    """Bytes under ``report_dir`` outside the dumps' own subdirectory."""
    total = 0
    for root, dirs, names in os.walk(report_dir):
        if Path(root) == Path(report_dir):
            dirs[:] = [d for d in dirs if d != DUMPS_DIR]
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--diagnose", action="store_true", help="also time the diagnosis, with the finding's size")
    ap.add_argument("--progress", type=int, metavar="C", default=0,
                    help="stand in for traces: each rank's progress after C collectives, built in memory (the "
                         "diagnosis then reads it instead of the report dir's traces)")
    ap.add_argument("--copies", action="store_true",
                    help="with --progress: each ref holds its own copy of its group's ranks (the progress model of old)")
    args = ap.parse_args()
    write_dumps(args.out, args.world)
    if args.progress:
        import distcheck.supervise.hang as hang

        made = synthetic_progress(args.world, args.progress, copies=args.copies)
        hang.load_progress = lambda report_dir: made
    if not args.diagnose:
        return 0
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    (finding,) = diagnose(args.out, args.world)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finding_kb = len(json.dumps(finding.to_json())) / 1024
    print(f"hang world={args.world} seconds={seconds:.2f} peak_mb={peak:.0f} (before {base:.0f}) "
          f"written_mb={written_bytes(args.out) / 2**20:.2f} finding_kb={finding_kb:.0f}")
    print(finding.message[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
