"""torch's distributed error messages, translated into what a person can act on. Pure: text in, text out.

    python -m distcheck run --nproc 2 -- train.py    # a rank that raises one of these gets the translated message

A rank that raises records the exception in its trace (rank/entry.py), together with what only the rank knows:
the names of the parameters of the DDP modules it trained, in DDP's own order. :func:`translate` turns torch's
text into a message that names parameters and lines instead of indices; torch's text stays in the finding's
``detail.error``. Only the errors below are translated so far (the rest keep torch's first line).

* DDP unused parameters ("Expected to have finished reduction in the prior iteration ... Parameter indices which
  did not receive grad for rank 0: 4 5", or the names under TORCH_DISTRIBUTED_DEBUG=INFO/DETAIL).
"""
from __future__ import annotations

import re
from typing import Any

_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+:\s*([\d ]+)")
_DDP_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+:\s*([^\n]+)")
_SHOWN = 4  # parameter names a message lists before "(+N more)"


def _ddp_unused(message: str, context: dict[str, Any]) -> dict[str, Any] | None:
    if _DDP_UNUSED not in message:
        return None
    names: list[str] = []
    match = _DDP_NAMES.search(message)
    if match:
        names = [n.strip() for n in match.group(1).split(",") if n.strip()]
    else:
        match = _DDP_INDICES.search(message)
        order = context.get("ddp_params") or []
        if match and order:
            names = [order[int(i)] for i in match.group(1).split() if int(i) < len(order)]
    sites: dict[str, str] = context.get("param_sites") or {}
    where = []
    for name in names:
        site = sites.get(name)
        if site and site not in where:
            where.append(site)
    if names:
        shown = ", ".join(f"'{n}'" for n in names[:_SHOWN]) + (f" (+{len(names) - _SHOWN} more)"
                                                               if len(names) > _SHOWN else "")
        what = (f"DDP: {len(names)} parameter{'s' if len(names) != 1 else ''} got no gradient, so DDP's gradient "
                f"reduction never finished and the next forward failed: {shown}"
                + (f" (created at {', '.join(where[:_SHOWN])})" if where else ""))
    else:
        what = ("DDP: some parameters got no gradient, so DDP's gradient reduction never finished and the next "
                "forward failed (torch did not say which)")
    fixes = ("use them in the loss, or take them out of the model or set requires_grad_(False) on them; or pass "
             "find_unused_parameters=True to DistributedDataParallel (an extra graph traversal every step)")
    detail: dict[str, Any] = {"translated": "ddp_unused_parameters", "unused_params": names, "fixes": fixes}
    return {"message": f"{what}. Fix: {fixes}", "detail": detail}


_TRANSLATORS = (_ddp_unused,)


def translate(exc_type: str, message: str, context: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``{"message": ..., "detail": {...}}`` for an error distcheck knows, else None. ``context``: what the rank
    knew (``ddp_params``: names in DDP's index order; ``param_sites``: name -> "file.py:LINE")."""
    context = context or {}
    for translator in _TRANSLATORS:
        try:
            out = translator(message, context)
        except (ValueError, IndexError, TypeError):  # an unexpected variant of the text: keep torch's own
            out = None
        if out is not None:
            return out
    return None
