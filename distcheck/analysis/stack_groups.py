"""Parse, collapse and group per-rank stack dumps (py-spy JSON or faulthandler text). Pure: no processes.

Grouping follows MegaScale's stack aggregation: ranks whose main-thread stacks are identical (after collapsing
torch, distcheck and interpreter internals) form one group; groups smaller than the largest are the minority and
are highlighted, because in a hang the few ranks that are somewhere else are almost always the culprit.

Whose frame is whose is decided by distcheck.analysis.frame_owner alone. The user's frames are shown one by one;
a run of one library's frames (lightning, transformers) is shown by the call into it, with its path inside the
package, so a reader sees ``training_step (train.py:40)`` under ``[library] log (lightning/.../module.py:512)``.

Stacks are stored innermost frame first, as py-spy and faulthandler print them ("most recent call first").
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from distcheck.analysis.frame_owner import LIBRARY, TORCH, USER, display_path, native_owner, owner, package
from distcheck.analysis.ops import C10D_OPS, FUNCOL_OPS
from distcheck.contract.findings import SMALL_WORLD, format_ranks, rank_ranges
from distcheck.contract.site import base_name, file_line, with_line

# Names of torch.distributed entry points: a rank whose stack passes through one of these (inside torch) waits in
# that collective. Used when no trace says which collective a rank is in (`distcheck stacks` on a foreign job).
COLLECTIVE_NAMES = frozenset(C10D_OPS) | frozenset(FUNCOL_OPS) | frozenset({
    "wait", "wait_tensor", "new_group", "init_process_group", "destroy_process_group",
})
# Wrapper frames that say nothing about where a rank is; the representative of a collapsed run skips them.
GENERIC_WRAPPERS = frozenset({
    "wrapper", "inner", "_fn", "decorate_context", "__call__", "_call_impl", "_wrapped_call_impl", "fn",
    "wrapped", "_wrapper", "new_fn", "_exception_logger", "_time_logger",
})


@dataclass
class Frame:
    name: str
    file: str  # absolute path for Python frames; library or C file name for native frames
    line: int
    native: bool = False
    locals: dict[str, str] | None = None  # the few locals that name a process (KEPT_LOCALS), from py-spy --locals

    @property
    def basename(self) -> str:
        return os.path.basename(self.file) if self.file else "?"

    @property
    def where(self) -> str:
        """``train.py:88``, the form findings use."""
        return with_line(self.basename, self.line)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "file": self.file, "line": self.line, "native": self.native}
        if self.locals:
            out["locals"] = dict(self.locals)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Frame:
        return cls(str(data.get("name", "?")), str(data.get("file", "")), int(data.get("line") or 0),
                   bool(data.get("native", False)), data.get("locals") or None)


@dataclass
class ThreadStack:
    thread_id: str
    name: str | None
    frames: list[Frame]  # innermost first
    main: bool = False
    active: bool | None = None
    owns_gil: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"thread_id": self.thread_id, "name": self.name, "main": self.main, "active": self.active,
                "owns_gil": self.owns_gil, "frames": [f.to_json() for f in self.frames]}

    def content_key(self) -> tuple:
        """All the thread shows but its id (an id differs on every rank, the stack of ranks in one place not)."""
        return (self.name, self.main, self.active, self.owns_gil,
                tuple((f.name, f.file, f.line, f.native, tuple(sorted(f.locals.items())) if f.locals else None)
                      for f in self.frames))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThreadStack:
        return cls(str(data.get("thread_id", "")), data.get("name"),
                   [Frame.from_json(f) for f in data.get("frames", [])], bool(data.get("main", False)),
                   data.get("active"), data.get("owns_gil"))


@dataclass
class RankStack:
    """One process's dump. ``method`` says what produced it: ``py-spy``, ``py-spy --native`` or ``faulthandler``."""

    rank: int
    pid: int
    host: str
    method: str
    threads: list[ThreadStack] = field(default_factory=list)
    rank_source: str = "RANK"  # where the rank number came from: RANK, LOCAL_RANK or argument order
    world_size: int | None = None
    note: str = ""  # e.g. why a fallback method was used
    role: str = ""  # a process the rank started, not the rank: "DataLoader worker 0", "child process"

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.main:
                return t
        return self.threads[0] if self.threads else None

    def content_key(self) -> tuple:
        """What ranks in the same place share: every thread's stack (:meth:`ThreadStack.content_key`), how it was
        dumped and what the process is; not the rank, pid, host or thread ids."""
        return (self.method, self.rank_source, self.world_size, self.note, self.role,
                tuple(t.content_key() for t in self.threads))

    @property
    def label(self) -> str:
        """``rank 1``, or for a process a rank started ``rank 1's DataLoader worker 0 (pid 4242)``."""
        return f"rank {self.rank}'s {self.role} (pid {self.pid})" if self.role else f"rank {self.rank}"

    def to_json(self) -> dict[str, Any]:
        out = {"rank": self.rank, "pid": self.pid, "host": self.host, "method": self.method,
               "rank_source": self.rank_source, "world_size": self.world_size, "note": self.note,
               "threads": [t.to_json() for t in self.threads]}
        if self.role:
            out["role"] = self.role
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankStack:
        ws = data.get("world_size")
        return cls(int(data["rank"]), int(data.get("pid", 0)), str(data.get("host", "")),
                   str(data.get("method", "")), [ThreadStack.from_json(t) for t in data.get("threads", [])],
                   str(data.get("rank_source", "RANK")), int(ws) if ws is not None else None,
                   str(data.get("note", "")), str(data.get("role", "")))


