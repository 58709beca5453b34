"""CUDA completions: when a synchronous collective on CUDA tensors really finished, from a CUDA event after it.

    python -m distcheck run --nproc 2 -- train.py      # NCCL ranks whose Flight Recorder ring is off use it
    python -m pytest -q tests/unit/test_tracer.py -k "event_passes or drain_is_bounded"

NCCL returns from a synchronous collective once it is queued on the stream, so the tracer (rank/tracer.py) cannot
store its end on return. Where NCCL's own ring records the end (the common case: ``completion: flight_recorder``
in the sig line), no event is recorded at all; otherwise this records one after the op and a daemon thread writes
the end into the trace log (rank/trace_log.py) when the event has passed.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable


class CudaCompletions:
    """Ends of synchronous collectives on CUDA tensors: NCCL returns once the op is queued, so an event recorded
    right after it on the current stream passes exactly when the op (and what the stream ran before it) is done.
    One daemon thread polls the pending events in order and writes each end when its event has passed."""

    POLL_S = 0.002

    def __init__(self, write_end: Callable[[int, float], None], new_event: Callable[[], Any],
                 sig_of: Callable[[int], int] | None = None) -> None:
        self._write_end = write_end
        self._new_event = new_event
        # Sigs whose end NCCL's own ring records (Tracer._new_sig): their records stay open, no event of ours.
        self.ring_sigs: set[int] = set()
        self._sig_of = sig_of
        self._free: list[Any] = []  # events are reused: creating one per collective would cost more than the op
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, eid: int) -> None:
        if self.ring_sigs and self._sig_of is not None and self._sig_of(eid) in self.ring_sigs:
            return  # left open: the analysis stores the ring's end into it (analysis/flight_recorder.py)
        event = self._free.pop() if self._free else self._new_event()
        event.record()
        self._pending.append((eid, event))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="distcheck-completions", daemon=True)
            self._thread.start()
        self._wake.set()

    def poll(self) -> int:
        """Write the ends of the events that have passed; returns how many are still pending."""
        pending = self._pending
        while pending:
            eid, event = pending[0]
            if not event.query():
                break  # later events on the same stream cannot have passed either; others are polled next time
            pending.popleft()
            self._write_end(eid, time.time())
            self._free.append(event)
        return len(pending)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while not self._stopped and self.poll():
                time.sleep(self.POLL_S)

    def drain(self, timeout: float) -> None:
        """At the end of tracing: wait (bounded: a hung GPU must not hang the exit) for what is still pending."""
        deadline = time.monotonic() + timeout
        while self.poll() and time.monotonic() < deadline:
            time.sleep(self.POLL_S)
        self._stopped = True
        self._wake.set()

