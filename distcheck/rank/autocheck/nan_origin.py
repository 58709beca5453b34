"""Where the first NaN/Inf came from, on the rank whose loss went bad first: the batch, or the first module.

    python -m distcheck run --nproc 2 -- fixtures/zc_nan_module.py     # names the module and its line

The NaN watch (nan_watch.py) finds the first step whose loss is not finite, at that step's ``optimizer.step()``
(before the update) or, without an optimizer, right after ``backward()``. By then the forward is over and its
outputs are gone, and a hook on every module of every step to catch them as they happen would cost a read of every
activation. So the watch keeps, per step, only references to what each watched model's forward was called with (a
forward pre-hook on the model: no copy, no compute; dropped at every step), and on the one bad step it:

1. looks at those inputs: a non-finite value there is the batch itself (a corrupt sample);
2. else runs that forward again on the same parameters, under ``no_grad`` and the autocast the step ran under,
   with a hook on every module and a dispatch mode that sees every op: the first module whose output is non-finite
   while its inputs were finite is the origin, and the first op inside it that made a non-finite value from finite
   ones (not a ``masked_fill(..., -inf)``: a non-finite argument is on purpose) gives the user's line.

The re-run changes nothing the script sees: random-number states and every buffer (batch-norm statistics) are
restored after it, gradients are untouched, and no forward hook but its own runs in it (the user's, torch's global
ones and the other checks' are set aside meanwhile). It runs only where no collective can be in the forward (a plain
module, DDP's inner module); a sharded or tensor-parallel model (FSDP, DTensor parameters, SyncBatchNorm) gets
step 1 only, and an op of any process group inside the re-run stops it before anything is sent. On CUDA the watch
reads its check a step later, when the step's inputs are gone: there the origin is not looked for.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("distcheck")

# Forwards kept per step (gradient accumulation's micro-batches): the last ones, so that forwards before the first
# training step (a sanity evaluation) or an inference-only script hold at most this many batches.
HELD_FORWARDS = 16
# The namespaces of torch's collective ops: an op of these inside the re-run would talk to the other ranks.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


@dataclass
class Forward:
    """One call of a watched model's forward: references to its inputs and the autocast it ran under."""

    module: Any
    args: tuple
    kwargs: dict
    autocast: tuple[str, Any] | None  # (device type, dtype) when autocast was on


class HeldInputs:
    """The forwards of the current step (a forward pre-hook on each watched model; cleared at every step)."""

    def __init__(self) -> None:
        self.forwards: deque[Forward] = deque(maxlen=HELD_FORWARDS)
        self._handles: dict[int, Any] = {}

    def watch(self, module: Any) -> None:
        """Keep the inputs of ``module``'s calls (DDP's inner module: its forward is the model's, reached by DDP's
        forward or called directly)."""
        target = getattr(module, "module", module)  # DDP, FSDP1: the wrapped module's call
        if id(target) in self._handles:
            return
        self._handles[id(target)] = target.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        # Inside a torch.compile'd caller (compile(DDP(model))) dynamo traces this hook: it folds to nothing there
        # instead of breaking the user's graph (such a step's inputs are not held).
        if torch.compiler.is_compiling():
            return
        self.forwards.append(Forward(module, args, kwargs, _autocast_now()))

    def clear(self) -> None:
        self.forwards.clear()

    def stop(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.forwards.clear()


def _autocast_now() -> tuple[str, Any] | None:
    import torch

    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def _tensors(value: Any, path: str, Tensor: type, depth: int = 0):
    """(path, tensor) of every tensor in nested args (tuples, lists, dicts, dataclass-like objects left out)."""
    if isinstance(value, Tensor):
        yield path, value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]", Tensor, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}[{k!r}]", Tensor, depth + 1)


def _bad(t: Any) -> bool:
    import torch

    from distcheck.rank.checks.fingerprint import local_tensor

    t = local_tensor(t)  # a DTensor input: this rank's part is what it fed
    return bool(t.is_floating_point() or t.is_complex()) and t.numel() > 0 and not bool(torch.isfinite(t).all())


def _value_name(t: Any) -> str:
    import torch

    from distcheck.rank.checks.fingerprint import local_tensor

    t = local_tensor(t)  # a DTensor input: this rank's part is what it fed
    if bool(torch.isnan(t).any()):
        return "nan"
    return "inf" if bool((t == math.inf).any()) else "-inf"


def batch_origin(forward: Forward) -> dict[str, Any] | None:
    """The first non-finite input of ``forward``: its argument path, value and first index."""
    import torch

    from distcheck.rank.checks.fingerprint import local_tensor

    for side, value in (("args", forward.args), ("kwargs", forward.kwargs)):
        for path, t in _tensors(value, side, torch.Tensor, depth=1):  # the depth they have inside (args, kwargs)
            if _bad(t):
                local = local_tensor(t)
                index = (~torch.isfinite(local)).nonzero()[0].tolist() if local.dim() else []
                return {"where": "batch", "model": _class_name(forward.module), "input": path,
                        "value": _value_name(t), "index": index}
    return None


