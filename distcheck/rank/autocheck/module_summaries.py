"""Per-module summaries of the first training step, for ``compare`` to name the first module that diverges.

    python -m distcheck compare --nproc 2 -- train.py      # DISTCHECK_AUTO_RECORD_STEPS=K in the ranks: on

Until the first ``optimizer.step()`` (or the end of the first ``backward()`` without an optimizer), global forward
hooks summarize the input (as the caller passed it, before a parallel style's own input hook) and the output of
every module on its first call, in the order modules finish, and a tensor hook on its input summarizes the
gradient that flows back to that input. A summary is per sample (the output's
dim 0): the sum and the sum of squares of each sample's values, in float64. So the 1-rank reference and the N-rank
run line up without gathering a tensor: data-parallel ranks' samples concatenate in their data-parallel order, a
tensor-parallel rank's slice of the other dims adds up to the whole, a replicated output is the same on every rank
(analysis/module_diff.py). Each row carries the rank's data-parallel coordinate (``dp``: index and size, from the
process groups of the model's fully_shard or DDP wrapper): on a mesh of several dims the ranks with one index are
tensor-parallel peers holding one batch slice between them. A DTensor output's placements on data-parallel mesh
dims are the batch slicing itself; those on the other dims say how its shards combine. Only these few numbers per
sample are kept; no output tensor is held. The rows go to ``autocheck-rank<R>.json`` (``modules``). Outside
``compare`` nothing here runs.

When the summaries name a module, compare runs both world sizes once more with DISTCHECK_CAPTURE_MODULE set: then
that one module's whole local output (or input gradient) is saved to ``module-capture-rank<R>.pt``, for the
element-wise error.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, NamedTuple

from distcheck.contract import env
from distcheck.rank.autocheck.protocol import Check

log = logging.getLogger("distcheck")

MAX_MODULES = 2000  # bound the rows of a huge model: its first modules are what the search needs
# compare's second look (supervise/compare_runs.py): the module, named as in the rows, whose whole local output
# ("forward") or input gradient ("backward") this rank saves to module-capture-rank<R>.pt.
ENV_CAPTURE_MODULE = env.CAPTURE_MODULE
ENV_CAPTURE_SIDE = env.CAPTURE_SIDE


def record_steps_from_env() -> int:
    """The steps zero-code ``compare`` records by itself (auto_records.py), 0 outside compare: these summaries run
    then too."""
    from distcheck.rank import records

    steps = records.auto_steps()
    # active() caches whether records are written: only ask once compare has asked for automatic records.
    return steps if steps and records.active() else 0


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


class DataParallel(NamedTuple):
    """This rank's place among the data-parallel ranks: ranks with one index saw the same samples."""

    index: int
    size: int
    ranks: frozenset[int]  # the global ranks of this rank's data-parallel group (itself included)


def _fsdp_coordinate(module: Any) -> DataParallel | None:
    import torch.distributed as dist

    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    state = get_state()
    groups = list(getattr(state, "_fsdp_param_groups", None) or [])
    single = getattr(state, "_fsdp_param_group", None)
    if single is not None and not groups:
        groups = [single]
    for group in groups:
        info = getattr(group, "mesh_info", None)
        if info is None:
            continue
        index, size, ranks = 0, 1, set()
        # HSDP: replicate (outer) x shard (inner); FSDP: shard only; replicate(): replicate only.
        for rank_attr, size_attr, pg_attr in (("replicate_mesh_rank", "replicate_mesh_size", "replicate_process_group"),
                                              ("shard_mesh_rank", "shard_mesh_size", "shard_process_group")):
            if hasattr(info, size_attr):
                n = int(getattr(info, size_attr))
                index, size = index * n + int(getattr(info, rank_attr)), size * n
                ranks.update(dist.get_process_group_ranks(getattr(info, pg_attr)))
        if ranks:
            return DataParallel(index, size, frozenset(ranks))
    return None


def data_parallel(roots: list[Any]) -> DataParallel | None:
    """This rank's data-parallel coordinate, from the process groups of the first fully_shard (FSDP2, HSDP,
    replicate), FSDP1 or DDP wrapper in ``roots``; (0, 1) for a model only tensor-parallel over the whole world
    (every rank sees the whole batch); None where nothing says (a script that splits its data and reduces its
    gradients by hand): the analysis then infers the mapping from the shapes alone."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return None
    meshes = []
    for root in roots:
        for module in root.modules():
            if isinstance(module, DistributedDataParallel):
                pg = module.process_group
                return DataParallel(dist.get_rank(pg), dist.get_world_size(pg),
                                    frozenset(dist.get_process_group_ranks(pg)))
            found = _fsdp_coordinate(module) or _fsdp1_coordinate(module)
            if found is not None:
                return found
        meshes += [p.device_mesh for p in root.parameters() if getattr(p, "device_mesh", None) is not None]
    world = dist.get_world_size()
    if meshes and all(m.size() == world for m in meshes):
        return DataParallel(0, 1, frozenset([dist.get_rank()]))
    return None


def _fsdp1_coordinate(module: Any) -> DataParallel | None:
    """An FSDP1 unit's: its shard group, times its replicate group under HYBRID_SHARD (rank/checks/fsdp1.py)."""
    from distcheck.rank.checks import fsdp1

    if not fsdp1.is_fsdp1(module):
        return None
    at, ranks = fsdp1.data_parallel_index(module), fsdp1.data_parallel_ranks(module)
    return DataParallel(at[0], at[1], frozenset(ranks)) if at is not None and ranks is not None else None


