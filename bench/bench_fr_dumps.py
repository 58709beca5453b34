"""``distcheck report DUMPS`` over a big job's Flight Recorder dumps, synthesized in torch's pickle layout.

    .venv/bin/python bench/bench_fr_dumps.py --ranks 4096 --entries 20000
    # fr_dumps ranks=4096 entries=20000 seconds=X peak_mb=Y

The job: ``--ranks`` ranks in tensor-parallel groups of 8 and data-parallel groups across them, every rank's ring
``--entries`` long (wrapped: a long job), each step 5 TP collectives, a DP reduce_scatter and all_gather and a
world all_reduce of the loss, each op called from its own 6-frame Python stack. Two bugs to find: rank 77 issues
one TP all_reduce with another shape (at one position in the middle of the rings), and rank ``ranks // 3`` never
issues the last DP all_gather that the rest of its DP group waits in (state started, not completed).

The files are written the way torch's pickler writes a dump (tests/fr_dump_builder.TorchPickler): protocol 2,
strings memoized by value, frame dicts memoized once complete and fetched again by later entries, one MARK for the
whole entry list; integers in fixed widths so that the bulk of a ring is one step's bytes repeated (numpy fills
the numbers in), which is what makes 4,096 x 20,000 entries take a minute to write instead of an hour. They go
into a temporary folder, removed at the end. The figure is ``python -m distcheck report DIR --format json`` run as
a child process (startup included): its wall time, and its peak RSS (``ru_maxrss`` of the child). The files were
just written, so they are read from the page cache where it holds them: a cold read adds the disk's time for the
total size, printed as ``total_mb``. The command's findings are checked: the run fails if either bug is not named.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fr_dump_builder import C10D_LOGGER, TORCH_C10D, TorchPickler  # noqa: E402  (torch's pickle layout)

TP = 8
STEP = [("tp", "nccl:all_reduce", [[4096, 1024]], [[4096, 1024]], "BFloat16", "attn"),
        ("tp", "nccl:all_reduce", [[4096, 1024]], [[4096, 1024]], "BFloat16", "mlp"),
        ("dp", "nccl:_reduce_scatter_base", [[8388608]], [[16384]], "Float", "grads"),
        ("tp", "nccl:_allgather_base", [[512, 1024]], [[4096, 1024]], "BFloat16", "embed"),
        ("dp", "nccl:_allgather_base", [[16384]], [[8388608]], "Float", "params"),
        ("tp", "nccl:all_reduce", [[4096, 1024]], [[4096, 1024]], "BFloat16", "attn2"),
        ("tp", "nccl:all_reduce", [[4096, 1024]], [[4096, 1024]], "BFloat16", "mlp2"),
        ("world", "nccl:all_reduce", [[1]], [[1]], "Float", "loss")]
FIRST_RECORD = 1_000_000  # the ring wrapped long ago: a long job
T0 = time.time_ns() - 3_600_000_000_000  # an hour ago: the last collective waits past its 600 s timeout


def frames_for(kind: str, op: str) -> list[dict]:
    call = "all_reduce" if "all_reduce" in op else ("reduce_scatter_tensor" if "reduce" in op else
                                                     "all_gather_into_tensor")
    frame = (lambda name, file, line: {"name": name, "filename": file, "line": line})
    return [frame(call, TORCH_C10D, 3245), frame("wrapper", C10D_LOGGER, 83),
            frame(f"sync_{kind}", "/job/model/parallel.py", 100 + len(kind)),
            frame("forward", "/job/model/layers.py", 40 + len(op)),
            frame("train_step", "/job/train.py", 210), frame("<module>", "/job/train.py", 300)]


def entry(p: TorchPickler, i: int, group: tuple[str, str], pg_id: int, seq: int, op: str, ins, outs, dtype, frames,
          done: bool, started: bool, fixed: bool) -> None:
    state = "completed" if done else ("started" if started else "scheduled")
    d = {"frames": frames, "record_id": FIRST_RECORD + i, "pg_id": pg_id, "process_group": group,
         "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
         "time_created_ns": T0 + i * 1000, "input_sizes": ins, "input_dtypes": [dtype], "output_sizes": outs,
         "output_dtypes": [dtype], "state": state,
         "time_discovered_started_ns": T0 + i * 1000 + 10 if started or done else None,
         "time_discovered_completed_ns": T0 + i * 1000 + 500 if done else None,
         "retired": done, "timeout_ms": 600000, "is_p2p": False}
    # Fixed-width numbers, tagged by the name the bulk writer patches them by.
    fx = {"record_id": "record_id", "collective_seq_id": "collective_seq_id", "op_id": "op_id",
          "time_created_ns": "time:created", "time_discovered_started_ns": "time:started",
          "time_discovered_completed_ns": "time:completed"} if fixed else None
    p.dict(d, fx)


class Job:
    def __init__(self, ranks: int, entries: int) -> None:
        self.ranks, self.entries = ranks, entries
        self.dp = max(1, ranks // TP)
        self.steps = entries // len(STEP)
        self.culprit_hang = ranks // 3
        self.culprit_shape = 77 % ranks
        self.shape_step = self.steps // 2

    def groups(self, rank: int) -> dict[str, tuple[str, str, list[int], int]]:
        tp = rank // TP
        dp = rank % TP
        return {"world": ("0", "default_pg", list(range(self.ranks)), 0),
                "tp": (str(1 + tp), "tp", list(range(tp * TP, tp * TP + TP)), 1),
                "dp": (str(1 + self.dp + dp), "dp", list(range(dp, self.ranks, TP)), 2)}

    def file(self, rank: int) -> bytes:
        """One rank's dump: header, the first step (memo), the bulk (repeated), the last steps, the close."""
        groups = self.groups(rank)
        count = {"tp": 0, "dp": 0, "world": 0}
        base_seq = {"tp": 500_000, "dp": 100_000, "world": 60_000}
        p = TorchPickler()
        p.out += b"}("
        for k, v in (("version", "2.10"), ("pg_config", {name: {"name": name, "desc": desc, "ranks": str(members)}
                                                           for name, desc, members, _ in groups.values()}),
                     ("comm_lib_version", "2.21.5")):
            p.string(k)
            p.value(v)
        p.string("pg_status")
        p.value({str(pg_id): {"last_enqueued_collective": base_seq[k] + self.steps * sum(s[0] == k for s in STEP),
                              "last_started_collective": -1, "last_completed_collective": -1}
                 for k, (_, _, _, pg_id) in groups.items()})
        p.string("entries")
        p.out += b"]("
        i = 0
        frames = {s[5]: frames_for(s[0], s[1]) for s in STEP}

        def one(s, done=True, started=True, fixed=False, ins=None):
            nonlocal i
            kind, op, ins0, outs, dtype, site = s
            count[kind] += 1
            name, desc, _, pg_id = groups[kind]
            entry(p, i, (name, desc), pg_id, base_seq[kind] + count[kind], op, ins or ins0, outs, dtype,
                  frames[site], done, started, fixed)
            i += 1

        for s in STEP:  # the first step defines every memoized string and frame
            one(s)
        # The bulk: one step in fixed widths, repeated; its numbers patched per step with numpy.
        bulk_steps = self.steps - 2
        start = len(p.out)
        mark = dict(p.at)
        p.at = {}
        for s in STEP:
            one(s, fixed=True)
        step_bytes = bytes(p.out[start:])
        offsets = {name: [o - start for o in v] for name, v in p.at.items()}
        p.at = mark
        del p.out[start:]
        arr = np.frombuffer(step_bytes, np.uint8)
        bulk = np.tile(arr, bulk_steps).reshape(bulk_steps, len(arr))
        k = np.arange(bulk_steps, dtype=np.int64)

        def patch(name: str, values_per_slot: list[np.ndarray], width: int) -> None:
            for off, vals in zip(offsets.get(name, []), values_per_slot):
                raw = vals.astype("<i8" if width == 8 else "<i4").view(np.uint8).reshape(bulk_steps, width)
                bulk[:, off:off + width] = raw

        n = len(STEP)
        first_i = i - n  # the entry index of the template's first entry (as written)
        rec = [FIRST_RECORD + first_i + j + k * n for j in range(n)]
        patch("record_id", rec, 4)
        seqs = []
        per_step = {kind: sum(s[0] == kind for s in STEP) for kind in count}
        before = {kind: count[kind] - per_step[kind] for kind in count}  # counts before the template's step
        seen = {kind: 0 for kind in count}
        for s in STEP:
            seen[s[0]] += 1
            seqs.append(base_seq[s[0]] + before[s[0]] + seen[s[0]] + k * per_step[s[0]])
        patch("collective_seq_id", seqs, 4)
        patch("op_id", seqs, 4)
        t = [T0 + (first_i + j + k * n) * 1000 for j in range(n)]
        patch("time:created", t, 8)
        patch("time:started", [x + 10 for x in t], 8)
        patch("time:completed", [x + 500 for x in t], 8)
        if rank == self.culprit_shape:  # one TP all_reduce of another shape, mid-ring
            row = bulk[self.shape_step]
            shape = struct.pack("<H", 4096) + b"M" + struct.pack("<H", 1024)
            at = bytes(row).find(b"M" + shape)
            assert at >= 0
            row[at + 1:at + 3] = np.frombuffer(struct.pack("<H", 2048), np.uint8)
        p.out += bulk.tobytes()
        i += bulk_steps * n
        for kind in count:
            count[kind] += bulk_steps * per_step[kind]
        # The last step: the DP all_gather (STEP[4]) never completes; the culprit never issues it.
        for j, s in enumerate(STEP):
            if j < 4:
                one(s)
            elif j == 4:
                if rank % TP == self.culprit_hang % TP and rank != self.culprit_hang:
                    one(s, done=False, started=True)
                elif rank != self.culprit_hang:
                    one(s)
                break
        p.out += b"eu."
        return bytes(p.out)


