"""A synthetic 1024-rank hang through the supervisor's path after the dumps (supervise/hang.diagnose_dumped): the
files and the finding it writes stay under size bounds that grow with the distinct stacks, not with W or W squared,
and still say where every rank is. Sizes are bounded, never times."""
from __future__ import annotations

import json

import pytest

import distcheck.supervise.hang as hang
from distcheck.analysis.hang import progress_from_json
from distcheck.analysis.progress import CollectiveRef, GroupProgress, RankProgress
from distcheck.analysis.stack_groups import RankStack, parse_pyspy_json
from distcheck.contract.findings import per_rank
from distcheck.supervise.stacks import DumpError, DumpResult, load_stacks_document

W = 1024
LOADER, BARRIER = W - 2, W - 1  # rank LOADER stopped early, in its DataLoader; rank BARRIER is in a barrier
SEQ = 500
SITE = "/venv/lib/python3.11/site-packages"
PY = "/usr/lib/python3.11"
TRAIN = "/home/u/proj/train.py"
DATA = "/home/u/proj/data.py"

# Outermost first; each main thread has about 30 frames, as a real FSDP job's.
ENTRY = [("<module>", f"{PY}/runpy.py", 198), ("_run_module_as_main", f"{PY}/runpy.py", 198),
         ("_run_code", f"{PY}/runpy.py", 88), ("<module>", TRAIN, 130), ("main", TRAIN, 120), ("fit", TRAIN, 110)]
TORCH_WAIT = [(name, f"{SITE}/torch/distributed/distributed_c10d.py", 1100 + i)
              for i, name in enumerate(["wait", "_wait", "_poll", "sleep", "_check", "_spin", "_inner", "_block",
                                        "_loop", "_step", "_tick", "_idle", "_park", "_yield", "_rest", "_hold"])]
STEP = ENTRY + [("train_epoch", TRAIN, 96), ("train_step", TRAIN, 88),
                ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
                ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2810)] + TORCH_WAIT
BARRIER_STACK = ENTRY + [("train_epoch", TRAIN, 96), ("save", TRAIN, 60),
                         ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
                         ("barrier", f"{SITE}/torch/distributed/distributed_c10d.py", 4620)] + TORCH_WAIT
LOADER_STACK = ENTRY + [("train_epoch", TRAIN, 41)] + [
    (name, f"{SITE}/torch/utils/data/dataloader.py", 700 + i)
    for i, name in enumerate(["__next__", "_next_data", "_get_data", "_try_get_data"])] + [
    (name, f"{PY}/queue.py", 180 + i) for i, name in enumerate(["get", "wait", "_wait", "acquire", "_acquire",
                                                                "_poll", "_recv", "_read", "_select", "_block",
                                                                "_loop", "_tick", "_idle", "_park", "_rest"])]
POLL_THREAD = [("_bootstrap", f"{PY}/threading.py", 1002), ("run", f"{PY}/threading.py", 982),
               ("_serve", f"{SITE}/distcheck/rank/flight_recorder.py", 170)]
WORKER_BASE = [("_bootstrap", f"{PY}/multiprocessing/process.py", 314), ("run", f"{PY}/multiprocessing/process.py", 108),
               ("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py", 308)]
WORKER_BUSY = WORKER_BASE + [("fetch", f"{SITE}/torch/utils/data/_utils/fetch.py", 52), ("__getitem__", DATA, 30),
                             ("read_record", DATA, 22)]
WORKER_IDLE = WORKER_BASE + [("get", f"{PY}/multiprocessing/queues.py", 113)]


def pyspy(pid: int, threads: list[tuple[str, int, list]]) -> list[dict]:
    """``py-spy dump --json`` output: (thread name, os thread id, frames outermost first) per thread."""
    return [{"pid": pid, "thread_id": 139_000_000_000 + tid, "thread_name": name, "os_thread_id": tid,
             "active": False, "owns_gil": False,
             "frames": [{"name": n, "filename": f, "short_filename": f.rsplit("/", 1)[-1], "line": ln,
                         "module": None, "locals": None, "is_entry": True} for n, f, ln in reversed(frames)]}
            for name, tid, frames in threads]


