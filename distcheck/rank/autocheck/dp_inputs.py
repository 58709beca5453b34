"""Data-parallel ranks that all train on the same batch: a warning naming the DataLoader (or the seed) behind it.

    python -m distcheck run --nproc 2 -- fixtures/dp_same_batches.py
    python -m distcheck run --nproc 2 -- fixtures/fsdp2_same_batches.py
    python -m distcheck run --nproc 4 -- fixtures/fsdp_tp_same_batches.py

Under data parallelism each rank must read its own share of the data (a DistributedSampler, or a loader sharded by
rank); a DataLoader without one gives every rank the same batches, so N ranks do the work of one, and nothing
fails. At the first training forward (grad enabled, module in train mode: an evaluation pass may rightly feed every
rank the whole validation set) of a model wrapped in ``DistributedDataParallel`` or of the outermost FSDP2
``fully_shard`` module (both patched, rank/autocheck/patches.py) the ranks compare fingerprints of its
plain-tensor inputs in one side-channel exchange (never the user's process group).

Which ranks must differ: DDP's process group; for FSDP2 the ranks of its mesh's data-parallel dims only, within
each position of the other dims. On a 2-D (dp, tp) mesh the TP peers rightly share a batch, so ranks 0,2 and 1,3 of
a 2x2 mesh are two groups; on HSDP's (replicate, shard) mesh both dims are data-parallel, one group. The dims come
from FSDP2's own record: the mesh of its parameter groups (``mesh_info``) and the full SPMD mesh its DTensor
parameters live on (the dp mesh concatenated with TP's), so the exchange spans only ranks that run this forward
(never a pipeline's other stages).

When every rank of a group fed the same values, the first rank adds a warning (not a finding: replicated data can
be intended, a tiny test, a benchmark) naming the line that called the model and the likely cause: a DataLoader
built without a DistributedSampler (its line, noted by the patched ``DataLoader.__init__``), else the same seed on
every rank (the ``torch.manual_seed`` line).
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from distcheck.contract.findings import Note, format_ranks
from distcheck.rank.autocheck.prewrap import seed_note
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.autocheck.tp_inputs import once_at_forward
from distcheck.rank.usersite import Site, caller_site

if TYPE_CHECKING:
    from distcheck.analysis.replicas import Entry

log = logging.getLogger("distcheck")

Groups = list[list[int]]
# DDP knows its group at construction; FSDP2's are found at the one forward that compares (GroupsOf), not at each
# of a model's many fully_shard calls.
GroupsOf = Union[Groups, Callable[[], Union[Groups, None]]]


def _is_distributed(sampler: Any) -> bool:
    """Whether a DataLoader's sampler (or its batch sampler's) splits the data by rank."""
    from torch.utils.data.distributed import DistributedSampler

    for s in (sampler, getattr(sampler, "sampler", None)):
        if isinstance(s, DistributedSampler) or hasattr(s, "num_replicas") or hasattr(s, "rank"):
            return True
    return False


def dp_groups(shape: Sequence[int], ranks: Sequence[int], dp: Sequence[int]) -> Groups | None:
    """The data-parallel groups of a mesh: ``shape`` and its ``ranks`` in row-major order, ``dp`` this rank's
    data-parallel ranks (a sub-grid of it: the mesh dims along which ``dp`` varies are the data-parallel ones).
    Ranks that share their coordinates on every other dim form one group, sorted by first rank. None when ``dp``
    is not such a sub-grid of the mesh (then only ``dp`` itself is known)."""
    coords: dict[int, tuple[int, ...]] = {}
    for flat, rank in enumerate(ranks):
        coord = []
        for size in reversed(shape):
            coord.append(flat % size)
            flat //= size
        coords[int(rank)] = tuple(reversed(coord))
    if not dp or any(r not in coords for r in dp):
        return None
    varying = {d for d in range(len(shape)) if len({coords[r][d] for r in dp}) > 1}
    groups: dict[tuple, list[int]] = {}
    for rank, coord in coords.items():
        groups.setdefault(tuple(c for d, c in enumerate(coord) if d not in varying), []).append(rank)
    out = sorted(sorted(g) for g in groups.values())
    return out if sorted(dp) in out else None


def same_batch_groups(groups: Groups, per_rank: dict[int, list[Entry]]) -> Groups:
    """The groups (of at least 2 ranks) whose every rank fed the same non-empty inputs: same names, dtypes, shapes
    and fingerprints."""
    out = []
    for group in groups:
        seen = {tuple((e.name, e.fp.dtype, tuple(e.fp.shape), tuple(e.fp.sums)) for e in per_rank.get(r, ()))
                for r in group}
        if len(group) > 1 and len(seen) == 1 and next(iter(seen)):
            out.append(sorted(group))
    return out


def fsdp_groups(module: Any) -> Groups | None:
    """The data-parallel groups of a ``fully_shard`` module: its mesh's data-parallel ranks (FSDP2's ``mesh_info``:
    the 1-D mesh, HSDP's 2-D one, ``dp_mesh_dims``' flattened dims), laid out on the largest mesh its parameters
    live on (the dp mesh concatenated with TP's, for a TP model). The module's own parameter groups first; a root
    that holds none of its own takes those of the FSDP modules inside it."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in m._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            dp = [int(r) for r in info.mesh.mesh.flatten().tolist()]
            meshes = {id(x): x for x in [info.spmd_mesh] + [getattr(p, "_spmd_mesh", None) for p in group.fsdp_params]
                      if x is not None}
            best = [dp]
            for mesh in meshes.values():
                found = dp_groups(tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist(), dp)
                if found and sum(map(len, found)) > sum(map(len, best)):
                    best = found
            return best
    return None


class DPInputs(Check):
    name = "dp_inputs"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the rank
        self.loaders: list[tuple[weakref.ref, Site, bool]] = []  # (loader, where built, split by rank)
        self.seconds = 0.0
        self.seed: tuple[int, Site] | None = None  # the last torch.manual_seed(n) and its line
        self.warnings: list[dict[str, Any]] = []  # report.json "warnings" entries (Notes)
        self._first_of: set[str] = set()

    def state(self) -> list[dict[str, Any]]:
        return self.warnings

    def on_seed_set(self, seed: Any) -> None:
        self.seed = seed_note(seed) or self.seed

    def on_model_wrapped(self, module: Any, how: str) -> None:
        """The data-parallel ranks that train ``module``: DDP's process group, FSDP1's ranks, FSDP2's mesh."""
        if how == "fully_shard":
            self.watch(module, lambda: fsdp_groups(module), first_of="fully_shard")
        elif how == "ddp":
            import torch.distributed as dist

            group = getattr(module, "process_group", None)
            self.watch(module, [sorted(dist.get_process_group_ranks(group)) if group is not None
                                else list(range(dist.get_world_size()))])
        elif how == "fsdp1":
            from distcheck.rank.checks.fsdp1 import data_parallel_ranks

            ranks = data_parallel_ranks(module)
            if ranks is not None:
                self.watch(module, [ranks])

    def on_loader_built(self, loader: Any) -> None:
        try:
            split = _is_distributed(getattr(loader, "sampler", None)) or \
                _is_distributed(getattr(loader, "batch_sampler", None))
            self.loaders.append((weakref.ref(loader), caller_site(), split))
        except Exception as exc:  # an odd loader subclass: nothing to note
            log.debug("distcheck: could not note a DataLoader: %s", exc)

    def watch(self, module: Any, groups: GroupsOf, first_of: str | None = None) -> None:
        """Compare ``module``'s first training batch within each data-parallel group. ``first_of``: a name shared by
        nested modules watched one by one (FSDP2 wraps the innermost first): only the first of them to run a
        training forward compares, the outermost, whose inputs are the batch."""
        if isinstance(groups, list) and (self.core.rank not in {r for g in groups for r in g}
                                         or not any(len(g) > 1 for g in groups)):
            return

        def run(args: tuple, kwargs: dict) -> None:
            if first_of is not None:
                if first_of in self._first_of:
                    return
                self._first_of.add(first_of)
            found = groups() if callable(groups) else groups
            if found:
                self._compare(found, args, kwargs)

        # Evaluation passes are skipped: every rank may rightly see the whole validation set.
        once_at_forward(self, module, "comparing the data-parallel ranks' first batches", run, training_only=True)

    def _compare(self, groups: Groups, args: tuple, kwargs: dict) -> None:
        import torch

        from distcheck.rank.checks.replicas import local_entries
        from distcheck.rank.autocheck.tp_inputs import batch_site, plain_inputs
        from distcheck.rank.runtime import current_channel

        ranks = sorted({r for g in groups for r in g})
        channel = current_channel()
        if channel is None or self.core.rank not in ranks or not any(len(g) > 1 for g in groups):
            return
        from torch.distributed.tensor import DTensor

        items = [it for it in plain_inputs(args, kwargs, torch.Tensor, DTensor) if it[2].numel() > 0]
        site = batch_site()
        with torch.no_grad():
            entries = local_entries(items)
        # One exchange of fingerprints among the ranks that run this forward, all groups at once: one warning for
        # the whole mesh, from its first rank. Whether they differ is all this needs, so no chunks follow.
        gathered = channel.exchange("dp_input", entries, ranks)
        same = same_batch_groups(groups, dict(zip(ranks, gathered)))
        if same and self.core.rank == ranks[0]:
            note = same_batch_note(same, site, self._loader(), self.seed, several=len(groups) > 1)
            self.warnings.append(note.to_json())

    def _loader(self) -> Site | None:
        """Where the last DataLoader that does not split by rank was built."""
        for ref, site, split in reversed(self.loaders):
            if ref() is not None and not split:
                return site
        return None


def same_batch_note(groups: Groups, site: Site, loader: Site | None, seed: tuple[Any, Site] | None,
                    several: bool = False) -> Note:
    """The warning for the data-parallel ``groups`` that fed the same batch; ``several``: the mesh has other dims
    (TP, ...) whose ranks rightly share a batch, so a sampler must split by the data-parallel rank alone."""
    at = f" at {site.site}" if site.file else ""
    sampler = ("DistributedSampler(dataset, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank()), from "
               "the data-parallel mesh dim rather than the global rank, so that TP peers keep sharing a batch"
               if several else "DistributedSampler(dataset)")
    if loader is not None:
        cause = (f"the DataLoader built at {loader.site} has no DistributedSampler: give it {sampler} (and call "
                 f"sampler.set_epoch(epoch) each epoch)")
    elif seed is not None:
        where = f" at {seed[1].site}" if seed[1] is not None and seed[1].file else ""
        cause = (f"every rank draws its data from the same seed (torch.manual_seed({seed[0]}){where}): shard the "
                 f"data by {'data-parallel ' if several else ''}rank, or seed the data generator with the "
                 f"{'data-parallel ' if several else ''}rank")
    else:
        by = "data-parallel rank (a DistributedSampler over the data-parallel mesh dim" if several else \
            "rank (a DistributedSampler"
        cause = f"shard the data by {by}, or each rank's slice of the global batch)"
    ranks = sorted(r for g in groups for r in g)
    if several:
        who = (f"{' and '.join(format_ranks(g) for g in groups)} (data parallel: one group per position on the "
               f"mesh's other dims, whose ranks rightly share a batch)")
        work = f"the ranks of each group train on the same data, so {len(groups[0])} ranks do the work of one"
    else:
        who, work = (f"{format_ranks(ranks)} (data parallel)",
                     f"every rank trains on the same data, so {len(ranks)} ranks do the work of one")
    message = f"{who} fed the same batch at their first forward{at}: {work}. Likely cause: {cause}"
    return Note("same_batches", ranks, message,
                {"file": site.file, "line": site.line, "groups": [list(g) for g in groups],
                 "loader": [loader.file, loader.line] if loader else None})