def stacks_json(stacks: Iterable[RankStack], small: int = SMALL_WORLD) -> tuple[list[dict[str, Any]],
                                                                                list[dict[str, Any]]]:
    """The JSON of many processes' dumps: one entry per process, and the distinct stacks they point at.

    Up to ``small`` processes, each entry is :meth:`RankStack.to_json` (its own threads) and the second list is
    empty. Above, each distinct stack (:meth:`RankStack.content_key`) is stored once, ``{"ranks": "0-4093,4095",
    "count": 4094, "method", "rank_source", "world_size", "note", "role", "threads": [...]}`` (threads without
    their ids), and each process's entry is ``{"rank", "pid", "host", "stack": its index, "thread_ids"}``: a file
    grows with W and the distinct stacks, not with W times the frames.
    """
    stacks = list(stacks)
    if len(stacks) <= small:
        return [st.to_json() for st in stacks], []
    index: dict[tuple, int] = {}
    distinct: list[dict[str, Any]] = []
    members: list[list[int]] = []
    entries = []
    for st in stacks:
        key = st.content_key()
        i = index.get(key)
        if i is None:
            i = index[key] = len(distinct)
            threads = []
            for t in st.threads:
                tj = t.to_json()
                del tj["thread_id"]
                threads.append(tj)
            distinct.append({"method": st.method, "rank_source": st.rank_source, "world_size": st.world_size,
                             "note": st.note, "role": st.role, "threads": threads})
            members.append([])
        members[i].append(st.rank)
        entries.append({"rank": st.rank, "pid": st.pid, "host": st.host, "stack": i,
                        "thread_ids": [t.thread_id for t in st.threads]})
    for d, ranks in zip(distinct, members):
        d["ranks"], d["count"] = rank_ranges(ranks), len(ranks)
    return entries, distinct


def stacks_from_json(entries: Iterable[dict[str, Any]], distinct: Sequence[dict[str, Any]] = ()) -> list[RankStack]:
    """The dumps back from :func:`stacks_json`'s two lists (either form). Processes that share a distinct stack
    share its frame lists."""
    shared: dict[int, list[ThreadStack]] = {}
    out = []
    for e in entries:
        if "stack" not in e:
            out.append(RankStack.from_json(e))
            continue
        i = int(e["stack"])
        if i not in shared:
            shared[i] = [ThreadStack.from_json(t) for t in distinct[i].get("threads", [])]
        ids = list(e.get("thread_ids") or [])
        threads = [ThreadStack(str(ids[j]) if j < len(ids) else "", t.name, t.frames, t.main, t.active, t.owns_gil)
                   for j, t in enumerate(shared[i])]
        d = distinct[i]
        ws = d.get("world_size")
        out.append(RankStack(int(e["rank"]), int(e.get("pid", 0)), str(e.get("host", "")), str(d.get("method", "")),
                             threads, str(d.get("rank_source", "RANK")), int(ws) if ws is not None else None,
                             str(d.get("note", "")), str(d.get("role", ""))))
    return out


# --- parsing -------------------------------------------------------------------------------------------------


def _is_native_file(filename: str) -> bool:
    return not filename.endswith(".py") and not filename.startswith("<")


# The locals kept from ``py-spy dump --locals`` (a process's stack only): the ones that say which process it is.
KEPT_LOCALS = {"_worker_loop": ("worker_id",), "_wrap": ("i",)}