def _class_name(module: Any) -> str:
    """The user's class of a module (FSDP2 makes ``FSDPNet`` of ``Net`` when it shards it)."""
    return next((c.__name__ for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.fsdp")),
                type(module).__name__)


def replay_refused(module: Any) -> str | None:
    """Why ``module``'s forward cannot be run again on this rank alone (None: it can)."""
    import torch

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = ()
    for m in module.modules():
        if (FSDPModule and isinstance(m, FSDPModule)) or type(m).__name__ == "FullyShardedDataParallel":
            return "the model is sharded (FSDP): its forward gathers parameters from the other ranks"
        if isinstance(m, torch.nn.SyncBatchNorm):
            return "the model has SyncBatchNorm: its forward reduces statistics over the ranks"
    for t in list(module.parameters()) + list(module.buffers()):
        if hasattr(t, "device_mesh"):
            return "the model has DTensor parameters: its forward runs collectives on the mesh"
    return None


class _Found(Exception):
    """Raised from a hook once the origin is known: the rest of the re-run is not needed."""


class _Replay:
    """The hooks and the dispatch mode of one re-run."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.stack: list[str] = []
        self.origin: dict[str, Any] | None = None
        self.first_op: dict[str, Any] | None = None

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        name = self.names.get(id(module), "?")
        if self.stack and any(_bad(t) for _, t in _tensors((args, kwargs), "", torch.Tensor)):
            # A non-finite input from finite ones: the enclosing module's own code made it.
            self._found(self.stack[-1], f"before it called '{name}'")
        self.stack.append(name)

    def post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        import torch

        name = self.stack.pop() if self.stack else self.names.get(id(module), "?")
        if any(_bad(t) for _, t in _tensors(output, "", torch.Tensor)):
            self._found(name, None, module)

    def _found(self, name: str, before: str | None, module: Any = None) -> None:
        origin: dict[str, Any] = {"where": "module", "module": name}
        if module is not None:
            origin["type"] = _class_name(module)
        if before:
            origin["before"] = before
        op = self.first_op
        if op is not None and name in op["stack"]:
            origin.update(op=op["op"], value=op["value"], file=op["file"], line=op["line"])
        self.origin = origin
        raise _Found()

    def op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The first op that made a non-finite value from finite tensors and no non-finite argument."""
        if self.first_op is not None:
            return
        import torch

        outs = [t for _, t in _tensors(out, "", torch.Tensor)]
        if not any(_bad(t) for t in outs):
            return
        ins = list(_tensors((args, kwargs), "", torch.Tensor))
        if any(_bad(t) for _, t in ins) or any(isinstance(a, float) and not math.isfinite(a)
                                               for a in list(args) + list((kwargs or {}).values())):
            return
        from distcheck.rank.usersite import caller_site

        site = caller_site(2)
        self.first_op = {"op": str(func.overloadpacket), "value": _value_name(next(t for t in outs if _bad(t))),
                         "file": site.file, "line": site.line, "stack": tuple(self.stack)}


def _dispatch_mode(replay: _Replay) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in COLLECTIVE_NAMESPACES:
                raise RuntimeError(f"the forward runs {func}: a collective cannot be re-run on one rank")
            out = func(*args, **(kwargs or {}))
            replay.op(func, args, kwargs or {}, out)
            return out

    return Watch()


def _every_forward_hook(root: Any) -> list[dict]:
    """The dicts of forward hooks a call of ``root`` runs: torch's global ones and each submodule's."""
    from torch.nn.modules import module as nn_module

    out: list[dict] = [nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks]
    for m in root.modules():
        out += [m._forward_pre_hooks, m._forward_hooks]
    return out


def module_origin(forward: Forward) -> dict[str, Any]:
    """Run ``forward`` again (see the module docstring) and name the first module whose output is non-finite."""
    import torch

    root = forward.module
    root = getattr(root, "_orig_mod", root)  # torch.compile's wrapper: its eager module
    why = replay_refused(root)
    if why is not None:
        return {"where": "unknown", "why": why}
    names = {id(m): n or "<model>" for n, m in root.named_modules()}  # the user's names: DDP's inner module
    replay = _Replay(names)
    buffers = {id(b): (b, b.detach().clone()) for b in root.buffers()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    hooks = _every_forward_hook(root)
    saved = [(d, list(d.items())) for d in hooks]
    try:
        # Only this re-run's hooks see it: the other checks' (a DDP bypass watch on the inner module, the module
        # summaries, the held inputs), the user's own and torch's global ones are set aside until it ends.
        for d in hooks:
            d.clear()
        for m in root.modules():
            m.register_forward_pre_hook(replay.pre, with_kwargs=True)
            m.register_forward_hook(replay.post, with_kwargs=True)
        autocast = torch.autocast(forward.autocast[0], forward.autocast[1]) if forward.autocast else None
        with torch.no_grad(), _dispatch_mode(replay):
            if autocast is not None:
                with autocast:
                    root(*forward.args, **forward.kwargs)
            else:
                root(*forward.args, **forward.kwargs)
    except _Found:
        pass
    except Exception as exc:  # the re-run itself failed: say so, never disturb the script
        return {"where": "unknown", "why": f"re-running the forward failed: {type(exc).__name__}: {exc}"}
    finally:
        for d, items in saved:
            d.clear()
            d.update(items)
        with torch.no_grad():
            for b, saved in buffers.values():
                b.copy_(saved)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return replay.origin or {"where": "loss", "why": "every module's output was finite: the loss computed from "
                                                     "the model's output is not"}


def locate(forwards: list[Forward], replay: bool = True) -> dict[str, Any] | None:
    """The origin of this step's first NaN/Inf over its held forwards: the first forward whose inputs hold one is
    the batch; else the first forward whose re-run finds a module (``replay=False``: the inputs only)."""
    if not forwards:
        return None
    forwards = list(forwards)
    try:
        for forward in forwards:
            found = batch_origin(forward)
            if found is not None:
                return found
        if not replay:
            return None
        last = None
        for forward in forwards:
            last = module_origin(forward)
            if last["where"] == "module":
                return last
        return last
    except Exception as exc:
        log.warning("distcheck: locating the first NaN/Inf failed: %s: %s", type(exc).__name__, exc)
        return None
