"""``distcheck.record``: values a training script records for ``distcheck compare``.

    python -m distcheck compare --nproc 2 -- train.py        # runs train.py with 1 rank and with 2, compares records

In the script::

    import distcheck
    distcheck.record("loss", loss)                  # a tensor, a DTensor (its full tensor) or a number
    distcheck.record("model", model)                # an nn.Module: parameters, buffers and gradients (full tensors)
    distcheck.record("logits", out, step=step)      # explicit step; by default an auto counter per name

Outside ``distcheck run``/``compare`` every call returns after one cached check (the decision is taken once, from
DISTCHECK_REPORT_DIR, which distcheck sets in each rank). Under distcheck each rank appends the raw bytes of the
values to ``<report_dir>/records-rank<R>.bin`` and one JSON line per record to ``records-rank<R>.jsonl``, both with
unbuffered ``os.write`` on O_APPEND descriptors: the data goes first, the index line last, so a rank that crashes
or is killed keeps every record whose index line was written and never indexes half-written data. A write the file
system refuses (full, quota, I/O error) never reaches the script: recording stops there for good (the records stay
a prefix), the rank says so once on stderr, and its trace header keeps it for the report. The files' format, and
the writing itself, are contract/records_file.py's; this module turns values into tensors' bytes.

Keyword-only extras of :func:`record` (not part of the public ``distcheck.record`` signature):

- ``rtol=``, ``atol=``: tolerances for this record, stronger than ``compare --rtol/--atol`` and dtype defaults;
  :func:`tolerance` sets them for every later record of a name.
- ``replicated=``: whether every rank must hold the same value. Modules and DTensors are always replicated (their
  full tensors are). Plain tensors and numbers default to "auto": when the ranks agree that value is compared,
  otherwise they are per-rank values (a loss each rank computed on its own shard) and their mean over the ranks is
  compared, which equals the global-batch value for equal shards and mean losses. ``replicated=True`` turns
  disagreement into a ``tensor_divergence`` finding; ``replicated=False`` always compares the mean.

A DTensor (or a module holding DTensors, as under FSDP2 or tensor parallelism) is gathered with ``full_tensor()``,
a collective: record it on every rank, in the same order. So is an FSDP1 module (``FullyShardedDataParallel``):
its flat parameters' chunks are all-gathered per unit and recorded as the original parameters, under their
unwrapped names (rank/checks/fsdp1.py).

Automatic records (zero-code compare). ``distcheck compare`` sets DISTCHECK_AUTO_RECORD_STEPS=K in each rank; for
the first K steps ``distcheck.rank.autocheck`` then records, through :func:`record_auto`, the loss passed to
``backward()`` (``auto/loss``), every parameter after each ``optimizer.step()`` (``auto/params``) and the gradients
the first step used (``auto/grads``). Their index
lines carry ``"auto": true``; the analysis drops them when the script records anything itself.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterator

from distcheck.contract import env, files, records_file
from distcheck.rank.usersite import caller_site

ENV_REPORT_DIR = env.REPORT_DIR  # same variable as distcheck.rank.sink: set by run/compare in each rank
# How many steps autocheck records by itself; set by compare only, so `distcheck run` never pays for it.
ENV_AUTO_STEPS = env.AUTO_RECORD_STEPS
AUTO_LOSS, AUTO_PARAMS = files.AUTO_LOSS, files.AUTO_PARAMS

# Wrapper prefixes that differ between world sizes (DDP only when distributed, torch.compile, FSDP1, activation
# checkpointing): stripped from parameter names so the 1-rank and N-rank module records line up.
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")

log = logging.getLogger("distcheck")

_decided = False
_recorder: _Recorder | None = None
_tolerances: dict[str, tuple[float | None, float | None]] = {}


def record(name: str, value: Any, step: int | None = None, *, rtol: float | None = None,
           atol: float | None = None, replicated: bool | None = None) -> None:
    """Record ``value`` under ``(name, step)`` for ``distcheck compare``; a no-op outside distcheck."""
    if not _decided:
        _decide()
    if _recorder is None:
        return
    _recorder.add(str(name), value, step, rtol, atol, replicated)


def tolerance(name: str, rtol: float | None = None, atol: float | None = None) -> None:
    """Tolerances for every later record of ``name`` (a record's own rtol=/atol= still wins)."""
    for label, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (v >= 0 and v != float("inf")):
            raise ValueError(f"distcheck.rank.records.tolerance({name!r}): {label} must be a finite number >= 0")
    _tolerances[str(name)] = (rtol, atol)


def record_auto(name: str, value: Any, step: int, file: str | None, line: int | None,
                replicated: bool | None = None, dp: tuple[int, int] | None = None, roots: tuple = (),
                gradients: bool = False) -> None:
    """A record distcheck takes by itself (marked ``auto``), at the user's line given by the caller.

    ``value`` is a tensor, or a list of (key, parameter) for a set of parameters (gathered to full tensors: every rank
    must call this at the same point when they are DTensors or FSDP1's, whose units are found in the models
    ``roots``); ``gradients``: record those parameters' gradients instead. ``dp``: this rank's (index, size) among
    the data-parallel ranks, where known, so per-rank values can be summed over the data-parallel ranks only.
    """
    if not _decided:
        _decide()
    if _recorder is None:
        return
    _recorder.add(name, value, step, None, None, replicated, auto=True, site=(file, line), dp=dp, roots=roots,
                  gradients=gradients)


def auto_steps() -> int:
    """K of DISTCHECK_AUTO_RECORD_STEPS (0: no automatic records; also when the value is not a whole number)."""
    text = os.environ.get(ENV_AUTO_STEPS, "").strip()
    return int(text) if text.isdigit() else 0


def active() -> bool:
    """Whether records are being written (this process runs under distcheck run/compare)."""
    if not _decided:
        _decide()
    return _recorder is not None


def _decide() -> None:
    global _decided, _recorder
    report_dir = os.environ.get(ENV_REPORT_DIR)
    _recorder = _Recorder(report_dir, int(os.environ.get("RANK", "0") or 0)) if report_dir else None
    _decided = True


def reset() -> None:
    """Forget the cached decision and close the files (tests; a process that changes DISTCHECK_REPORT_DIR)."""
    global _decided, _recorder
    if _recorder is not None:
        _recorder.close()
    _recorder = None
    _decided = False
    _tolerances.clear()


def normalize_key(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


class _Recorder:
    """This rank's records: values become tensors' bytes here, the files' format is contract/records_file.py's."""

    def __init__(self, report_dir: str, rank: int) -> None:
        self.rank = rank
        self._writer = records_file.Writer(report_dir, rank)
        self._steps: dict[str, int] = {}

    def close(self) -> None:
        self._writer.close()

    def add(self, name: str, value: Any, step: int | None, rtol: float | None, atol: float | None,
            replicated: bool | None, auto: bool = False,
            site: tuple[str | None, int | None] | None = None, dp: tuple[int, int] | None = None,
            roots: tuple = (), gradients: bool = False) -> None:
        if self._writer.failed:  # a prefix, not a sieve: after a lost record nothing later is gathered or indexed
            return
        entry, parts = self._entry(name, value, step, rtol, atol, replicated, auto, site, dp, roots, gradients)
        exc = self._writer.append(entry, parts)
        if exc is not None:
            self._fail(name, exc)

    def _fail(self, name: str, exc: OSError) -> None:
        """A write failed (a full disk): the writer gave back the record's half-written data and stopped."""
        from distcheck.contract.trace_slots import LOST_RECORDS, write_failure
        from distcheck.rank.tracer import note_lost

        note_lost(LOST_RECORDS, exc)
        log.warning("%s (%s): distcheck.record(%r) and every later record are not recorded; the script goes on",
                    write_failure(exc.errno), exc.strerror or exc, name)

    def _entry(self, name: str, value: Any, step: int | None, rtol: float | None, atol: float | None,
               replicated: bool | None, auto: bool, site: tuple[str | None, int | None] | None,
               dp: tuple[int, int] | None = None, roots: tuple = (), gradients: bool = False
               ) -> tuple[records_file.IndexEntry, Iterator[_Part]]:
        """The record's index entry (without its tensors' places) and its tensors, made one at a time as the writer
        takes them: a module's full tensors never all live in memory together."""
        import torch

        if step is None:
            step = self._steps.get(name, 0)
        self._steps[name] = int(step) + 1
        kind, parts, number = "number", iter(()), None
        if isinstance(value, torch.nn.Module):
            kind, parts, replicated = "module", _module_parts(value), True
        elif auto and isinstance(value, list):
            # Automatic parameter records: (name, parameter) pairs an optimizer updates, stored like a module (or,
            # ``gradients``, their gradients); FSDP1's as the full original parameters, like the reference's.
            from distcheck.rank.checks.fsdp1 import full_tensors

            kind, replicated = "module", True
            parts = (_part(normalize_key(n), "parameter", t) for n, t in full_tensors(value, roots, gradients))
        elif isinstance(value, torch.Tensor):
            if callable(getattr(value, "full_tensor", None)):  # a DTensor: its full tensor is every rank's
                replicated = True
            kind, parts = "tensor", (_part("", "tensor", t) for t in (value,))
        elif isinstance(value, (bool, int, float)):
            number = value
        else:
            try:  # numpy scalars and other number-likes
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"distcheck.record({name!r}, ...) takes a tensor, DTensor, number or nn.Module, "
                                f"not {type(value).__name__}") from None
        own_rtol, own_atol = _tolerances.get(name, (None, None))
        if site is None:
            here = caller_site()
            site = (here.file, here.line)
        entry = records_file.IndexEntry(
            name, int(step), kind, value=number, replicated=replicated,
            rtol=rtol if rtol is not None else own_rtol, atol=atol if atol is not None else own_atol,
            file=site[0], line=site[1], auto=auto, dp=(int(dp[0]), int(dp[1])) if dp is not None else None)
        return entry, parts


_Part = tuple[records_file.PartMeta, "bytes | memoryview"]


def _module_parts(module: Any) -> Iterator[_Part]:
    """A module's parameters, buffers and gradients as full tensors (DTensors gathered, FSDP1's flat parameters
    unflattened to the original ones), named as the unwrapped module names them."""
    from distcheck.rank.checks.fsdp1 import full_tensors

    params = list(module.named_parameters())
    for n, t in full_tensors(params, [module]):
        yield _part(normalize_key(n), "parameter", t)
    for n, b in module.named_buffers():
        if b is not None:
            yield _part(normalize_key(n), "buffer", b)
    for n, g in full_tensors(params, [module], gradients=True):
        yield _part(normalize_key(f"{n}.grad"), "gradient", g)


def _part(key: str, role: str, t: Any) -> _Part:
    """One tensor's bytes as the record files hold them: the full tensor of a DTensor, on the CPU, contiguous."""
    import torch

    full = getattr(t, "full_tensor", None)
    if callable(full):  # DTensor: the collective every rank takes part in
        t = full()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # The tensor's own memory, not a copy: the writer writes it before the next tensor is made.
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return records_file.PartMeta(key, role, str(t.dtype).replace("torch.", ""), list(t.shape)), raw
