"""Call keys: how the tracer keys a collective call for its cache of call descriptions (sig lines).

    python -m pytest -q tests/unit/test_tracer.py -k keys_a_call    # the C path's keys against these

A call's description (op, group, shapes, dtypes, the user's line) is written once per distinct call as a ``sig``
line (rank/tracer.py); every later call with the same key reuses it. The key is the call site as ``(id(code),
f_lasti)`` (hashing a code object or computing f_lineno costs up to 0.5 µs each on Python 3.11) and the
arguments as far as they change the description: a tensor by shape, dtype and device kind, never the tensor
itself. rank/_tracefast.c builds the same key for the calls it handles (its ``build_key``); the two paths share one
cache, so the rule here and there must stay the same (tests/unit/test_tracer.py holds them together).
"""
from __future__ import annotations

from typing import Any

# Ops whose sig is not cached (their payload is not described by shapes alone).
UNCACHED = frozenset({"batch_isend_irecv", "all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list"})
CACHE_LIMIT = 4096  # distinct call signatures kept; dynamic shapes must not grow memory without bound

_PLAIN = (int, float, bool, str, type(None))


def _arg_key(value: Any, Tensor: type) -> Any:
    """The part of a call's cache key for one argument: shape, dtype and device kind for a tensor (never the tensor:
    a new one each step must hit the same entry), values for plain data, the same recursively for lists, the object
    itself otherwise (process groups, meshes, reduce ops; held by the cache, so never confused with a later object
    at the same address)."""
    if isinstance(value, Tensor):
        return (value.shape, value.dtype, value.is_cuda)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_arg_key(v, Tensor) for v in value))
    return value


def call_key(frame: Any, args: tuple, kwargs: dict, Tensor: type, gpu_build: bool) -> tuple:
    """The cache key of a call from ``frame`` (the user's): its site as ``(id(code), f_lasti)``, then each positional
    argument (an exact Tensor as shape, dtype[, is_cuda], flat), then each keyword's name and value. _tracefast.c
    builds the same key for the calls it handles; the two paths share one cache."""
    key = [id(frame.f_code), frame.f_lasti] if frame is not None else [0, -1]
    for value in args:
        if type(value) is Tensor:
            key.append(value.shape)
            key.append(value.dtype)
            if gpu_build:
                key.append(value.is_cuda)
        else:
            key.append(_arg_key(value, Tensor))
    if kwargs:
        for pname, value in kwargs.items():
            key.append(pname)
            key.append(_arg_key(value, Tensor))
    return tuple(key)

