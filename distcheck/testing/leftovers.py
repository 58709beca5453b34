"""What a distributed test left behind on its ranks: threads, child processes, collectives nobody completes.

    @pytest.mark.distributed(nprocs=2)
    def test_x(dist_ctx):
        threading.Thread(target=broadcast_later).start()    # FAILED: the test left a thread running:
                                                             # Thread-3 (target broadcast_later at test_x.py:12)
                                                             # on rank 0

A pool rank (testing/pool_worker.py) runs test after test. A test that returns while something of it still runs
would make the next, innocent test hang or fail: a thread that issues a collective a second later, a child process,
an async collective its peers never issued. So when a test body returns, each rank checks (``Watch``):

* **threads** started during the test, from the test's own code, that are still alive after a short grace
  (``GRACE``) and a garbage collection. "Its own code": the first frame that started the thread that is neither the
  standard library nor distcheck is the user's (a ThreadPoolExecutor the test made counts; a thread torch or a
  library starts for itself, such as a DataLoader's pin-memory thread or tqdm's monitor, does not);
* **child processes**: processes that descend from the rank, or carry its environment tag (``ENV_TAG``, so a child
  that started its own session or was orphaned is found too), that were not there before the test, started from
  the test's code (or by a way distcheck does not see, which counts as the test's), still running after the grace;
  they are ended then, so nothing outlives the test;
* **pending collectives**: collectives the rank issued in the test that never completed (from its trace);
* across ranks (``out_of_step``, in the pytest process): a process group on which the ranks issued different
  numbers of collectives, so the next test's collectives would pair with this one's.

Each leftover fails the test, named with where it was started and on which ranks; a failed test retires its pool,
so the next test starts on fresh ranks.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

from distcheck.contract import env
from distcheck.contract.site import file_line

ENV_TAG = env.POOL_WORKER  # set by the pool on each rank: whatever the rank starts inherits it
GRACE = 0.5  # seconds a test's threads and processes get to end by themselves after the test returned

THREAD, PROCESS, COLLECTIVE = "thread", "process", "collective"
HEADLINES = {THREAD: "a thread running", PROCESS: "a child process running", COLLECTIVE: "a collective pending"}


@dataclass
class Leftover:
    """One thing a test left. ``what`` reads the same on every rank that left it (the headline groups ranks by
    it); ``detail`` is this rank's (a pid, where a thread is now)."""

    kind: str
    what: str
    detail: str = ""

    def line(self) -> str:
        detail = f"; {self.detail}" if self.detail else ""
        return f"the test left {HEADLINES[self.kind]}: {self.what}{detail}"


# --- who started it ------------------------------------------------------------------------------------------------


Site = tuple[str, str, int]  # (owner, file, line) of the first frame that is neither python's nor distcheck's


def _creator(frame: FrameType | None) -> Site | None:
    from distcheck.analysis.frame_owner import DISTCHECK, PYTHON, owner

    while frame is not None:
        who = owner(frame.f_code.co_filename)
        if who not in (PYTHON, DISTCHECK):
            return who, frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def _site_text(site: Site | None) -> str:
    return file_line(site[1], site[2]) or "?" if site else "?"


def _is_tests(site: Site | None) -> bool:
    from distcheck.analysis.frame_owner import USER

    return site is not None and site[0] == USER


# --- processes -----------------------------------------------------------------------------------------------------


def _processes(tag: str | None) -> set[int]:
    """Live processes that descend from this one or carry its tag (this process excluded)."""
    from distcheck.processes import environ_holds, live_parents

    me = os.getpid()
    parents = live_parents()
    parents.pop(me, None)
    found = {pid for pid in parents if environ_holds(pid, f"{ENV_TAG}={tag}")} if tag else set()
    for pid in parents:
        seen, up = set(), pid
        while up in parents and up not in seen:  # up the parent chain to this process
            seen.add(up)
            up = parents[up]
            if up == me:
                found.add(pid)
                break
    return found


