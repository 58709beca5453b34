"""Per-module summaries of the first training step, for ``compare`` to name the first module that diverges.

    python -m distcheck compare --nproc 2 -- train.py      # DISTCHECK_AUTO_RECORD_STEPS=K in the ranks: on

Until the first ``optimizer.step()`` (or the end of the first ``backward()`` without an optimizer), global forward
hooks summarize the input (as the caller passed it, before a parallel style's own input hook) and the output of
every module on its first call, in the order modules finish, and a tensor hook on its input summarizes the
gradient that flows back to that input. A summary is per sample (the output's
dim 0): the sum and the sum of squares of each sample's values, in float64. So the 1-rank reference and the N-rank
run line up without gathering a tensor: data-parallel ranks' samples concatenate in rank order, a tensor-parallel
rank's slice of the other dims adds up to the whole, a replicated output is the same on every rank (analysis/
module_diff.py). Only these few numbers per sample are kept; no output tensor is held. The rows go to
``autocheck-rank<R>.json`` (``modules``). Outside ``compare`` nothing here runs.

When the summaries name a module, compare runs both world sizes once more with DISTCHECK_CAPTURE_MODULE set: then
that one module's whole local output (or input gradient) is saved to ``module-capture-rank<R>.pt``, for the
element-wise error.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

log = logging.getLogger("distcheck")

MAX_MODULES = 2000  # bound the rows of a huge model: its first modules are what the search needs
# compare's second look (supervise/compare_runs.py): the module, named as in the rows, whose whole local output
# ("forward") or input gradient ("backward") this rank saves to module-capture-rank<R>.pt.
ENV_CAPTURE_MODULE = "DISTCHECK_CAPTURE_MODULE"
ENV_CAPTURE_SIDE = "DISTCHECK_CAPTURE_SIDE"


def _first_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def summarize(t: Any) -> dict[str, Any] | None:
    """Per-sample sums and sums of squares of a (local) tensor, and how a DTensor's shards combine."""
    import torch

    how = None
    placements = getattr(t, "placements", None)
    if placements is not None:
        # A DTensor's own placements say how its local shards make the whole: sharded on dim 0 concatenates,
        # sharded elsewhere or partial adds up, replicated is the same everywhere.
        # (Global forward hooks run before a parallel style's own output hook: a RowwiseParallel output is still
        # Partial here, its pending sum not yet all-reduced.)
        kinds = {("cat" if p.is_shard() and p.dim == 0 else "sum" if p.is_shard() else
                  "partial" if p.is_partial() else "same") for p in placements if hasattr(p, "is_shard")}
        kinds.discard("same")
        how = "same" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
        t = t.to_local()
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    with torch.no_grad():
        x = t.detach().reshape(t.shape[0] if t.dim() else 1, -1).double()
        s1 = x.sum(1)
        s2 = (x * x).sum(1)
        both = torch.stack([s1, s2]).cpu().tolist()
    return {"n": len(both[0]), "k": int(x.shape[1]), "s1": both[0], "s2": both[1], "how": how,
            "shape": list(t.shape)}