def parse_pyspy_json(data: list[dict[str, Any]], pid: int) -> list[ThreadStack]:
    """Threads from ``py-spy dump --json`` output (already json-decoded). The main thread has os tid == pid."""
    threads: list[ThreadStack] = []
    for entry in data:
        frames = []
        for f in entry.get("frames", []):
            filename = f.get("filename") or f.get("short_filename") or ""
            name = str(f.get("name", "?"))
            kept = None
            wanted = KEPT_LOCALS.get(name.rsplit(".", 1)[-1], ())
            if f.get("locals") and wanted:
                kept = {str(v.get("name")): str(v.get("repr")) for v in f["locals"]
                        if v.get("name") in wanted and v.get("repr") is not None} or None
            frames.append(Frame(name, filename, int(f.get("line") or 0), _is_native_file(filename), kept))
        tid = entry.get("os_thread_id") or entry.get("thread_id")
        is_main = tid == pid or entry.get("thread_name") == "MainThread"
        threads.append(ThreadStack(str(tid), entry.get("thread_name"), frames, is_main,
                                   entry.get("active"), entry.get("owns_gil")))
    if threads and not any(t.main for t in threads):
        _mark_main_by_module(threads)
    return threads


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+?)\s*$')
# The dumper appends this line to a rank's faulthandler file before signalling it, so that the dump it asked
# for can be told apart from earlier ones (faulthandler itself writes no separator between dumps).
FAULTHANDLER_MARKER = "=== distcheck faulthandler dump"


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """Threads of the faulthandler dump after the last marker line (or of the whole text when there is none).

    faulthandler lists the newest thread first, so the main thread is the one whose outermost frame is
    ``<module>``, else the last one listed.
    """
    cut = text.rfind(FAULTHANDLER_MARKER)
    if cut >= 0:
        text = text[cut:]
    threads: list[ThreadStack] = []
    current: ThreadStack | None = None
    for raw in text.splitlines():
        head = _FH_THREAD.match(raw)
        if head:
            current = ThreadStack(head.group(2), "current" if head.group(1) == "Current thread" else None, [])
            threads.append(current)
            continue
        frame = _FH_FRAME.match(raw)
        if frame and current is not None:
            current.frames.append(Frame(frame.group(3), frame.group(1), int(frame.group(2))))
    if threads:
        _mark_main_by_module(threads)
    return threads


def _mark_main_by_module(threads: list[ThreadStack]) -> None:
    for t in threads:
        if t.frames and t.frames[-1].name == "<module>":
            t.main = True
            return
    threads[-1].main = True


# --- collapsing ----------------------------------------------------------------------------------------------


def frame_owner(frame: Frame) -> str:
    """``user``, ``library``, ``torch``, ``distcheck`` or ``python`` (see distcheck.analysis.frame_owner)."""
    return native_owner(frame.file, frame.name) if frame.native else owner(frame.file)


@dataclass(frozen=True)
class ShownFrame:
    """A frame as displayed: a user frame, or a run of ``count`` frames of one owner (of one library) shown by
    their representative."""

    owner: str
    name: str
    file: str
    line: int
    native: bool = False
    count: int = 1

    @property
    def internal(self) -> bool:
        return self.owner != USER

    def text(self) -> str:
        if not self.internal:
            loc = file_line(self.file, self.line) or base_name(self.file)
            return f"{self.name} ({loc})" + ("  [native]" if self.native else "")
        # a library is named by its path inside the package: "module.py" alone says nothing about which library
        path = display_path(self.file) if self.owner == LIBRARY and not self.native else os.path.basename(self.file)
        loc = with_line(path, self.line)
        more = f", {self.count} frames" if self.count > 1 else ""
        return f"[{self.owner}] {self.name} ({loc}{more})"

    def to_json(self) -> dict[str, Any]:
        return {"owner": self.owner, "name": self.name, "file": self.file, "line": self.line,
                "native": self.native, "count": self.count, "text": self.text()}


def _run_key(frame: Frame) -> tuple[str, str]:
    """What one collapsed run shares: its owner, and for a library which library (lightning calling torchmetrics
    stays two runs)."""
    who = frame_owner(frame)
    return who, (package(frame.file) if who == LIBRARY else "")