def _cmdline(pid: int, limit: int = 100) -> str:
    from distcheck.processes import cmdline

    argv = cmdline(pid)
    if argv is None:
        return "?"
    if argv and os.path.basename(argv[0]).startswith("python"):
        argv[0] = "python"
    text = " ".join(argv) or "?"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def end_processes(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL, what the test left; reap the ones that are this process's children."""
    from distcheck.processes import terminate

    terminate(pids, grace=0.5)
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


# --- threads -------------------------------------------------------------------------------------------------------


def _target(thread: threading.Thread) -> tuple[str, str]:
    """(name of what the thread runs, where it is defined)."""
    fn: Any = getattr(thread, "_target", None)
    if fn is None and type(thread).run is not threading.Thread.run:
        fn = type(thread).run
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(thread).__name__
    return name, file_line(code.co_filename, code.co_firstlineno) or "" if code is not None else ""


def _now(thread: threading.Thread) -> str:
    from distcheck.analysis.frame_owner import is_user

    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    while frame is not None and not is_user(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"now in {frame.f_code.co_name} at {file_line(frame.f_code.co_filename, frame.f_lineno)}"


def describe_thread(thread: threading.Thread) -> Leftover:
    name, where = _target(thread)
    label = thread.name
    short = name.rsplit(".", 1)[-1]
    if label.endswith(f" ({short})"):  # Python names threads "Thread-3 (broadcast_later)"
        label = label[:-len(short) - 3]
    what = f"{label} (target {name} at {where})" if where else f"{label} (target {name})"
    detail = [f"started at {_site_text(getattr(thread, '_distcheck_started_at', None))}"]
    if now := _now(thread):
        detail.append(now)
    return Leftover(THREAD, what, ", ".join(detail))


# --- the watch -----------------------------------------------------------------------------------------------------


class Watch:
    """Around one test body on a rank: ``start()`` before it, ``stop()`` after it, then ``find()``.

    While it runs, ``threading.Thread.start``, ``subprocess.Popen``, ``os.fork`` and ``multiprocessing``'s
    ``Process.start`` note who started each thread or process (never changing what they do)."""

    def __init__(self) -> None:
        self.tag = os.environ.get(ENV_TAG)
        self.threads: set[threading.Thread] = set()
        self.processes: set[int] = set()
        self.sites: dict[int, Site | None] = {}  # pid -> who started it
        self.left_pids: list[int] = []  # the processes find() found: the caller ends them
        self._undo: list[Callable[[], None]] = []

    def start(self) -> None:
        self.threads = set(threading.enumerate())
        self.processes = _processes(self.tag)
        self.sites = {}
        self._hook()

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _hook(self) -> None:
        import multiprocessing.process

        sites = self.sites

        def thread_start(original):
            def start(thread, *args, **kwargs):
                thread._distcheck_started_at = _creator(sys._getframe(1))
                return original(thread, *args, **kwargs)
            return start

        def popen_init(original):
            def __init__(popen, *args, **kwargs):
                site = _creator(sys._getframe(1))
                original(popen, *args, **kwargs)
                sites[popen.pid] = site
            return __init__

        def fork(original):
            def fork_():
                site = _creator(sys._getframe(1))
                pid = original()
                if pid:
                    sites[pid] = site
                return pid
            return fork_

        def process_start(original):
            def start(process, *args, **kwargs):
                site = _creator(sys._getframe(1))
                original(process, *args, **kwargs)
                if process.pid:
                    sites.setdefault(process.pid, site)
            return start

        self._patch(threading.Thread, "start", thread_start)
        self._patch(subprocess.Popen, "__init__", popen_init)
        self._patch(os, "fork", fork)
        self._patch(multiprocessing.process.BaseProcess, "start", process_start)

    # -- after the test --

    def _new_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t not in self.threads and t.is_alive() and not isinstance(t, threading._DummyThread)
                and _is_tests(getattr(t, "_distcheck_started_at", None))]

    def _site_of(self, pid: int) -> Site | None:
        """Who started ``pid``, or its nearest ancestor distcheck saw started (None: not seen)."""
        seen = set()
        while pid > 1 and pid not in seen:
            if pid in self.sites:
                return self.sites[pid]
            seen.add(pid)
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    pid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                return None
        return None

    def _new_processes(self) -> list[int]:
        out = []
        for pid in sorted(_processes(self.tag) - self.processes):
            site = self._site_of(pid)
            if site is None or _is_tests(site):  # not seen starting counts as the test's, to be safe
                out.append(pid)
        return out

    def find(self, pending: Callable[[], list[Leftover]] | None = None, grace: float = GRACE) -> list[Leftover]:
        """What the test left, after at most ``grace`` seconds for it to end by itself. ``pending``: this rank's
        collectives that never completed (``pending_collectives``), asked until the grace is over."""
        deadline = time.monotonic() + grace
        collected = False
        while True:
            threads, processes = self._new_threads(), self._new_processes()
            collectives = pending() if pending is not None else []
            if not (threads or processes or collectives) or time.monotonic() >= deadline:
                break
            if not collected:  # test objects in reference cycles may still own threads (and stop them when freed)
                gc.collect()
                collected = True
            for thread in threads:
                thread.join(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            time.sleep(0.02)
        found = [describe_thread(t) for t in threads]
        for pid in processes:
            found.append(Leftover(PROCESS, f"{_cmdline(pid)} (started at {_site_text(self._site_of(pid))})",
                                  f"pid {pid}"))
        self.left_pids = processes
        return found + collectives


def pending_collectives(trace_dir: str, rank: int) -> Callable[[], list[Leftover]]:
    """The collectives this rank issued in the test (its trace in ``trace_dir``) that never completed."""
    from distcheck.analysis.progress import rank_progress
    from distcheck.analysis.trace_events import load_rank_records
    from distcheck.contract import files, trace_slots

    def pending() -> list[Leftover]:
        try:  # the common case first: every record has its end (one pass over the records, no descriptions)
            data = files.rank_file(trace_dir, "trace_events", rank).read_bytes()
            if all(r.t_end is not None for r in trace_slots.iter_slots(data)):
                return []
        except OSError:
            pass
        try:
            # The Python calls only (merge=False): what torch's ring adds (DDP's buckets) ends there, not here.
            trace = load_rank_records(files.rank_file(trace_dir, "trace", rank), rank, merge=False)
        except Exception:  # an unreadable trace is not a leftover
            return []
        out = []
        for ref in rank_progress(rank, trace.events).open:
            what = ref.event.brief() if ref.event is not None else ref.op
            seq = f"#{ref.seq}, " if ref.seq is not None else ""
            out.append(Leftover(COLLECTIVE, f"{what} ({seq}issued at {ref.site or '?'}, never completed)"))
        return out

    return pending


def out_of_step(trace_dir: str) -> dict[int, list[Leftover]]:
    """Process groups on which the ranks issued different numbers of collectives in the test: for each rank that
    issued more, the first collective the others never issued. Read in the pytest process from every rank's trace.
    """
    from distcheck.analysis.ops import PEER_OPS
    from distcheck.analysis.progress import process_group
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract.findings import format_ranks

    traces = load_traces(trace_dir)
    by_group: dict[str, dict[int, list]] = {}
    members: dict[str, list[int]] = {}
    for rank, trace in traces.items():
        for e in sorted(trace.events, key=lambda e: e.id):
            if e.op in PEER_OPS or e.extra.get("untraced"):  # pairs, and what torch's ring adds: the Python calls
                continue
            key = process_group(e)
            by_group.setdefault(key, {}).setdefault(rank, []).append(e)
            if e.pg:
                members.setdefault(key, list(e.pg))
    out: dict[int, list[Leftover]] = {}
    for key, per_rank in by_group.items():
        ranks = [r for r in members.get(key, sorted(traces)) if r in traces]
        counts = {r: len(per_rank.get(r, [])) for r in ranks}
        least = min(counts.values(), default=0)
        if len(set(counts.values())) <= 1:
            continue
        behind = [r for r, c in counts.items() if c == least]
        for rank, count in counts.items():
            if count == least:
                continue
            e = per_rank[rank][least]
            seq = f"#{e.seq}, " if e.seq is not None else ""
            out.setdefault(rank, []).append(Leftover(
                COLLECTIVE, f"{e.brief()} ({seq}issued at {e.site or '?'}, never issued by {format_ranks(behind)})",
                f"{count} collectives on group [{key}] against {least} on {format_ranks(behind)}"))
    return out


def headline(per_rank: dict[int, list[Leftover]]) -> str:
    """One line per thing left, with the ranks that left it: ``the test left a thread running: Thread-3 (target
    broadcast_later at test_x.py:12) on rank 0``."""
    from distcheck.contract.findings import format_ranks

    ranks_of: dict[tuple[str, str], list[int]] = {}
    for rank, items in sorted(per_rank.items()):
        for item in items:
            ranks_of.setdefault((item.kind, item.what), []).append(rank)
    lines = [f"the test left {HEADLINES[kind]}: {what} on {format_ranks(sorted(set(ranks)))}"
             for (kind, what), ranks in ranks_of.items()]
    if lines:
        lines.append("[distcheck] a test must end what it starts (join its threads, wait for its processes and "
                     "its async collectives); the pool of ranks is retired, so the next test starts on fresh ranks")
    return "\n".join(lines)


def rank_text(items: list[Leftover]) -> str:
    """This rank's part of the failure: each thing left with what only this rank knows."""
    return "\n".join(f"[distcheck] {item.line()}" for item in items)
