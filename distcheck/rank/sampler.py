"""Where this rank's main thread is, SAMPLE_HZ (10) times a second: the user's line and what it is doing there.

    python -m distcheck run --nproc 2 -- train.py        # every rank samples itself (DISTCHECK_SAMPLE=0: off)

A daemon thread reads the main thread's frame (``sys._current_frames``: no signal, no ptrace, the GIL for a few
microseconds) and notes the innermost frame of the user's code with what the stack says it is in: data loading
(torch.utils.data), forward (a module's call), backward (torch.autograd), an optimizer step (torch.optim), a
collective (distcheck's tracer wrapper), a host sync, or the user's own code (sleeps, Python work). A host sync is
where the device hands a value to Python: a tensor being printed (torch/_tensor_str.py), or the user's line itself
inside ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` or ``torch.cuda.synchronize()``. Those are C calls with no
frame of their own, so the sampler reads the user's line: one that calls one of those (``_on_a_sync_line``, from
the code object's instructions, once per code object). Batches of samples
are appended to ``samples-rank<R>.jsonl`` once a
second (contract/samples_file.py); analysis/stragglers.py reads them to say where a late rank spent the time the
others waited for it. Bounded: after MAX_SAMPLES samples the thread stops.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from distcheck.analysis.frame_owner import DISTCHECK, USER, in_torch_nn, owner, torch_phase
from distcheck.contract import env, files, samples_file
from distcheck.contract.samples_file import Place

SAMPLE_HZ = 10.0
FLUSH_EVERY = 1.0
MAX_SAMPLES = 200_000  # ~5.5 hours at 10 Hz; a line per second

_thread: threading.Thread | None = None


_FILES: dict[str, tuple[bool, str | None, bool, bool]] = {}  # file -> (user's, kind, torch.nn, distcheck)


def _file(name: str) -> tuple[bool, str | None, bool, bool]:
    """What a file says about a frame in it, once per file: the sampler walks the same files 10 times a second."""
    hit = _FILES.get(name)
    if hit is None:
        who = owner(name)
        hit = _FILES[name] = (who == USER, torch_phase(name), in_torch_nn(name), who == DISTCHECK)
    return hit


# Calls that make the host wait for the device (on a GPU; on a CPU they are conversions): a rank that is late because
# it logs a metric with .item() every step spends the others' wait here.
SYNC_CALLS = frozenset({"item", "tolist", "cpu", "numpy", "synchronize"})
_SYNC_LINES: dict[Any, frozenset] = {}  # code object -> its lines that call one of SYNC_CALLS


def _on_a_sync_line(frame: Any) -> bool:
    """The innermost frame is on a line that calls one of SYNC_CALLS (``total += loss.item()``,
    ``torch.cuda.synchronize()``). By line, not by instruction: the sampler gets the GIL when the main thread
    lets go of it, at a call or a loop's jump as often as inside the sync itself, and all of those are the sync's
    line."""
    lines = _SYNC_LINES.get(frame.f_code)
    if lines is None:
        import dis

        if len(_SYNC_LINES) > 4096:  # bounded: a program that makes code objects on the fly
            _SYNC_LINES.clear()
        lines = set()
        for ins in dis.get_instructions(frame.f_code):
            # positions (3.11+): the instruction's own line; starts_line is a flag, not a number, from 3.13 on
            line = ins.positions.lineno if ins.positions is not None else None
            if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in SYNC_CALLS and line is not None:
                lines.add(line)
        lines = _SYNC_LINES[frame.f_code] = frozenset(lines)
    return frame.f_lineno in lines


def _kind(frame: Any) -> str:
    """What the stack from ``frame`` outwards is doing, by the innermost frame that says so."""
    innermost = frame
    while frame is not None:
        code = frame.f_code
        if frame is innermost and _file(code.co_filename)[0] and _on_a_sync_line(frame):
            return "host sync"
        _, kind, nn, ours = _file(code.co_filename)
        if kind is not None:
            return kind
        if nn and code.co_name in ("_call_impl", "_wrapped_call_impl"):
            return "forward"
        if ours and code.co_name == "traced":
            return "a collective"
        frame = frame.f_back
    return "its own code"


def _user_frame(frame: Any) -> Any:
    while frame is not None:
        if _file(frame.f_code.co_filename)[0]:
            return frame
        frame = frame.f_back
    return None


class Sampler(threading.Thread):
    def __init__(self, report_dir: str | os.PathLike, rank: int) -> None:
        super().__init__(name="distcheck-sampler", daemon=True)
        self.path = samples_file.path(report_dir, rank)
        self.main = threading.main_thread().ident
        self.places: dict[Place, int] = {}
        self.new: list[dict] = []
        self.times: list[float] = []
        self.sites: list[int] = []
        self.count = 0
        self.lock = threading.Lock()  # the rank's main thread flushes at its script's end

    def sample(self) -> None:
        frame = sys._current_frames().get(self.main)
        user = _user_frame(frame)
        if user is None:
            return
        kind = _kind(frame)
        place = Place(user.f_code.co_filename, user.f_lineno, user.f_code.co_name, kind)
        with self.lock:
            index = self.places.get(place)
            if index is None:
                index = self.places[place] = len(self.places)
                self.new.append(samples_file.place_line(index, place))
            self.times.append(time.time())
            self.sites.append(index)
            self.count += 1

    def flush(self) -> None:
        with self.lock:
            if not self.times and not self.new:
                return
            lines = self.new + ([samples_file.batch_line(self.times, self.sites)] if self.times else [])
            self.new, self.times, self.sites = [], [], []
        data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                files.append_whole(fd, data)
            finally:
                os.close(fd)
        except OSError:  # a full disk: the samples are a nicety, never the run's problem
            pass

    def run(self) -> None:
        interval, last_flush = 1.0 / SAMPLE_HZ, time.monotonic()
        while self.count < MAX_SAMPLES:
            time.sleep(interval)
            try:
                self.sample()
            except Exception:  # the main thread ending under us, an interpreter shutting down
                return
            if time.monotonic() - last_flush >= FLUSH_EVERY:
                self.flush()
                last_flush = time.monotonic()
        self.flush()


def install(report_dir: str | os.PathLike, rank: int) -> Sampler | None:
    """Start sampling this rank (once); None when DISTCHECK_SAMPLE=0."""
    global _thread
    if _thread is not None or os.environ.get(env.SAMPLE, "1").strip() in ("0", "false", "no", "off"):
        return None
    samples_file.path(report_dir, rank).unlink(missing_ok=True)
    _thread = Sampler(report_dir, rank)
    _thread.start()
    return _thread


def flush() -> None:
    """Write what was sampled so far (the rank's script ended)."""
    if _thread is not None:
        _thread.flush()