def collapse(frames: list[Frame]) -> list[ShownFrame]:
    """Replace each run of non-user frames of one owner (one library) by a single representative frame.

    The representative is the outermost frame of the run that is not a generic wrapper: for a collective that is
    the torch.distributed function the user called (``all_reduce``), not the logging wrapper around it; for a
    library, the call the code outside it made into it (lightning's ``log``).
    """
    out: list[ShownFrame] = []
    i = 0
    while i < len(frames):
        key = _run_key(frames[i])
        if key[0] == USER:
            f = frames[i]
            out.append(ShownFrame(USER, f.name, f.file, f.line, f.native))
            i += 1
            continue
        j = i
        while j < len(frames) and _run_key(frames[j]) == key:
            j += 1
        run = frames[i:j]
        rep = next((f for f in reversed(run) if f.name not in GENERIC_WRAPPERS and not f.name.startswith("0x")),
                   run[-1])
        out.append(ShownFrame(key[0], rep.name, rep.file, rep.line, rep.native, len(run)))
        i = j
    return out


def signature(thread: ThreadStack | None) -> tuple:
    """The grouping key: collapsed frames, with non-user runs keyed by owner, library and representative name.

    Their line numbers and frame counts are left out, because ranks blocked in the same collective can be in
    slightly different spots of torch's (or a library's) waiting code; user frames keep their lines, which is what
    tells ranks apart.
    """
    if thread is None:
        return ("<no stack>",)
    key = []
    for s in collapse(thread.frames):
        if s.owner == LIBRARY:
            key.append((s.owner, package(s.file), s.name))
        elif s.internal:
            key.append((s.owner, s.name))
        else:
            key.append((s.name, s.file, s.line))
    return tuple(key)


def user_frame_via(thread: ThreadStack | None) -> tuple[Frame | None, Frame | None]:
    """The innermost Python frame of the user's code, and the library frame it called on the way in (the
    outermost library frame inside it: lightning's ``log`` under the user's ``training_step``), or None."""
    if thread is None:
        return None, None
    via = None
    for f in thread.frames:
        if f.native:
            continue
        who = owner(f.file)
        if who == USER:
            return f, via
        if who == LIBRARY:
            via = f
    return None, None


def innermost_user_frame(thread: ThreadStack | None) -> Frame | None:
    """The innermost Python frame of the user's code: where the user should look. Never a frame of torch, a
    library, the interpreter or distcheck itself (its hooks sit between the user's call and torch's)."""
    return user_frame_via(thread)[0]


# --- processes a rank started ---------------------------------------------------------------------------------


def _in(frame: Frame, suffix: str) -> bool:
    return frame.file.replace(os.sep, "/").endswith(suffix)


def _short(name: str) -> str:
    """A function's own name: py-spy qualifies methods (``Popen.wait``, ``BaseProcess._bootstrap``)."""
    return name.rsplit(".", 1)[-1]


def own_frames(frames: list[Frame]) -> list[Frame]:
    """A forked process's stack without what it inherited: multiprocessing's ``_bootstrap`` is where a forked
    child starts (the frames outside it are its parent's, at the moment of the fork: a DataLoader worker's would
    show the rank's ``for x in loader`` line)."""
    for i, f in enumerate(frames):
        if _short(f.name) == "_bootstrap" and _in(f, "multiprocessing/process.py"):
            return frames[:i + 1]
    return frames


def process_role(stack: RankStack) -> str:
    """What a process a rank started is, from its main thread: ``DataLoader worker 0``, ``spawned process 1``
    (torch.multiprocessing), or ``child process``."""
    main = stack.main_thread()
    for f in main.frames if main else []:
        if _short(f.name) == "_worker_loop" and _in(f, "torch/utils/data/_utils/worker.py"):
            wid = (f.locals or {}).get("worker_id")
            return f"DataLoader worker {wid}" if wid is not None else "DataLoader worker"
        if _short(f.name) == "_wrap" and _in(f, "torch/multiprocessing/spawn.py"):
            index = (f.locals or {}).get("i")
            return f"spawned process {index}" if index is not None else "spawned process"
    return "child process"


# A rank whose main thread is in one of these waits for a process it started (file suffix, function names; None:
# any function of that file).
_WAITS_ON = (
    ("torch/utils/data/dataloader.py", None, "DataLoader"),
    ("subprocess.py", {"wait", "_wait", "communicate", "_communicate", "run", "call", "check_call",
                       "check_output", "_try_wait"}, "process"),
    ("multiprocessing/process.py", {"join"}, "process"),
    ("multiprocessing/popen_fork.py", {"wait", "poll"}, "process"),
    ("multiprocessing/pool.py", None, "process"),
    ("concurrent/futures/process.py", None, "process"),
    ("torch/multiprocessing/spawn.py", None, "process"),
)