def rank_stacks() -> list[RankStack]:
    out = []
    for rank in range(W):
        pid = 10_000 + rank
        main = LOADER_STACK if rank == LOADER else BARRIER_STACK if rank == BARRIER else STEP
        threads = pyspy(pid, [("MainThread", pid, main), ("distcheck-flight", pid + 500_000, POLL_THREAD)])
        out.append(RankStack(rank, pid, f"node{rank // 8:03d}", "py-spy", parse_pyspy_json(threads, pid), "RANK", W))
    return out


def worker_stacks() -> list[RankStack]:
    out = []
    for rank in range(W):
        pid = 50_000 + rank
        frames = WORKER_BUSY if rank == LOADER else WORKER_IDLE
        stack = RankStack(rank, pid, f"node{rank // 8:03d}", "py-spy",
                          parse_pyspy_json(pyspy(pid, [("MainThread", pid, frames)]), pid), "RANK", W)
        stack.role = "DataLoader worker 0"
        out.append(stack)
    return out


def progress() -> dict[int, RankProgress]:
    """What the traces say: every rank completed SEQ-1 collectives on the world group; all but LOADER issued the
    next one. Each ref holds its own copy of the group's W ranks, as progress made from trace events does."""
    def ref(op: str, seq: int, line: int, done: bool) -> CollectiveRef:
        return CollectiveRef(op, seq, list(range(W)), f"train.py:{line}", TRAIN, line, seq, done, group="0")

    out = {}
    for rank in range(W):
        done = ref("all_gather", SEQ - 1, 70, True)
        p = RankProgress(rank, done, done, SEQ - 1, SEQ - 1)
        if rank != LOADER:
            p.last_started = p.first_open = ref("barrier" if rank == BARRIER else "all_reduce", SEQ,
                                                60 if rank == BARRIER else 88, False)
            p.open, p.started = [p.first_open], SEQ
        g = p.groups["0"] = GroupProgress("0", list(range(W)), p.started, SEQ - 1)
        g.last, g.first_open = p.last_started, p.first_open
        out[rank] = p
    return out


@pytest.fixture
def hung(tmp_path, monkeypatch):
    made = progress()
    monkeypatch.setattr(hang, "load_progress", lambda report_dir: made)
    stacks = rank_stacks()
    (finding,) = hang.diagnose_dumped(DumpResult(stacks), worker_stacks(), [], tmp_path, False, 60.0, W, "stacks",
                                      None, "no progress for 60s: ")
    return finding, stacks, tmp_path


def test_a_1024_rank_hang_writes_files_and_a_finding_under_size_bounds(hung):
    finding, _, out = hung
    assert finding.kind == "hang" and finding.ranks == [LOADER, BARRIER]
    assert finding.message == (
        f"no progress for 60s: rank {LOADER}'s DataLoader worker 0 (pid {50_000 + LOADER}) is in read_record "
        f"(data.py:22), which rank {LOADER} waits for at train.py:41; rank {BARRIER} is in barrier #{SEQ} "
        f"(train.py:60) while ranks 0-{W - 3} wait in all_reduce #{SEQ} (train.py:88)")
    assert (finding.detail["file"], finding.detail["line"]) == (DATA, 22)
    # The ungrouped forms wrote 15 MB of stacks.json here (each rank's progress names its group's 1024 ranks, five
    # times over) and a finding of 8 MB. Grouped, they grow with the 3 distinct stacks and W, not W squared:
    # stacks.json holds one line of about 90 bytes per dumped process (2048: the ranks and their workers).
    assert (out / "stacks.json").stat().st_size < 256_000
    assert (out / "stacks.txt").stat().st_size < 40_000
    assert len(json.dumps(finding.to_json())) < 100_000