def synthesize(job: Job, folder: Path) -> int:
    total = 0
    for rank in range(job.ranks):
        data = job.file(rank)
        (folder / f"rank_{rank}").write_bytes(data)
        total += len(data)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--entries", type=int, default=20000)
    ap.add_argument("--keep", help="write the dumps here and keep them (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    job = Job(args.ranks, args.entries)
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distcheck-bench-fr-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        began = time.monotonic()
        (folder / "dumps").mkdir(exist_ok=True)
        total = synthesize(job, folder / "dumps")
        wrote = time.monotonic() - began
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "distcheck", "report", str(folder / "dumps"), "--report-dir",
                               str(folder / "report"), "--format", "json"], env=env, capture_output=True, text=True,
                              timeout=1800)
        seconds = time.monotonic() - began
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        try:
            report = json.loads(proc.stdout)
        except ValueError:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        findings = report["findings"]
        named = {(f["kind"], tuple(f["ranks"])) for f in findings}
        print(f"fr_dumps ranks={job.ranks} entries={job.entries} seconds={seconds:.1f} peak_mb={peak_mb:.0f} "
              f"total_mb={total / 1e6:.0f} written_in={wrote:.0f}s findings={len(findings)}")
        for f in findings:
            print(f"  [{f['kind']}] ranks {f['ranks'][:8]}{'...' if len(f['ranks']) > 8 else ''}: "
                  f"{f['message'][:300]}")
        ok = ("hang", (job.culprit_hang,)) in named and any(k == "collective_mismatch" and job.culprit_shape in r
                                                           for k, r in named)
        if not ok:
            print("fr_dumps: the two bugs were not both named", file=sys.stderr)
            return 1
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
