"""Words for where a rank's first NaN/Inf came from (found in the rank by rank/autocheck/nan_origin.py).

    python -m distcheck run --nproc 2 -- fixtures/zc_nan_module.py     # "... 'gate' (Gate): its torch.exp at ..."

The origin is a plain dict in the rank's first-bad event: ``{"where": "batch" | "module" | "loss" | "unknown",
...}``; :func:`origin_text` turns it into the clause the ``bad_values`` finding carries, and :func:`origin_site`
into the finding's line when the rank saw the op that made the first non-finite value.
"""
from __future__ import annotations

from typing import Any

from distcheck.contract.site import file_line


def _op_name(op: str) -> str:
    """``aten.exp`` as the user wrote it: ``torch.exp``."""
    return "torch." + op.removeprefix("aten.") if op.startswith("aten.") else op


def origin_text(origin: dict[str, Any] | None, rank: int) -> str | None:
    """One clause saying where ``rank``'s first NaN/Inf arose, or None when nothing is known."""
    if not origin:
        return None
    where = origin.get("where")
    if where == "batch":
        at = f" at index {origin['index']}" if origin.get("index") else ""
        return (f"on rank {rank} the batch itself already holds {origin.get('value', 'nan')}: input "
                f"{origin.get('input') or '?'} of {origin.get('model', 'the model')}.forward{at}")
    if where == "module":
        name = f"'{origin['module']}'" + (f" ({origin['type']})" if origin.get("type") else "")
        if origin.get("before"):
            text = f"on rank {rank} the first non-finite value in forward order was made by {name}'s own code, " \
                   f"{origin['before']}"
        else:
            text = f"on rank {rank} the first module in forward order whose output is not finite (its inputs " \
                   f"were) is {name}"
        site = file_line(origin.get("file"), origin.get("line"))
        if origin.get("op") and site:
            text += f": its {_op_name(origin['op'])} at {site} made {origin.get('value', 'nan')} from finite values"
        return text
    if where == "loss":
        return f"on rank {rank} every module's output was finite: the loss computed from the model's output is not"
    if where == "unknown" and origin.get("why"):
        return f"where in the forward it arose is not known ({origin['why']})"
    return None


def origin_site(origin: dict[str, Any] | None) -> tuple[str, int] | None:
    """The user's line that made the first non-finite value, when the rank saw it."""
    if origin and origin.get("where") == "module" and origin.get("file") and origin.get("line"):
        return origin["file"], int(origin["line"])
    return None