def test_the_grouped_forms_still_say_where_every_rank_is(hung):
    finding, stacks, out = hung
    text = (out / "stacks.txt").read_text()
    assert f"== ranks 0-{W - 3} ({W - 2})" in text and f"!! rank {LOADER} (1)" in text
    assert (f"ranks 0-{W - 3}: last started all_reduce #{SEQ} (train.py:88) PENDING; last completed all_gather "
            f"#{SEQ - 1} (train.py:70)") in text
    assert f"--- ranks 0-{W - 3} ({W - 2} processes with these threads;" in text
    assert f"the DataLoader worker 0 of each of ranks 0-{W - 3},{W - 1} ({W - 1} processes;" in text
    # The finding: every rank's stack and last collectives, shared by the ranks in the same place.
    detail = finding.detail
    assert set(per_rank(detail["stacks"])) == set(range(W)) and len(detail["stacks"]) == 3
    back = progress_from_json(detail["last_collectives"])
    assert set(back) == set(range(W)) and back[0].pending.seq == SEQ and back[0].pending.pg == list(range(W))
    assert list(detail["last_collectives"]) == [f"0-{W - 3}", str(LOADER), str(BARRIER)]
    assert detail["last_collectives"][f"0-{W - 3}"]["first_open"]["pg"] == f"0-{W - 1}"
    assert back[LOADER].pending is None and back[BARRIER].pending.op == "barrier"
    assert [loc["pg"] for loc in detail["locations"] if loc["collective"] == "all_reduce"] == [f"0-{W - 1}"]
    assert [p["count"] for p in detail["processes"]] == [W - 1, 1]
    # stacks.json reads back to every rank's own dump: pid, host, thread ids and frames.
    loaded, errors, doc = load_stacks_document(out / "stacks.json")
    assert errors == [] and len(doc["stacks"]) == 3 and doc["stacks"][0]["ranks"] == f"0-{W - 3}"
    assert [(s.rank, s.pid, s.host) for s in loaded] == [(s.rank, s.pid, s.host) for s in stacks]
    assert [s.content_key() for s in loaded] == [s.content_key() for s in stacks]
    assert [[t.thread_id for t in s.threads] for s in loaded] == [[t.thread_id for t in s.threads] for s in stacks]
    assert doc["last_collectives"][str(BARRIER)]["first_open"]["pg"] == list(range(W))


def test_ranks_that_could_not_be_dumped_are_named_in_a_bounded_message(tmp_path, monkeypatch):
    # Half the ranks have traces (and wait in all_reduce), the other half neither a stack nor a trace: each rank's
    # dump error names its pid, so listing every reason would make the message and the detail grow with W.
    made = {r: p for r, p in progress().items() if r < W // 2}
    monkeypatch.setattr(hang, "load_progress", lambda report_dir: made)
    errors = [DumpError(10_000 + r, "permission", f"pid {10_000 + r} (python): permission denied to read its stack",
                        r) for r in range(W)]
    (finding,) = hang.diagnose_dumped(DumpResult(errors=errors), [], [], tmp_path, False, 60.0, W, "stacks", None,
                                      "no progress for 60s: ")
    assert finding.message.startswith(f"no progress for 60s: all {W // 2} ranks wait in all_reduce #{SEQ} "
                                      f"(train.py:88); ranks {W // 2}-{W - 1} not dumped (pid {10_000 + W // 2} ")
    assert f"+{W // 2 - 8} more in stacks.txt): ranks {W // 2}-{W - 1} never arrived in all_reduce #{SEQ}" in \
        finding.message and len(finding.message) < 1500
    assert finding.ranks == list(range(W // 2, W))
    assert len(finding.detail["errors"]) == 65 and finding.detail["errors"][-1] == f"... and {W - 64} more (stacks.json)"
    assert len(json.dumps(finding.to_json())) < 60_000
    assert len(load_stacks_document(tmp_path / "stacks.json")[1]) == W  # every error stays in stacks.json