class ModuleSummaries:
    def __init__(self, owner: Any, enabled: bool) -> None:
        import os

        self.owner = owner  # the AutoCheck (its active flag gates the hooks)
        self.capture = os.environ.get(ENV_CAPTURE_MODULE)
        self.capture_side = os.environ.get(ENV_CAPTURE_SIDE, "forward")
        self._capture_hooked = False
        self._active: list[Any] = []  # the modules whose forward is running, outermost first
        # id(outermost module) -> id(submodule) -> (its name without wrapper parts, its raw name in that module)
        self._root_names: dict[int, dict[int, tuple[str, str]]] = {}
        self.rows: dict[int, dict[str, Any]] = {}  # id(module) -> row, in completion order
        self._inputs: dict[int, dict[str, Any] | None] = {}  # id(module) -> its input's summary, until it returns
        self._handles: list[Any] = []
        self._grads = 0
        self.done = not enabled
        if enabled:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            owner_ref = weakref.ref(owner)
            self._handles = [register_module_forward_pre_hook(_before_forward_ref(owner_ref)),
                             register_module_forward_hook(_on_forward_ref(owner_ref))]

    def before_forward(self, module: Any, args: Any) -> None:
        """The input as the caller passed it: global pre-hooks run before a parallel style's own input hook."""
        if self.done:
            return
        self._enter(module)
        if id(module) in self.rows or id(module) in self._inputs or len(self.rows) >= MAX_MODULES:
            return
        try:
            self._inputs[id(module)] = summarize(_first_tensor(args))
        except Exception as exc:
            log.debug("module input summary failed: %s", exc)

    def _enter(self, module: Any) -> None:
        from distcheck.rank.records import normalize_key

        if not self._active and id(module) not in self._root_names:
            self._root_names[id(module)] = {id(sub): (normalize_key(n), n) for n, sub in module.named_modules()}
        self._active.append(module)

    def _name_now(self, module: Any) -> tuple[str, str] | tuple[None, None]:
        """(name, raw name) of a module in the outermost module running now: DDP's ``module.`` and other wrapper
        parts left out, so the 1-rank and N-rank runs name it alike."""
        names = self._root_names.get(id(self._active[0])) if self._active else None
        return names.get(id(module), (None, None)) if names else (None, None)

    def _save(self, module_name: str, side: str, t: Any) -> None:
        import torch

        from distcheck.contract import files

        placements = getattr(t, "placements", None)
        local = t.to_local() if placements is not None else t
        data = {"name": module_name, "side": side, "tensor": local.detach().to("cpu", copy=True),
                "placements": [repr(p) for p in placements] if placements is not None else None}
        torch.save(data, files.rank_file(self.owner.out_dir, "module_capture", self.owner.rank))
        self.capture = None  # once

    def on_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.done:
            return
        name, raw = self._name_now(module)
        root = self._active[0] if self._active else None
        if self._active and self._active[-1] is module:
            self._active.pop()
        if self.capture is not None:
            try:
                if name == self.capture:
                    if self.capture_side == "forward":
                        self._save(name, "forward", _first_tensor(output))
                    elif not self._capture_hooked:  # the first call's input, as its summary row
                        inp = _first_tensor(args)
                        if inp is not None and getattr(inp, "requires_grad", False):
                            inp.register_hook(_capture_grad_ref(weakref.ref(self), name))
                            self._capture_hooked = True
            except Exception as exc:
                log.debug("module capture failed: %s", exc)
        if id(module) in self.rows or len(self.rows) >= MAX_MODULES or name is None:
            return
        try:
            out = summarize(_first_tensor(output))
        except Exception as exc:  # a summary must never break the user's forward
            log.debug("module summary failed: %s", exc)
            return
        from distcheck.rank.usersite import forward_site

        site = forward_site(module)
        inp = _first_tensor(args)
        row: dict[str, Any] = {"name": name, "order": len(self.rows), "cls": type(module).__name__,
                               "file": site.file, "line": site.line, "site_kind": "forward", "out": out,
                               "in": self._inputs.pop(id(module), None)}
        if row["file"] is None:  # a torch layer: the user's line that creates it
            self._creation_site(row, root, raw)
        self.rows[id(module)] = row
        if inp is not None and getattr(inp, "requires_grad", False):
            inp.register_hook(_on_grad_ref(weakref.ref(self), id(module)))

    def on_grad(self, key: int, grad: Any) -> None:
        row = self.rows.get(key)
        if row is None or "grad_in" in row or self.done:
            return
        try:
            row["grad_in"] = summarize(grad)
            row["grad_order"] = self._grads
            self._grads += 1
        except Exception as exc:
            log.debug("gradient summary failed: %s", exc)

    def finish_step(self) -> None:
        """The first step is over: stop."""
        if self.done:
            return
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._inputs.clear()
        self._active.clear()
        self._root_names.clear()

    @staticmethod
    def _creation_site(row: dict[str, Any], root: Any, raw: str) -> None:
        from distcheck.rank.usersite import param_site

        try:
            module = root.get_submodule(raw) if raw else root
            pname = next((n for n, _ in module.named_parameters(recurse=False)), None)
            if pname is None:
                return
            site = param_site(root, f"{raw}.{pname}" if raw else pname)
            if site:
                row.update(file=site.file, line=site.line, site_kind="created")
        except Exception as exc:
            log.debug("module site failed: %s", exc)

    def state(self) -> list[dict[str, Any]]:
        if not self.done:
            return []
        return sorted((r for r in self.rows.values() if r.get("name") is not None), key=lambda r: r["order"])


def _before_forward_ref(ref: weakref.ref) -> Any:
    def hook(module: Any, args: Any) -> None:
        check = ref()
        if check is not None and check.active:
            check.module_summaries.before_forward(module, args)
    return hook


def _on_forward_ref(ref: weakref.ref) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        check = ref()
        if check is not None and check.active:
            check.module_summaries.on_forward(module, args, output)
    return hook


def _capture_grad_ref(ref: weakref.ref, name: str) -> Any:
    def hook(grad: Any) -> None:
        summaries = ref()
        if summaries is not None and summaries.capture is not None:
            try:
                summaries._save(name, "backward", grad)
            except Exception as exc:
                log.debug("gradient capture failed: %s", exc)
    return hook


def _on_grad_ref(ref: weakref.ref, key: int) -> Any:
    def hook(grad: Any) -> None:
        summaries = ref()
        if summaries is not None:
            summaries.on_grad(key, grad)
    return hook