def waits_on(thread: ThreadStack | None) -> str | None:
    """``"DataLoader"`` when the thread waits for its DataLoader's workers, ``"process"`` when it waits for a
    process it started (subprocess, multiprocessing, torch.multiprocessing), else None."""
    if thread is None:
        return None
    for f in thread.frames:
        if f.native:
            continue
        name = _short(f.name)
        for suffix, names, what in _WAITS_ON:
            if _in(f, suffix) and (names is None or name in names):
                return what
        if owner(f.file) == USER:
            return None  # the user's own code is further in than any such wait
    return None


def process_group_call(thread: ThreadStack | None) -> bool:
    """Whether the thread is inside torch.distributed's init_process_group (or its rendezvous)."""
    if thread is None:
        return False
    return any(_short(f.name) == "init_process_group" or _in(f, "torch/distributed/rendezvous.py")
               for f in thread.frames if not f.native)


def render_processes(processes: list[RankStack], others: list[str] | None = None) -> str:
    """The processes the ranks started, for stacks.txt: each one's own frames (collapsed), then those that are
    not Python (not dumped). Past SMALL_WORLD processes, those with the same role and frames are shown once."""
    if not processes and not others:
        return ""
    lines = ["", "processes the ranks started (most recent call first):"]
    ordered = sorted(processes, key=lambda s: (s.rank, s.pid))
    shown: dict[tuple, list[RankStack]] = {}
    for ps in ordered:
        main = ps.main_thread()
        frames = tuple(collapse(own_frames(main.frames))) if main else ()
        key = (ps.role, ps.method, frames) if len(ordered) > SMALL_WORLD else (ps.rank, ps.pid)
        shown.setdefault(key, []).append(ps)
    for same in shown.values():
        ps = same[0]
        if len(same) == 1:
            lines.append(f"  {ps.label} via {ps.method}:")
        else:
            lines.append(f"  the {ps.role} of each of {format_ranks([p.rank for p in same])} ({len(same)} processes; "
                         f"{ps.label}) via {ps.method}:")
        main = ps.main_thread()
        for frame in collapse(own_frames(main.frames)) if main else []:
            lines.append(f"     {frame.text()}")
    for line in others or []:
        lines.append(f"  {line}")
    return "\n".join(lines) + "\n"


def stack_collective(thread: ThreadStack | None) -> str | None:
    """The torch.distributed call a stack is blocked in (outermost matching torch frame), or None."""
    if thread is None:
        return None
    found = None
    for f in thread.frames:
        who = frame_owner(f)
        if who == TORCH and "distributed" in f.file and f.name in COLLECTIVE_NAMES:
            found = f.name  # keep going outwards: `wait` inside `barrier` should report `barrier`
        elif who in (USER, LIBRARY) and found:
            break  # the code that made the call: a collective further out is another call
    return found


# --- grouping ------------------------------------------------------------------------------------------------


@dataclass
class StackGroup:
    ranks: list[int]
    shown: list[ShownFrame]
    key: tuple
    minority: bool = False
    methods: list[str] = field(default_factory=list)
    owns_gil: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "rank_ranges": rank_ranges(self.ranks), "size": len(self.ranks),
                "minority": self.minority, "methods": self.methods, "owns_gil": self.owns_gil,
                "frames": [s.to_json() for s in self.shown]}


def group_stacks(stacks: Iterable[RankStack]) -> list[StackGroup]:
    """Group ranks with identical collapsed main-thread stacks; largest group first, minority groups flagged."""
    by_key: dict[tuple, StackGroup] = {}
    for rs in sorted(stacks, key=lambda s: s.rank):
        main = rs.main_thread()
        key = signature(main)
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = StackGroup([], collapse(main.frames) if main else [], key)
        group.ranks.append(rs.rank)
        if rs.method not in group.methods:
            group.methods.append(rs.method)
        # A thread that holds the GIL while not running Python is the "native code holding the GIL" case.
        if main is not None and main.owns_gil:
            group.owns_gil = True
    groups = sorted(by_key.values(), key=lambda g: (-len(g.ranks), g.ranks[0]))
    if len(groups) > 1:
        largest = len(groups[0].ranks)
        for g in groups:
            g.minority = len(g.ranks) < largest
    return groups


