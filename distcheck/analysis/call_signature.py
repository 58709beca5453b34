"""What must be identical on every rank of a group at one position of its sequence: a collective's signature.

    from distcheck.analysis.call_signature import signature
    signature(event) == signature(peer_event)     # the same collective, as the alignment compares them

The alignment's rule per op (analysis/trace_align.py), shared with the summaries of big jobs' traces
(analysis/trace_summary.py), which number the signatures of each call once. Pure; an event is anything with
TraceEvent's fields (op, shapes, dtypes, reduce_op, root, extra).
"""
from __future__ import annotations

from typing import Any

# Ops that are the same backend collective under different API names (c10d vs functional, old vs new names).
_CANONICAL = {
    "all_gather_into_tensor": "all_gather_single", "all_gather_tensor": "all_gather_single",
    "all_gather_single_autograd": "all_gather_single", "all_gather_tensor_autograd": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single", "reduce_scatter_single_autograd": "reduce_scatter_single",
    "reduce_scatter_tensor_autograd": "reduce_scatter_single", "all_to_all_single_autograd": "all_to_all_single",
    "all_gather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "all_reduce_inplace": "all_reduce", "monitored_barrier": "barrier",
}
_OBJECT_OPS = frozenset({"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"})


def canonical_op(op: str) -> str:
    return _CANONICAL.get(op, op)


def signature(e: Any) -> tuple:
    """What must be identical on every rank of the group at one position, per op.

    Returns (op, shapes, dtypes, reduce_op, root, extra) with shapes reduced to what the op requires to agree.
    """
    op = canonical_op(e.op)
    shapes: Any = [tuple(s) for s in e.shapes]
    dtypes: Any = tuple(e.dtypes)
    if op in _OBJECT_OPS:
        # Pickled payloads differ in size by design; the op, root and list length must agree.
        return (op, None, None, None, e.root, e.extra.get("objects"))
    if op == "all_gather" and len(shapes) >= 2:
        shapes = shapes[:-1]  # the output list must agree; each rank's input fills its own slot (uneven is legal)
        dtypes = dtypes[:-1]
    elif op in ("gather", "scatter"):
        shapes, dtypes = shapes[:1], dtypes[:1]  # the list is only passed on the root
    elif op == "reduce_scatter" and len(shapes) >= 2:
        shapes, dtypes = shapes[1:], dtypes[1:]
    elif op == "all_to_all":
        shapes = len(shapes)  # per-peer sizes may differ; the number of peers may not
    elif op == "all_to_all_single" and e.extra.get("uneven"):
        shapes = [s[1:] for s in shapes]
    return (op, tuple(shapes) if isinstance(shapes, list) else shapes, dtypes, e.reduce_op, e.root, None)


_FIELDS = ("op", "shapes", "dtypes", "reduce_op", "root", "objects")


def differing_fields(events: list[Any]) -> list[str]:
    sigs = [signature(e) for e in events]
    return [name for i, name in enumerate(_FIELDS) if len({repr(s[i]) for s in sigs}) > 1]