def _mesh_dim_ranks(mesh: Any, dim: int) -> set[int]:
    """The global ranks along mesh dim ``dim`` through this rank's coordinate (no process group call)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return set()
    index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
    return set(mesh.mesh[index].reshape(-1).tolist())


def _pending_share(t: Any, placements: Any) -> Any:
    """A DTensor's local tensor; for a vocabulary-parallel embedding's masked Partial, its share of the pending sum:
    the rows of ids outside this rank's shard hold a lookup of id 0 until the reduction zeroes them (the mask is
    applied only then), so they are zeroed here, on a copy. None when the mask is gone."""
    local = t.to_local()
    masks = [p.mask_buffer for p in placements if type(p).__name__ == "_MaskPartial" and hasattr(p, "mask_buffer")]
    if not masks:
        return local
    if len(masks) > 1 or masks[0].data is None:
        return None
    mask = masks[0].data
    local = local.detach().clone()
    if local.dim() == mask.dim():
        local[mask] = 0.0
    else:
        local[mask, :] = 0.0
    return local


def summarize(t: Any, dp: DataParallel | None = None) -> dict[str, Any] | None:
    """Per-sample sums and sums of squares of a (local) tensor, and how a DTensor's shards combine."""
    import torch

    how = None
    placements = getattr(t, "placements", None)
    if placements is not None:
        # A DTensor's own placements say how its local shards make the whole: sharded on dim 0 concatenates,
        # sharded elsewhere or partial adds up, replicated is the same everywhere.
        # (Global forward hooks run before a parallel style's own output hook: a RowwiseParallel output is still
        # Partial here, its pending sum not yet all-reduced.)
        kinds = set()
        for d, p in enumerate(placements):
            if not hasattr(p, "is_shard"):
                continue
            if dp is not None and dp.size > 1 and t.device_mesh.size(d) > 1 \
                    and _mesh_dim_ranks(t.device_mesh, d) <= dp.ranks:
                # A data-parallel mesh dim: its Shard(0) is the batch slicing the data-parallel index already
                # gives; anything else there is not a batch slice.
                if not (p.is_shard() and p.dim == 0):
                    kinds.add("mixed")
                continue
            kinds.add("cat" if p.is_shard() and p.dim == 0 else "sum" if p.is_shard() else
                      "partial" if p.is_partial() else "same")
        kinds.discard("same")
        how = "same" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
        t = _pending_share(t, placements)
        if t is None:
            how, t = "mixed", None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return None
    with torch.no_grad():
        x = t.detach().reshape(t.shape[0] if t.dim() else 1, -1).double()
        s1 = x.sum(1)
        s2 = (x * x).sum(1)
        both = torch.stack([s1, s2]).cpu().tolist()
    return {"n": len(both[0]), "k": int(x.shape[1]), "s1": both[0], "s2": both[1], "how": how,
            "shape": list(t.shape)}


