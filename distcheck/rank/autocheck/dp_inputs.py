"""Data-parallel ranks that all train on the same batch: a warning naming the DataLoader (or the seed) behind it.

    python -m distcheck run --nproc 2 -- fixtures/dp_same_batches.py

Under DDP each rank must read its own share of the data (a DistributedSampler, or a loader sharded by rank); a
DataLoader without one gives every rank the same batches, so N ranks do the work of one, and nothing fails. At
the first training forward (grad enabled, module in train mode: an evaluation pass may rightly feed every rank the
whole validation set) of a model wrapped in ``DistributedDataParallel`` (patched, rank/autocheck/patches.py) the
ranks of its process group compare fingerprints of its plain-tensor inputs in one side-channel exchange
(checks/replicas.py; never the user's process group). When every rank fed the same values, the first rank of the
group adds a warning (not a finding: replicated data can be intended, a tiny test, a benchmark) naming the line
that called the model and the likely cause: a DataLoader built without a DistributedSampler (its line, noted by
the patched ``DataLoader.__init__``), else the same seed on every rank (the ``torch.manual_seed`` line).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from distcheck.contract.findings import Note, format_ranks
from distcheck.rank.autocheck.tp_inputs import once_at_forward
from distcheck.rank.usersite import Site, caller_site

log = logging.getLogger("distcheck")


def _is_distributed(sampler: Any) -> bool:
    """Whether a DataLoader's sampler (or its batch sampler's) splits the data by rank."""
    from torch.utils.data.distributed import DistributedSampler

    for s in (sampler, getattr(sampler, "sampler", None)):
        if isinstance(s, DistributedSampler) or hasattr(s, "num_replicas") or hasattr(s, "rank"):
            return True
    return False


class DPInputs:
    def __init__(self, owner: Any) -> None:
        self.owner = owner  # the AutoCheck: its rank, the prewrap's seed, the model watch's warnings
        self.loaders: list[tuple[weakref.ref, Site, bool]] = []  # (loader, where built, split by rank)
        self.seconds = 0.0

    def note_loader(self, loader: Any) -> None:
        try:
            split = _is_distributed(getattr(loader, "sampler", None)) or \
                _is_distributed(getattr(loader, "batch_sampler", None))
            self.loaders.append((weakref.ref(loader), caller_site(), split))
        except Exception as exc:  # an odd loader subclass: nothing to note
            log.debug("distcheck: could not note a DataLoader: %s", exc)

    def watch(self, module: Any, ranks: list[int]) -> None:
        if len(ranks) < 2 or self.owner.rank not in ranks:
            return
        # Evaluation passes are skipped: every rank may rightly see the whole validation set.
        once_at_forward(self, module, "comparing the data-parallel ranks' first batches",
                        lambda args, kwargs: self._compare(ranks, args, kwargs), training_only=True)

    def _compare(self, ranks: list[int], args: tuple, kwargs: dict) -> None:
        import torch

        from distcheck.checks.replicas import compare_entries
        from distcheck.rank.autocheck.tp_inputs import batch_site, plain_inputs
        from distcheck.rank.runtime import current_channel

        channel = current_channel()
        if channel is None:
            return
        from torch.distributed.tensor import DTensor

        items = [it for it in plain_inputs(args, kwargs, torch.Tensor, DTensor) if it[2].numel() > 0]
        site = batch_site()
        with torch.no_grad():
            compared = compare_entries("dp_input", items, channel, ranks)
        if not items or compared.divergences or any(len(e) != len(items) for e in compared.entries):
            return
        if self.owner.rank == ranks[0]:
            self.owner.models.warnings.append(same_batch_note(ranks, site, self._loader(), self._seed()).to_json())

    def _loader(self) -> Site | None:
        """Where the last DataLoader that does not split by rank was built."""
        for ref, site, split in reversed(self.loaders):
            if ref() is not None and not split:
                return site
        return None

    def _seed(self) -> tuple[Any, Site] | None:
        seed = getattr(self.owner.prewrap, "seed", None)
        return seed if seed else None


def same_batch_note(ranks: list[int], site: Site, loader: Site | None, seed: tuple[Any, Site] | None) -> Note:
    at = f" at {site.site}" if site.file else ""
    if loader is not None:
        cause = (f"the DataLoader built at {loader.site} has no DistributedSampler: give it "
                 f"DistributedSampler(dataset) (and call sampler.set_epoch(epoch) each epoch)")
    elif seed is not None:
        where = f" at {seed[1].site}" if seed[1] is not None and seed[1].file else ""
        cause = (f"every rank draws its data from the same seed (torch.manual_seed({seed[0]}){where}): shard the "
                 f"data by rank, or seed the data generator with the rank")
    else:
        cause = "shard the data by rank (a DistributedSampler, or each rank's slice of the global batch)"
    message = (f"{format_ranks(ranks)} (data parallel) fed the same batch at their first forward{at}: every rank "
               f"trains on the same data, so {len(ranks)} ranks do the work of one. Likely cause: {cause}")
    return Note("same_batches", list(ranks), message,
                {"file": site.file, "line": site.line, "loader": [loader.file, loader.line] if loader else None})
