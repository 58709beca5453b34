"""Async collectives the optimizer steps on before anyone waited for them.

    python -m distcheck run --nproc 2 -- fixtures/async_not_waited.py

``dist.all_reduce(p.grad, async_op=True)`` returns a Work and queues the reduction; the gradient holds the reduced
values only once ``work.wait()`` returned (or ``work.is_completed()`` said so). A script that drops the Work and
calls ``optimizer.step()`` reads gradients the backend may still be writing: on NCCL the step runs on the unreduced
(or half-reduced) values and the replicas drift apart; on gloo it usually wins the race, so CPU tests pass.

The tracer hands this watch every Work a call from the user's own code returned (rank/tracer.py, ``on_async``),
with the tensors the call passed; ``Work.wait``, ``Work.is_completed`` and ``Work.get_future`` are patched to note
that it was waited for (a future handed on is waited for by whoever takes it: a DDP comm hook returns it to DDP).
A Work not waited for is a finding, at the collective's line and the reader's, once per line, when
- an optimizer steps (the global pre-hook, rank/autocheck/patches.py) over gradients that share storage with its
  tensors (a loss reduced for logging and waited for after the step is no gradient: not named then);
- the user's next async collective takes one of its tensors (the two race);
- any other torch call touches the bytes it writes, or overwrites the bytes it sends (rank/autocheck/
  async_reads.py: a TorchFunctionMode on this thread only while such a Work is pending), a sync collective included;
- the script ends (nobody ever waited).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from distcheck.contract.findings import Finding
from distcheck.rank.autocheck.async_reads import (ModeSlot, Span, make_read_mode, overlaps, span, tensors_in,
                                                  written_tensors)
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site, caller_site

# What each collective does to the tensor a finding names (the user's word for it).
VERB = {"all_reduce": "reduces", "reduce": "reduces", "reduce_scatter": "reduces into",
        "reduce_scatter_tensor": "reduces into", "reduce_scatter_single": "reduces into", "broadcast": "broadcasts",
        "all_gather": "gathers into", "all_gather_into_tensor": "gathers into", "all_gather_single": "gathers into",
        "gather": "gathers into", "scatter": "scatters into", "all_to_all": "exchanges",
        "all_to_all_single": "exchanges", "isend": "sends", "irecv": "receives into"}
COLLECTIVES = frozenset(VERB) | {"send", "recv", "barrier", "all_gather_object", "broadcast_object_list"}
PENDING_LIMIT = 256  # Works kept while not waited for; the oldest are forgotten (a leak must not grow memory)
READ_WATCH_STEPS = 3  # optimizer steps in which ops are watched for reading what an async collective still writes


@dataclass
class _Pending:
    work: Any  # held until waited for or stepped over: its id must not be reused meanwhile
    op: str
    storages: frozenset[int]  # data pointers of the storages of the tensors it reduces
    site: Site
    written: list[Span]  # the bytes the backend writes (its output)
    sent: list[Span]  # the bytes it only reads (its input): overwriting them races


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, a functional wrapper)
        return None


class AsyncWatch(Check):
    name = "async_work"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the rank and emit(): its findings go to the run's findings file at once
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        self.reported: set[tuple[str, int]] = set()
        self.reads = ModeSlot(lambda: make_read_mode(self.touched))
        self.watch_reads = True

    def on_async_collective(self, works: list[Any], op: str, args: tuple, kwargs: dict, site: Site) -> None:
        import torch

        self.issued(works, op, tensors_in(args, kwargs, torch.Tensor), site,
                    written_tensors(op, args, kwargs, torch.Tensor))

    def issued(self, works: list[Any], op: str, tensors: list[Any], site: Site,
               written: list[Any] | None = None) -> None:
        """``written``: the tensors the collective writes (None: all of ``tensors``)."""
        storages = frozenset(s for s in (_storage(t) for t in tensors) if s)
        if not storages or not site.file:
            return
        written = tensors if written is None else written
        out = [s for s in map(span, written) if s]
        sent = [s for s in map(span, (t for t in tensors if not any(t is w for w in written))) if s]
        # A second async collective on bytes an earlier one may still be writing, or writing bytes it may still be
        # sending: the two race (other bytes of the same buffer do not: a flat buffer reduced slice by slice).
        touched = [s for s in map(span, tensors) if s]
        again = [(key, w) for key, w in self.pending.items()
                 if any(overlaps(s, w.written) for s in touched) or any(overlaps(s, w.sent) for s in out)]
        self._report(again, lambda w: not_waited_finding(w.op, w.site, site, f"the next {op} on the same tensor",
                                                         "the two reductions race on the tensor"))
        for work in works:
            self.pending[id(work)] = _Pending(work, op, storages, site, out, sent)
            if len(self.pending) > PENDING_LIMIT:
                self.pending.popitem(last=False)
        self.reads.want(bool(self.pending) and self.watch_reads)

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        """After the first steps: a read before the wait sits on a line each step runs, so it showed by then, and
        the mode costs a Python call per torch op while a Work is pending."""
        if step + 1 >= READ_WATCH_STEPS:
            self.watch_reads = False
            self.reads.want(False)

    def on_work_waited(self, work: Any) -> None:
        if self.pending:
            self.pending.pop(id(work), None)
            if not self.pending:
                self.reads.want(False)

    def touched(self, name: str, tensors: list[Any], in_place: bool, kwargs: dict | None) -> None:
        """A torch call (rank/autocheck/async_reads.py) on ``tensors`` while Works are pending."""
        ptrs = {w for p in self.pending.values() for w in p.storages}
        if not any(_storage(t) in ptrs for t in tensors) and not (kwargs and _storage(kwargs.get("out")) in ptrs):
            return  # the common case, cheaply: none of the call's storages is in flight
        spans = [s for s in map(span, tensors) if s]
        if not spans:
            return
        target = span(kwargs["out"]) if kwargs and kwargs.get("out") is not None else spans[0]
        collective = name in COLLECTIVES
        hits, raced_input = [], []
        for key, w in self.pending.items():
            if any(overlaps(s, w.written) for s in spans):
                hits.append((key, w))
            elif in_place and target is not None and overlaps(target, w.sent):
                raced_input.append((key, w))
        if not hits and not raced_input:
            return
        reader = caller_site(2)
        if collective:
            self._report(hits + raced_input, lambda w: not_waited_finding(
                w.op, w.site, reader, f"the next {name} on the same tensor", "the two collectives race on it"))
            return
        self._report(hits, lambda w: not_waited_finding(
            w.op, w.site, reader, f"{name}()", f"it can {'write' if in_place else 'read'} the tensor before the "
            f"{w.op} has {'written' if w.written else 'read'} it (on NCCL; gloo on CPU usually wins the race)"))
        self._report(raced_input, lambda w: not_waited_finding(
            w.op, w.site, reader, f"{name}()", f"it overwrites what the {w.op} may still be sending, so the peers "
            f"can receive the new values"))

    def on_optimizer_step(self, optimizer: Any, step: int) -> None:
        if not self.pending:
            return
        grads = set()
        for group in getattr(optimizer, "param_groups", []):
            for p in group.get("params", []):
                g = getattr(p, "grad", None)
                if g is not None:
                    s = _storage(g)
                    if s:
                        grads.add(s)
        raced = [(key, w) for key, w in self.pending.items() if w.storages & grads]
        if raced:
            step = caller_site()
            self._report(raced, lambda w: not_waited_finding(
                w.op, w.site, step, f"{type(optimizer).__name__}.step()",
                "the step can run on gradients the backend is still writing (on NCCL the replicas then drift "
                "apart; gloo usually wins the race)", gradients=True))

    def finish(self) -> None:
        """The script ended: a Work nobody ever waited for leaves its tensor's value to chance wherever it was
        read."""
        self._report(list(self.pending.items()), lambda w: not_waited_finding(
            w.op, w.site, Site(None, None), "the end of the script", "whatever read its tensor may have read it "
            "before the reduction landed"))
        self.reads.want(False)

    def _report(self, works: list[tuple[int, _Pending]], finding: Callable[[_Pending], Finding]) -> None:
        findings = []
        for key, w in works:
            self.pending.pop(key, None)
            where = (w.site.file, w.site.line)
            if where in self.reported:
                continue
            self.reported.add(where)
            f = finding(w)
            f.ranks = [self.core.rank]
            findings.append(f)
        if not self.pending:
            self.reads.want(False)
        if findings:
            self.core.emit(findings)


def not_waited_finding(op: str, site: Site, reader: Site, what: str, why: str, gradients: bool = False) -> Finding:
    """``all_reduce(..., async_op=True) at train.py:30 reduces gradients that SGD.step() at train.py:31 read before
    its Work was waited for: <why>``; ``reader``: the line that read the tensor (unknown at the end)."""
    at = f" at {reader.site}" if reader.file else ""
    tensor = "gradients that" if gradients else "a tensor that"
    message = (f"{op}(..., async_op=True) at {site.site} {VERB.get(op, 'writes')} {tensor} {what}{at} "
               f"{'read' if gradients else 'reached'} before its Work was waited for: {why}. Fix: keep the Work "
               f"and call work.wait() before {'optimizer.step()' if gradients else 'the tensor is used'}")
    return Finding("tensor_divergence", [], message,
                   {"cause": "async_not_waited", "op": op, "file": site.file, "line": site.line,
                    "reader_file": reader.file, "reader_line": reader.line, "reader": what})
