"""Async collectives the optimizer steps on before anyone waited for them.

    python -m distcheck run --nproc 2 -- fixtures/async_not_waited.py

``dist.all_reduce(p.grad, async_op=True)`` returns a Work and queues the reduction; the gradient holds the reduced
values only once ``work.wait()`` returned (or ``work.is_completed()`` said so). A script that drops the Work and
calls ``optimizer.step()`` reads gradients the backend may still be writing: on NCCL the step runs on the unreduced
(or half-reduced) values and the replicas drift apart; on gloo it usually wins the race, so CPU tests pass.

The tracer hands this watch every Work a call from the user's own code returned (rank/tracer.py, ``on_async``),
with the tensors the call passed; ``Work.wait`` and ``Work.is_completed`` are patched to note that it was waited
for. At each optimizer step (the global pre-hook, rank/autocheck/patches.py) a Work not waited for whose tensors
share storage with a gradient of that optimizer's parameters is a finding, at the collective's line and the
step's, once per line. Works whose tensors are no gradient (a loss reduced for logging and waited for later) are
not the optimizer's business, and are never named.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from distcheck.contract.findings import Finding
from distcheck.rank.usersite import Site, caller_site

PENDING_LIMIT = 256  # Works kept while not waited for; the oldest are forgotten (a leak must not grow memory)


@dataclass
class _Pending:
    work: Any  # held until waited for or stepped over: its id must not be reused meanwhile
    op: str
    storages: frozenset[int]  # data pointers of the storages of the tensors it reduces
    site: Site


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (meta, a functional wrapper)
        return None


def tensors_in(args: tuple, kwargs: dict, Tensor: type) -> list[Any]:
    found = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, Tensor))
    return found


class AsyncWatch:
    def __init__(self, rank: int, emit: Callable[[list[Finding]], None]) -> None:
        self.rank = rank
        self.emit = emit
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        self.reported: set[tuple[str, int]] = set()

    def issued(self, works: list[Any], op: str, tensors: list[Any], site: Site) -> None:
        storages = frozenset(s for s in (_storage(t) for t in tensors) if s)
        if not storages or not site.file:
            return
        for work in works:
            self.pending[id(work)] = _Pending(work, op, storages, site)
            if len(self.pending) > PENDING_LIMIT:
                self.pending.popitem(last=False)

    def waited(self, work: Any) -> None:
        if self.pending:
            self.pending.pop(id(work), None)

    def on_optimizer_step(self, optimizer: Any) -> None:
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
        if not raced:
            return
        step = caller_site()
        findings = []
        for key, w in raced:
            del self.pending[key]
            where = (w.site.file, w.site.line)
            if where in self.reported:
                continue
            self.reported.add(where)
            findings.append(not_waited_finding(self.rank, w.op, w.site, step, type(optimizer).__name__))
        if findings:
            self.emit(findings)


def not_waited_finding(rank: int, op: str, site: Site, step: Site, optimizer: str) -> Finding:
    at = f" at {step.site}" if step.file else ""
    message = (f"{op}(..., async_op=True) at {site.site} reduces gradients that {optimizer}.step()"
               f"{at} read before its Work was waited for: the step can run on gradients the backend is still "
               f"writing (on NCCL the replicas then drift apart; gloo usually wins the race). Fix: keep the Work "
               f"and call work.wait() before optimizer.step()")
    return Finding("tensor_divergence", [rank], message,
                   {"cause": "async_not_waited", "op": op, "file": site.file, "line": site.line,
                    "step_file": step.file, "step_line": step.line, "optimizer": optimizer})