class ModuleSummaries(Check):
    name = "modules"

    def __init__(self, core: Any) -> None:
        import os

        super().__init__(core)  # its active flag gates the hooks
        enabled = bool(record_steps_from_env())  # under compare only
        self.capture = os.environ.get(ENV_CAPTURE_MODULE)
        self.capture_side = os.environ.get(ENV_CAPTURE_SIDE, "forward")
        self._capture_hooked = False
        self._active: list[Any] = []  # the modules whose forward is running, outermost first
        # id(outermost module) -> id(submodule) -> (its name without wrapper parts, its raw name in that module)
        self._root_names: dict[int, dict[int, tuple[str, str]]] = {}
        self.rows: dict[int, dict[str, Any]] = {}  # id(module) -> row, in completion order
        self._inputs: dict[int, dict[str, Any] | None] = {}  # id(module) -> its input's summary, until it returns
        # id(module) -> its input as the caller passed it, until it returns: the input gradient is taken there, where
        # the 1-rank and N-rank runs hold the same tensor (a parallel style's input hook hands the module a DTensor
        # view whose gradient is one branch's, pending its reduction).
        self._input_tensors: dict[int, Any] = {}
        self._handles: list[Any] = []
        self._grads = 0
        self.dp: DataParallel | None = None  # found at a root-level forward, once a wrapper says
        self.done = not enabled
        if enabled:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            me = weakref.ref(self)
            self._handles = [register_module_forward_pre_hook(_before_forward_ref(me)),
                             register_module_forward_hook(_on_forward_ref(me))]

    def before_forward(self, module: Any, args: Any) -> None:
        """The input as the caller passed it: global pre-hooks run before a parallel style's own input hook."""
        if self.done:
            return
        self._enter(module)
        if id(module) in self.rows or id(module) in self._inputs or len(self.rows) >= MAX_MODULES:
            return
        try:
            first = _first_tensor(args)
            self._input_tensors[id(module)] = first
            self._inputs[id(module)] = summarize(first, self.dp)
        except Exception as exc:
            log.debug("module input summary failed: %s", exc)

    def _enter(self, module: Any) -> None:
        from distcheck.rank.records import normalize_key

        if not self._active and id(module) not in self._root_names:
            self._root_names[id(module)] = {id(sub): (normalize_key(n), n) for n, sub in module.named_modules()}
        if not self._active and self.dp is None:
            try:
                self.dp = data_parallel([module, *self.core.models.alive()])
            except Exception as exc:
                log.debug("data-parallel coordinate failed: %s", exc)
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
        local = _pending_share(t, placements) if placements is not None else t
        if local is None:  # a masked Partial whose mask is gone: no share to save
            return
        data = {"name": module_name, "side": side, "tensor": local.detach().to("cpu", copy=True),
                "placements": [repr(p) for p in placements] if placements is not None else None,
                "dp": [self.dp.index, self.dp.size] if self.dp is not None else None}
        torch.save(data, files.rank_file(self.core.out_dir, "module_capture", self.core.rank))
        self.capture = None  # once

    def after_forward(self, module: Any, args: Any, output: Any) -> None:
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
                    elif not self._capture_hooked:  # the first call's input, as its summary row takes it
                        inp = self._input_tensors.get(id(module))
                        inp = _first_tensor(args) if inp is None else inp
                        if inp is not None and getattr(inp, "requires_grad", False):
                            inp.register_hook(_capture_grad_ref(weakref.ref(self), name))
                            self._capture_hooked = True
            except Exception as exc:
                log.debug("module capture failed: %s", exc)
        if id(module) in self.rows or len(self.rows) >= MAX_MODULES or name is None:
            return
        try:
            out = summarize(_first_tensor(output), self.dp)
        except Exception as exc:  # a summary must never break the user's forward
            log.debug("module summary failed: %s", exc)
            return
        from distcheck.rank.usersite import forward_site

        site = forward_site(module)
        inp = _first_tensor(args)
        row: dict[str, Any] = {"name": name, "order": len(self.rows), "cls": type(module).__name__,
                               "file": site.file, "line": site.line, "site_kind": "forward", "out": out,
                               "in": self._inputs.pop(id(module), None)}
        caller_input = self._input_tensors.pop(id(module), None)
        if caller_input is not None:
            inp = caller_input
        if self.dp is not None:
            row["dp"] = [self.dp.index, self.dp.size]
        if row["file"] is None:  # a torch layer: the user's line that creates it
            self._creation_site(row, root, raw)
        self.rows[id(module)] = row
        if inp is not None and getattr(inp, "requires_grad", False):
            inp.register_hook(_on_grad_ref(weakref.ref(self), id(module)))

    def note_grad(self, key: int, grad: Any) -> None:
        row = self.rows.get(key)
        if row is None or "grad_in" in row or self.done:
            return
        try:
            row["grad_in"] = summarize(grad, self.dp)
            row["grad_order"] = self._grads
            self._grads += 1
        except Exception as exc:
            log.debug("gradient summary failed: %s", exc)

    def on_after_backward(self) -> None:
        if not self.core.optimizers:  # without an optimizer the first step ends with the first backward()
            self.finish_step()

    def on_optimizer_step_done(self, optimizer: Any, step: int) -> None:
        self.finish_step()

    def on_uninstalled(self) -> None:
        self.finish_step()

    def finish_step(self) -> None:
        """The first step is over: stop."""
        if self.done:
            return
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._inputs.clear()
        self._input_tensors.clear()
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
        summaries = ref()
        if summaries is not None and summaries.core.active:
            summaries.before_forward(module, args)
    return hook


def _on_forward_ref(ref: weakref.ref) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        summaries = ref()
        if summaries is not None and summaries.core.active:
            summaries.after_forward(module, args, output)
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
            summaries.note_grad(key, grad)
    return hook
