"""Ops that touch a tensor an async collective is still writing (or sending), before its Work was waited for.

    python -m distcheck run --nproc 2 -- fixtures/async_read_before_wait.py

Only while the user's own line holds a Work not yet waited for (rank/autocheck/async_work.py), a TorchFunctionMode
sits on this thread's mode stack and looks at each torch call's tensors: a call that reads or writes bytes the
collective writes (its output: the all-reduced tensor, the gathered list, the received buffer), or that writes bytes
it is still sending (its input, by an in-place op or ``out=``), races the backend. On NCCL the read sees the values
before (or half through) the reduction; gloo usually wins the race on CPU.

Bytes, not tensors: a view shares its base's storage, and a flat buffer whose slices are reduced one by one is
touched safely outside the slice in flight, so each tensor is a byte range of its storage. Views and metadata
(``t[:2]``, ``t.view``, ``t.shape``) touch no bytes: the view is checked where it is used.

No cost when nothing is pending: the mode is pushed when the first Work is issued and popped once all are waited
for. It costs a Python call per torch op while a Work is pending, so it watches the first 3 optimizer steps only
(``READ_WATCH_STEPS`` in rank/autocheck/__init__.py; a program that never steps is watched throughout): the racing
read sits on a line each step runs.

Pushed only onto an empty mode stack, so a user's ``with`` of their own mode never pops ours (a mode's exit pops the
top), and popped only while it is on top; otherwise (inside its own call, which takes it off the stack for the
call's duration) it turns into a pass-through until the next Work or wait pops it. Inside torch.compile the mode
passes every call through, so a traced graph has nothing of it; a failure of the watch itself never reaches the op.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from distcheck.analysis.frame_owner import DISTCHECK, owner

log = logging.getLogger("distcheck")

# The argument an async collective writes: (position, keyword). isend writes nothing (its input is only read).
WRITTEN_ARG = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather": (0, "tensor_list"), "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_single": (0, "output_tensor"), "reduce_scatter": (0, "output"), "reduce_scatter_tensor": (0, "output"),
    "reduce_scatter_single": (0, "output"),
    "all_to_all": (0, "output_tensor_list"), "all_to_all_single": (0, "output"),
    "gather": (1, "gather_list"), "scatter": (0, "tensor"), "irecv": (0, "tensor"), "recv": (0, "tensor"),
}
# Calls that touch no bytes: metadata, and views (their own use is checked, they share the storage).
NO_BYTES = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "data_ptr", "untyped_storage", "_typed_storage", "storage", "element_size", "__len__", "__hash__", "get_device",
    "is_floating_point", "is_complex", "dim_order", "register_hook", "requires_grad_", "type", "is_pinned",
    "view", "view_as", "as_strided", "narrow", "select", "split", "chunk", "unbind", "t", "transpose", "permute",
    "expand", "expand_as", "squeeze", "unsqueeze", "unflatten", "detach", "__getitem__", "diagonal", "movedim",
    "_is_view", "is_shared", "is_set_to", "__torch_function__",
})

Span = tuple[int, int, int]  # (storage data pointer, first byte, one past the last byte)


def span(t: Any) -> Span | None:
    """The bytes of its storage a tensor covers (strided: from its first element to its last)."""
    try:
        ptr = t.untyped_storage().data_ptr()
        size = t.element_size()
        first = t.storage_offset() * size
        if t.numel() == 0:
            return None
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
        return ptr, first, first + extent * size
    except Exception:  # a tensor without storage (meta, a functional or subclass wrapper)
        return None


def tensors_in(args: tuple, kwargs: dict, Tensor: type) -> list[Any]:
    """The tensors a call passes, at the top level or in a list: what a collective reduces, what an op touches."""
    found = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, Tensor))
    return found


def overlaps(a: Span, spans: list[Span]) -> bool:
    return any(a[0] == b[0] and a[1] < b[2] and b[1] < a[2] for b in spans)


def written_tensors(op: str, args: tuple, kwargs: dict, Tensor: type) -> list[Any] | None:
    """The tensors an async ``op`` writes, or None when the table does not know the op (then all of them)."""
    where = WRITTEN_ARG.get(op)
    if where is None:
        return [] if op in ("isend", "send") else None
    pos, key = where
    value = kwargs.get(key, args[pos] if len(args) > pos else None)
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def is_in_place(name: str, kwargs: dict | None) -> bool:
    """``add_``, ``copy_``, ``__iadd__``, ``t[i] = v``, ``out=``: the call writes its first tensor (or ``out``)."""
    if kwargs and kwargs.get("out") is not None:
        return True
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__")) \
        or name == "__setitem__"


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def make_read_mode(on_touch: Callable[[str, list[Any], bool, dict | None], None]) -> Any:
    """A TorchFunctionMode that hands ``on_touch(name, tensors, in_place, kwargs)`` every call made from outside
    distcheck while it is active; distcheck's own calls (the tracer's fingerprints) pass unseen."""
    from torch.overrides import TorchFunctionMode

    import torch

    Tensor = torch.Tensor
    # Dynamo folds this call to True wherever it inlines the mode: a traced graph then holds none of the watch.
    is_compiling = torch.compiler.is_compiling

    class AsyncReadMode(TorchFunctionMode):
        active = True

        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if self.active and not is_compiling():
                try:
                    name = _name(func)
                    if name not in NO_BYTES and owner(sys._getframe(1).f_code.co_filename) != DISTCHECK:
                        found = tensors_in(args, kwargs or {}, Tensor)
                        if found:
                            on_touch(name, found, is_in_place(name, kwargs), kwargs)
                except Exception as exc:  # the check must never break the user's op
                    log.debug("distcheck: async read watch failed on %s: %s", getattr(func, "__name__", func), exc)
            return func(*args, **(kwargs or {}))

    return AsyncReadMode()


class ModeSlot:
    """Pushes the mode onto this thread's empty mode stack and pops it while on top (see the module docstring)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.mode: Any = None
        self.thread: int | None = None

    def want(self, on: bool) -> None:
        import threading

        import torch

        if self.mode is not None and self.thread != threading.get_ident():
            self.mode.active = on  # another thread's stack: only the owner thread pushes or pops it
            return
        if on:
            if self.mode is None:
                if torch._C._len_torch_function_stack() != 0:
                    return  # the user's own mode is on: pushing ours above it would let its exit pop ours
                self.mode, self.thread = self.make(), threading.get_ident()
                torch._C._push_on_torch_function_stack(self.mode)
            self.mode.active = True
            return
        if self.mode is None:
            return
        self.mode.active = False
        stack = torch.overrides._get_current_function_mode_stack()
        if stack and stack[-1] is self.mode:
            torch._C._pop_torch_function_stack()
            self.mode = self.thread = None