def render_groups(groups: list[StackGroup], stacks: list[RankStack], errors: list[str] | None = None,
                  title: str = "") -> str:
    """The text form (stacks.txt): groups with rank lists, minority groups marked, then per-rank methods."""
    n = sum(len(g.ranks) for g in groups)
    lines = []
    if title:
        lines.append(title)
    lines.append(f"{n} rank{'s' if n != 1 else ''} in {len(groups)} stack group{'s' if len(groups) != 1 else ''}"
                 " (most recent call first; torch/distcheck/python internals collapsed, a library shown by the call"
                 " into it)")
    for g in groups:
        mark = "  <-- MINORITY: somewhere other than the rest" if g.minority else ""
        gil = "  [holds the GIL]" if g.owns_gil else ""
        lines.append("")
        lines.append(f"{'!!' if g.minority else '=='} {format_ranks(g.ranks)} ({len(g.ranks)}){gil}{mark}")
        for s in g.shown:
            lines.append(f"     {s.text()}")
    if stacks:
        lines.append("")
        lines.extend(_per_rank_lines(stacks))
    if errors:
        lines.append("")
        lines.append("not dumped:")
        lines.extend(f"  {e}" for e in errors)
    return "\n".join(lines) + "\n"


def _per_rank_lines(stacks: list[RankStack]) -> list[str]:
    """Each rank's pid, host and dump method; past SMALL_WORLD ranks, one line per method (pids in stacks.json)."""
    ordered = sorted(stacks, key=lambda s: s.rank)
    if len(ordered) <= SMALL_WORLD:
        lines = ["per rank:"]
        for rs in ordered:
            src = "" if rs.rank_source == "RANK" else f" (rank from {rs.rank_source})"
            note = f"  {rs.note}" if rs.note else ""
            lines.append(f"  rank {rs.rank}{src}: pid {rs.pid} on {rs.host or '?'} via {rs.method}{note}")
        return lines
    by_how: dict[tuple, list[RankStack]] = {}
    for rs in ordered:
        by_how.setdefault((rs.method, rs.rank_source, rs.note), []).append(rs)
    lines = ["per rank (each rank's pid and host: stacks.json):"]
    for (method, source, note), same in by_how.items():
        hosts = sorted({rs.host or "?" for rs in same})
        on = f"on {hosts[0]}" if len(hosts) == 1 else f"on {len(hosts)} hosts ({hosts[0]} ... {hosts[-1]})"
        src = "" if source == "RANK" else f" (rank from {source})"
        lines.append(f"  {format_ranks([rs.rank for rs in same])}{src}: via {method} {on}"
                     + (f"  {note}" if note else ""))
    return lines


def render_all_threads(stacks: list[RankStack]) -> str:
    """Every thread of every rank, uncollapsed, for the end of stacks.txt. Past SMALL_WORLD processes, those with
    identical threads (all but the thread ids) are shown once, under their rank ranges."""
    ordered = sorted(stacks, key=lambda s: (s.rank, bool(s.role), s.pid))
    if len(ordered) <= SMALL_WORLD:
        same = [[rs] for rs in ordered]
    else:
        by_key: dict[tuple, list[RankStack]] = {}
        for rs in ordered:
            by_key.setdefault(rs.content_key(), []).append(rs)
        same = list(by_key.values())
    lines = []
    for group in same:
        rs = group[0]
        if len(group) > 1:
            what = f"the {rs.role} of each of " if rs.role else ""
            first = rs.label if rs.role else f"rank {rs.rank}, pid {rs.pid}"
            head = (f"{what}{format_ranks([g.rank for g in group])} ({len(group)} processes with these threads; "
                    f"first: {first}, {rs.host}, {rs.method})")
        elif rs.role:
            head = f"{rs.label}, {rs.host}, {rs.method}"
        else:
            head = f"rank {rs.rank} (pid {rs.pid}, {rs.host}, {rs.method})"
        lines.append(f"--- {head} ---")
        for t in rs.threads:
            flags = [x for x, on in (("main", t.main), ("active", t.active), ("holds GIL", t.owns_gil)) if on]
            tid = t.thread_id if len(group) == 1 else ""
            text = f"Thread {tid} {t.name or ''} {'(' + ', '.join(flags) + ')' if flags else ''}"
            lines.append(" ".join(text.split()) if len(group) > 1 else text.rstrip())
            for f in t.frames:
                loc = with_line(f.file, f.line)
                lines.append(f"    {f.name} ({loc})")
        lines.append("")
    return "\n".join(lines)
