"""FSDP1 (``FullyShardedDataParallel``) seen through its original parameters: full values, names, what ranks hold.

    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    python -m distcheck compare --nproc 2 -- train.py      # records the full parameters, named like Net's own

FSDP1 flattens each unit's parameters into one ``FlatParameter`` and gives every rank of the unit's shard group one
equal, padded chunk of it (torch/distributed/fsdp/_flat_param.py, read in torch 2.13). What a rank holds is never a
parameter: with ``use_orig_params=True`` ``named_parameters()`` yields 1-D views of this rank's chunk (0 elements
where the chunk misses the parameter), with ``False`` it yields the ``FlatParameter`` itself, named
``..._fsdp_wrapped_module._flat_param``. Everything here maps them back through the FlatParameter's own metadata
(``_fqns``, ``_shapes``, ``_numels_with_padding``, ``_shard_param_infos``) and torch's own unflattening
(``FlatParamHandle._get_unflat_views``), and names them with torch's ``clean_tensor_name`` (no
``_fsdp_wrapped_module.``), so they match the 1-rank reference and the unwrapped model:
- :func:`full_tensors`: the full values (or gradients) of FSDP1's tensors, for ``distcheck.record`` and the
  automatic records. Each unit costs one ``all_gather_into_tensor`` of its padded local chunk over its shard group
  (``handle.process_group``: HYBRID_SHARD's replicas hold the same chunk, NO_SHARD's the whole), a collective on the
  user's process group like ``DTensor.full_tensor()``: every rank must ask for the same tensors in the same order;
- :func:`original_params`: every original parameter with its unit, strategy and what each rank of the shard group
  holds of it, for the placement table;
- :func:`shard_key`: which ranks hold identical chunks (HYBRID_SHARD's replicate dim, NO_SHARD), for the replica
  comparisons.

Nothing here imports FSDP: a script that never imported ``torch.distributed.fsdp`` holds no FSDP1 module.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator, NamedTuple

from distcheck.analysis.flat_shards import held_numels

FLAT_PARAM = "_flat_param"  # torch's name for a unit's FlatParameter under its wrapped module
# The attribute the FullyShardedDataParallel hook (rank/autocheck/patches.py) sets on the outermost instance: the
# user's [file, line] that wrapped it, for findings about what that call left out (its ignored_modules).
WRAP_SITE = "_distcheck_fsdp1_site"


def fsdp_class() -> Any:
    """torch's FullyShardedDataParallel class, or None when the script never imported FSDP."""
    module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    return getattr(module, "FullyShardedDataParallel", None)


def is_fsdp1(module: Any) -> bool:
    cls = fsdp_class()
    return cls is not None and isinstance(module, cls)


def clean_name(name: str) -> str:
    """A tensor's name without FSDP1's (and activation checkpointing's) wrapper parts, as torch's state dicts name
    it."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


class Unit(NamedTuple):
    """One FSDP1 instance of a model and the FlatParameter it manages (``handle`` None: it manages nothing)."""

    path: str  # the FSDP module's path in the model, wrappers included ("" for the model itself)
    module: Any
    handle: Any
    prefix: str  # path of the module the FlatParameter's ``_fqns`` are relative to, with its trailing dot

    @property
    def label(self) -> str:
        return clean_name(self.path) or "<root>"

    @property
    def strategy(self) -> str:
        return str(getattr(self.module, "sharding_strategy", "?")).rpartition(".")[2]


def units(root: Any) -> list[Unit]:
    """Every FSDP1 instance in ``root`` (itself included), outermost first."""
    cls = fsdp_class()
    if cls is None:
        return []
    paths = {id(m): n for n, m in root.named_modules()}
    out = []
    for path, module in root.named_modules():
        if not isinstance(module, cls):
            continue
        handle = getattr(module, "_handle", None)
        inner = getattr(handle, "_fully_sharded_module", None) if handle is not None else None
        prefix = paths.get(id(inner), "") if inner is not None else ""
        out.append(Unit(path, module, handle, f"{prefix}." if prefix else ""))
    return out


def ignored_params(root: Any) -> dict[int, str]:
    """id(parameter) -> label of the FSDP1 unit whose ``ignored_modules`` / ``ignored_states`` leave it out."""
    out: dict[int, str] = {}
    for unit in units(root):
        for p in getattr(unit.module, "_ignored_params", ()) or ():
            out.setdefault(id(p), unit.label)
    return out


class FlatIndex:
    """Which FSDP1 unit holds a tensor: a FlatParameter (index None) or one of its original parameters."""

    def __init__(self, roots: Iterable[Any]) -> None:
        self.units: list[Unit] = []
        self._at: dict[int, tuple[Unit, int | None]] = {}
        seen: set[int] = set()
        for root in roots:
            for unit in units(root):
                if unit.handle is None or id(unit.module) in seen:
                    continue
                seen.add(id(unit.module))
                self.units.append(unit)
                flat = unit.handle.flat_param
                self._at[id(flat)] = (unit, None)
                for i, p in enumerate(getattr(flat, "_params", None) or ()):  # use_orig_params=True
                    self._at.setdefault(id(p), (unit, i))

    def __bool__(self) -> bool:
        return bool(self.units)

    def find(self, t: Any) -> tuple[Unit, int | None] | None:
        return self._at.get(id(t))


def local_chunk(unit: Unit, gradients: bool = False) -> Any:
    """This rank's padded chunk of the unit's FlatParameter (NO_SHARD: the whole of it), or of its gradient (None:
    no gradient), as torch keeps it between steps (``_local_shard``; before the first forward, the parameter)."""
    handle = unit.handle
    flat = handle.flat_param
    if gradients:
        return handle.sharded_grad
    local = getattr(flat, "_local_shard", None)
    return local if local is not None else flat.detach()


def _full_views(unit: Unit, gradients: bool) -> list[Any] | None:
    """The unit's original parameters (or their gradients) as full tensors, in ``_fqns`` order; None: no gradient."""
    import torch.distributed as dist

    handle = unit.handle
    flat = handle.flat_param
    local = local_chunk(unit, gradients)
    if local is None:
        return None
    local = local.detach()
    sharded = getattr(flat, "_sharded_size", None)
    # A sharded unit holds its padded chunk between steps; SHARD_GRAD_OP under no_sync() keeps the whole gradient.
    if handle.uses_sharded_strategy and sharded is not None and local.numel() == sharded.numel():
        full = local.new_empty(local.numel() * handle.world_size)
        # FSDP1's own unshard call (all_gather_into_tensor warns that it is deprecated in this torch)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, local.contiguous(), group=handle.process_group)
        local = full
    return list(handle._get_unflat_views(local[:flat._unpadded_unsharded_size.numel()]))


