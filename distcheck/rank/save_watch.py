"""Each ``torch.save`` to a named file, noted with a digest of what was saved: several ranks that write one path
with different contents leave it holding whichever rank wrote last (analysis/shared_files.py finds them).

    python -m distcheck run --nproc 2 -- train.py   # installed in every rank with the zero-code checks

``torch.save(model.state_dict(), "ckpt/model.pt")`` on every FSDP2 rank writes each rank's shards to one file: a
resume from it gives every rank the last writer's shards, silently. Every DDP rank saving the same weights is
harmless (one content), and a rank-0 save or per-rank file names are the fixes. The save itself runs first and
unchanged; what is noted after it: the file's absolute path, this rank's count of saves to it, the digest (each
tensor's fingerprint: a DTensor's local shard, so sharded state differs where it must; each other value's text) and
the user's line. Saves to a file object or a buffer are not noted (no path to compare), nor distcheck's own.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Any, Iterator

from distcheck.contract import saves_file
from distcheck.contract.saves_file import Save

log = logging.getLogger("distcheck")

_LEAVES = 100_000  # a state bigger than this many leaves is digested by its first ones (a bounded walk)
_state: dict[str, Any] = {}


def install(report_dir: str | os.PathLike, rank: int) -> None:
    """Wrap torch.save in this rank (once); called again (the pytest pool, per test), it notes into ``report_dir``
    from then on, counting each path's saves afresh."""
    import torch

    _state.update(report_dir=Path(report_dir).resolve(), rank=rank, counts={}, host=socket.gethostname())
    if _state.get("installed"):
        return
    original = torch.save
    _state["installed"] = True

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            try:
                _note(obj, f)
            except Exception as exc:  # the user's save happened; what distcheck notes of it must never break it
                log.debug("torch.save not noted: %s", exc)
        return out

    torch.save = save


def noted() -> bool:
    """Whether a save to a named file was noted since the last install."""
    return bool(_state.get("counts"))


def _note(obj: Any, f: str | os.PathLike) -> None:
    from distcheck.rank.usersite import caller_site

    path = Path(os.fspath(f)).resolve()
    report_dir = _state["report_dir"]
    if path == report_dir or report_dir in path.parents:  # distcheck's own (compare's module capture)
        return
    counts = _state["counts"]
    counts[path] = counts.get(path, 0) + 1
    where = caller_site(2)
    err = saves_file.append(report_dir, _state["rank"], Save(str(path), _state["host"], counts[path], digest(obj),
                                                             where.file, where.line))
    if err is not None:
        log.debug("could not note a torch.save: %s", err)


def digest(obj: Any) -> str:
    """16 hex digits that differ when any saved tensor's values (a DTensor: its local shard), shapes or dtypes, or
    any other saved value, differ."""
    import torch

    from distcheck.rank.checks.fingerprint import fingerprint_many, local_tensor

    h = hashlib.blake2b(digest_size=8)
    tensors: list[tuple[str, Any]] = []
    for key, leaf in _leaves(obj):
        if isinstance(leaf, torch.Tensor):
            t = local_tensor(leaf)
            tensors.append((key, t))
            h.update(f"{key}|{tuple(t.shape)}|{t.dtype}\n".encode())
        else:
            h.update(f"{key}|{type(leaf).__name__}|{_text(leaf)}\n".encode())
    for key, fp in sorted(fingerprint_many(tensors).items()):
        h.update(f"{key}|{fp.sums}\n".encode())
    return h.hexdigest()


def _text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200]


def _leaves(obj: Any, key: str = "", budget: list[int] | None = None) -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a saved object: dicts, lists and tuples walked, a module by its parameters and buffers."""
    budget = [_LEAVES] if budget is None else budget
    if budget[0] <= 0:
        return
    if callable(getattr(obj, "named_parameters", None)) and callable(getattr(obj, "named_buffers", None)):
        # An nn.Module saved whole: its tensors as they are here, never its state_dict(), which on FSDP1 (a full
        # state dict) all-gathers, and a save on rank 0 alone would then hang the others
        obj = {**dict(obj.named_parameters()), **dict(obj.named_buffers())}
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{key}.{k}", budget)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{key}[{i}]", budget)
    else:
        budget[0] -= 1
        yield key, obj