def full_tensors(pairs: Iterable[tuple[str, Any]], roots: Iterable[Any], gradients: bool = False
                 ) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for each (name, parameter), FSDP1's replaced by the full original parameters they hold: a
    FlatParameter by all of its parameters (named from its own name, ``_flat_param`` replaced by each ``_fqns``), a
    view by its parameter. ``gradients``: their gradients instead (left out where there is none). Lazy: one unit's
    full tensors at a time; a collective per unit (see the module's docstring), in the order of ``pairs``."""
    index = FlatIndex(roots) if fsdp_class() is not None else None
    current: tuple[Unit | None, list[Any] | None] = (None, None)
    for name, t in pairs:
        hit = index.find(t) if index else None
        if hit is None:
            value = t.grad if gradients else t
            if value is not None:
                yield name, value
            continue
        unit, i = hit
        if current[0] is not unit:  # pairs list a unit's parameters together: it is gathered once
            current = (unit, _full_views(unit, gradients))
        views = current[1]
        if views is None:
            continue
        if i is not None:
            yield name, views[i]
            continue
        base = name[:-len(FLAT_PARAM)] if name.endswith(FLAT_PARAM) else unit.prefix
        for fqn, view in zip(unit.handle.flat_param._fqns, views):
            yield base + fqn, view


class OrigParam(NamedTuple):
    """One original parameter of an FSDP1 unit, for the placement table."""

    path: str  # in the model, wrappers included (the user's definition line is looked up by it)
    name: str  # clean: as the unwrapped model names it
    unit: Unit
    index: int  # in the FlatParameter's ``_fqns``
    shape: list[int]
    dtype: Any
    requires_grad: bool
    held: list[int]  # elements of it each rank of the shard group holds, by rank in the group
    here: int  # elements of it this rank holds
    shard_ranks: list[int]  # the shard group's global ranks
    replicate_ranks: list[int] | None  # HYBRID_SHARD: the ranks holding the same chunk as this rank


def original_params(unit: Unit) -> list[OrigParam]:
    """The unit's original parameters with what each rank holds (no collective: from the FlatParameter's metadata)."""
    handle = unit.handle
    if handle is None:
        return []
    flat = handle.flat_param
    world = handle.world_size if handle.uses_sharded_strategy else 1
    held = held_numels(list(flat._numels_with_padding), list(flat._is_padding_mask), world)
    shard = _ranks(handle.process_group)
    inter = getattr(unit.module, "_inter_node_pg", None)
    replicate = _ranks(inter) if inter is not None and "HYBRID" in unit.strategy else None
    params = getattr(flat, "_params", None)
    out = []
    for i, (fqn, shape, numel) in enumerate(zip(flat._fqns, flat._shapes, flat._numels)):
        requires_grad = params[i].requires_grad if params else flat.requires_grad
        path = unit.prefix + fqn
        # this rank's own count from torch's shard metadata; the others' by the same chunking (flat_shards.py)
        info = flat._shard_param_infos[i] if handle.uses_sharded_strategy else None
        here = numel if info is None else (info.numel_in_shard if info.in_shard else 0)
        out.append(OrigParam(path, clean_name(path), unit, i, list(shape), flat.dtype, bool(requires_grad), held[i],
                             here, shard, replicate))
    return out


def shard_key(unit: Unit) -> tuple:
    """Ranks with equal keys hold identical chunks of the unit: the same rank in their shard groups (HYBRID_SHARD's
    replicate dim), or every rank under NO_SHARD."""
    handle = unit.handle
    return ("fsdp1", unit.label, handle.rank if handle.uses_sharded_strategy else 0)


def replicated(unit: Unit) -> list[int] | None:
    """The ranks holding the same chunk of the unit as this one (NO_SHARD: its group; HYBRID_SHARD: its replicate
    group), None where no other rank does (FULL_SHARD, SHARD_GRAD_OP)."""
    handle = unit.handle
    if not handle.uses_sharded_strategy:
        ranks = _ranks(handle.process_group)
    else:
        inter = getattr(unit.module, "_inter_node_pg", None)
        ranks = _ranks(inter) if inter is not None and "HYBRID" in unit.strategy else []
    return ranks if len(ranks) > 1 else None


def local_pieces(unit: Unit) -> list[tuple[str, Any]]:
    """(clean name, this rank's piece of it) for every original parameter of the unit: the whole parameter under
    NO_SHARD, else the 1-D slice of it in this rank's chunk (0 elements where the chunk misses it, so that every rank
    names every parameter). No collective."""
    handle = unit.handle
    flat = handle.flat_param
    local = local_chunk(unit).detach()
    names = [clean_name(unit.prefix + fqn) for fqn in flat._fqns]
    if not handle.uses_sharded_strategy:
        return list(zip(names, handle._get_unflat_views(local[:flat._unpadded_unsharded_size.numel()])))
    out = []
    for name, info in zip(names, flat._shard_param_infos):
        start = info.offset_in_shard if info.in_shard else 0
        out.append((name, local[start:start + (info.numel_in_shard if info.in_shard else 0)]))
    return out


def replica_items(model: Any, items: list[tuple[str, str, Any]], fallback: Any
                  ) -> tuple[list[tuple[str, str, Any]], Any]:
    """``items`` (name, role, tensor) of an FSDP1 model made comparable across ranks: each FlatParameter or view
    replaced by its unit's local pieces, names cleaned; and the replica key of every item (``shard_key`` for the
    pieces, ``fallback(tensor)`` for the rest: rank.checks.replicas.replica_key). Returns (items, key function)."""
    index = FlatIndex([model])
    if not index:
        return items, fallback
    keys: dict[int, tuple] = {}
    out: list[tuple[str, str, Any]] = []
    done: set[int] = set()
    for name, role, t in items:
        hit = index.find(t) if role == "parameter" else None
        if hit is None:
            out.append((clean_name(name), role, t))
            continue
        unit = hit[0]
        if id(unit.module) in done:  # the unit's pieces stand for all of its views
            continue
        done.add(id(unit.module))
        for piece_name, piece in local_pieces(unit):
            keys[id(piece)] = shard_key(unit)
            out.append((piece_name, "parameter", piece))

    def key(t: Any) -> Any:
        return keys[id(t)] if id(t) in keys else fallback(t)

    return out, key


def data_parallel_ranks(module: Any) -> list[int] | None:
    """The global ranks that train ``module`` (an FSDP1 instance) data-parallel: its shard group, times the replicate
    group under HYBRID_SHARD (its device mesh, or the whole world when the two groups tile it); None: unknown."""
    import torch.distributed as dist

    group = getattr(module, "process_group", None)
    if group is None:
        return None
    inter = getattr(module, "_inter_node_pg", None)
    if inter is None or "HYBRID" not in str(getattr(module, "sharding_strategy", "")):
        return _ranks(group)
    mesh = getattr(module, "_device_mesh", None)
    if mesh is not None:
        return sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if group.size() * inter.size() == dist.get_world_size():
        return list(range(dist.get_world_size()))
    return None


def data_parallel_index(module: Any) -> tuple[int, int] | None:
    """(index, size) of this rank among ``module``'s data-parallel ranks; ranks with one index see the same samples."""
    group = getattr(module, "process_group", None)
    if group is None:
        return None
    inter = getattr(module, "_inter_node_pg", None)
    if inter is not None and "HYBRID" in str(getattr(module, "sharding_strategy", "")):
        return inter.rank() * group.size() + group.rank(), inter.size() * group.size()
    return group.rank(), group.size()
