"""torch.distributed.checkpoint (DCP) in a rank: a partial load that loaded nothing, and the resume round trip.

    python -m distcheck run --nproc 2 -- fixtures/dcp_partial_load_prefix.py
    python -m distcheck run --nproc 2 -- fixtures/dcp_resume_mismatch.py

DCP's planners see what torch itself sees: ``DefaultSavePlanner.set_up_planner`` the flattened state dict a save
writes (after ``Stateful`` objects gave theirs) and the checkpoint's id, ``DefaultLoadPlanner.create_local_plan``
the flattened state dict a load fills and the checkpoint's metadata. Their hooks and ``dcp.load``'s (which says
when a load is over) are installed by patches.py when the script imports torch.distributed.checkpoint, so a script
without DCP pays nothing. Three findings, all ``bad_values`` with checkpoint_load.py's cause
``state_dict_not_loaded`` (the model resumes from values that are not the checkpoint's; ``why`` tells them apart):

- ``dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))`` skips every key of the state dict that
  the checkpoint lacks, silently. When the skipped keys are in the checkpoint under a wrapper's prefix
  (``module.``, ``_orig_mod.``, ...) or nothing was loaded at all, it is checkpoint_load.py's
  finding (``why``: ``prefix`` or ``nothing_loaded``), at the user's ``dcp.load`` line.
- The resume round trip, for a checkpoint this run saved: a save notes a fingerprint (a few integers,
  rank/checks/fingerprint.py) of each tensor it writes, keyed by checkpoint and key; when the load of that checkpoint
  returns, the tensors it filled are fingerprinted again, and values that differ from the saved ones (a model
  rebuilt in bf16 rounds the checkpoint's fp32 weights) are a finding naming the keys, the save's line and the
  load's (``why``: ``roundtrip_cast`` or ``roundtrip_values``).
- The same round trip when the load holds other parts of the tensors than the save did (resharded: saved from
  FSDP2 shards and loaded into a replicated copy, or saved whole and loaded into shards): the fingerprints above
  do not compose across regions, so a save also notes, per tensor, the box of the global tensor this rank held
  (offsets and sizes, as DCP's own chunks) and one additive word sum of its values (each element's bits as an
  integer of its width, summed with wrap-around: the sum of a box is the sum of the sums of any boxes that tile
  it). When a load's layout differs from the save's, each rank sums its loaded values over each saved chunk of the
  checkpoint's metadata it overlaps, and the ranks exchange those sums and their saved ones through the side
  channel (one exchange per such load, among the load's ranks): a saved chunk whose loaded pieces tile it must sum
  to what was saved, and a rank whose pieces make it differ gets the finding above. Chunks the load does not
  cover whole (a column split loaded from a row split) are left out, never guessed.
- The state dict DCP filled is not always the model's: one built before the model was re-created (or sharded, or
  moved) holds tensors nobody trains any more, and the load lands there. The keys a save took from parameters an
  optimizer steps are remembered; at the first ``step()`` of each optimizer after the load, when its parameters
  have the shapes of those keys but hold none of their saved values, the load did not reach the model
  (``why``: ``not_in_model``).

Loads of checkpoints this run did not save (a pretrained model) are checked for partial loads only. Bounded: at
most MAX_CHECKPOINTS checkpoints of at most MAX_KEYS tensors are remembered, as fingerprints, never copies.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

from distcheck.analysis.replicas import Fingerprint
from distcheck.contract.findings import Finding
from distcheck.rank.autocheck.checkpoint_load import load_finding
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site

log = logging.getLogger("distcheck")

MAX_CHECKPOINTS = 8
MAX_KEYS = 1 << 15
SHOWN = 3
# The cause of checkpoint_load.py's finding: the model does not hold the checkpoint's values. It is one finding per
# rank, merged over the ranks that report the same line (supervise/run_report.py's PER_RANK_CAUSES).
CAUSE = "state_dict_not_loaded"


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor, as DCP's chunks
# The additive sums are kept modulo 2**32: a 4-byte word's sum wraps there (and 2- and 1-byte words are summed as
# 32-bit ones), an 8-byte word's wraps at 2**64, which 2**32 divides; every rank's pieces then add up alike.
MASK = (1 << 32) - 1
# How long the ranks of a resharded load wait for each other's sums: they are all inside the same dcp.load.
EXCHANGE_TIMEOUT = 60.0


@dataclass(frozen=True)
class SavedTensor:
    fp: Fingerprint  # of this rank's local values (a DTensor's shard)
    region: Hashable  # which part of the global tensor those are: equal regions hold comparable values
    trained: bool  # the save took it from a parameter an optimizer steps
    layout: Hashable = None  # the global layout (no rank's coordinate): a load with another one is resharded
    box: Box | None = None  # the part of the global tensor this rank held
    total: int | None = None  # additive_sum of those values


@dataclass
class Saved:
    site: Site
    tensors: dict[str, SavedTensor]


@dataclass
class Resumed:
    """A load of a checkpoint this run saved, whose trained parameters the next optimizer steps must hold."""

    load_site: Site
    save_site: Site
    keys: list[str]  # the checkpoint's trained parameters, named alike on every rank
    trained: set[Fingerprint]  # this rank's non-empty shards of them, as saved
    checked: set[int] = field(default_factory=set)  # id() of the optimizers already checked


def checkpoint_key(checkpoint_id: Any) -> str | None:
    """One spelling per checkpoint directory (DCP keeps the id as given: a str or a Path, relative or not)."""
    if isinstance(checkpoint_id, (str, os.PathLike)) and os.fspath(checkpoint_id):
        path = os.fspath(checkpoint_id)
        return path if "://" in path else os.path.abspath(path)
    return None


def region(t: Any) -> Hashable:
    """Which part of the global tensor this rank holds: a DTensor's placements and mesh coordinate."""
    mesh = getattr(t, "device_mesh", None)
    placements = getattr(t, "placements", None)
    if mesh is not None and placements is not None:
        coordinate = mesh.get_coordinate()
        return ("dtensor", tuple(t.shape), tuple(str(p) for p in placements), tuple(mesh.shape),
                tuple(coordinate) if coordinate is not None else None)
    return ("tensor", tuple(t.shape))


def layout(t: Any) -> Hashable:
    """The same on every rank of a DTensor's mesh: its global shape, placements and mesh shape."""
    r = region(t)
    return r[:4] if r[0] == "dtensor" else r


def box_of(t: Any) -> Box | None:
    """The box of the global tensor this rank's values are: a DTensor's one chunk (DCP's
    ``__create_chunk_list__``), a plain tensor's whole; None for a shard that is not one box (_StridedShard)."""
    chunks = getattr(t, "__create_chunk_list__", None)
    if chunks is None or not callable(chunks) or getattr(t, "device_mesh", None) is None:
        return tuple(0 for _ in t.shape), tuple(int(s) for s in t.shape)
    found = chunks()
    if len(found) != 1:
        return None
    return tuple(int(o) for o in found[0].offsets), tuple(int(s) for s in found[0].sizes)


def volume(box: Box) -> int:
    n = 1
    for s in box[1]:
        n *= s
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None when they share no element."""
    if len(a[0]) != len(b[0]):
        return None
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def additive_sum(local: Any) -> int:
    """Each element's bits as an integer of its width, summed with wrap-around, modulo 2**32 (MASK): one
    changed element changes it, and the sum over a box is the sum over any boxes that tile it. Narrow views of a
    tensor are summed in place (a dtype view of the same width needs no copy); about one torch.sum."""
    import torch

    if local.numel() == 0:
        return 0
    width = local.element_size()
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    words = local.view(word) if local.dtype != torch.bool else local.view(torch.uint8)
    # The word's own width accumulates at memory speed (a widening sum runs ~15x slower); 16/8-bit words are
    # widened to 32 bits so that they do not wrap at 2**16.
    total = words.sum(dtype=word if width >= 4 else torch.int32)
    return int(total) & MASK


def reshard_verdict(saved: list[dict[str, tuple]], loaded: list[dict[str, list[tuple]]],
                    ranks: list[int]) -> dict[int, list[str]]:
    """The keys each rank loaded other values into than a save wrote, from every rank's notes of a resharded load:
    ``saved[i]`` is rank ``ranks[i]``'s ``{key: (box, total)}`` of the save, ``loaded[i]`` its ``{key: [(chunk box,
    piece box, total)]}`` of the load, per saved chunk (DCP's metadata) its loaded box overlaps. A chunk is judged
    when some rank saved it (replicas that saved it agree) and the distinct loaded pieces tile it; a rank is named
    when the sum of the pieces, its own in place of its peers' where it loaded the same piece, is not the saved
    one. Pure: no torch, no process group."""
    out: dict[int, list[str]] = {}
    keys = sorted({k for part in loaded for k in part})
    for key in keys:
        chunks: dict[Box, dict[Box, dict[int, int]]] = {}
        for rank, part in zip(ranks, loaded):
            for chunk, piece, total in part.get(key, ()):
                chunks.setdefault(_box(chunk), {}).setdefault(_box(piece), {})[rank] = int(total)
        for chunk, pieces in chunks.items():
            wrote = {int(v[1]) for part in saved for v in [part.get(key)] if v is not None and _box(v[0]) == chunk}
            if len(wrote) != 1 or sum(volume(p) for p in pieces) != volume(chunk):
                continue  # not saved as one box, replicas that disagreed at the save, or not loaded whole
            (want,) = wrote
            blamed = set()
            for rank in sorted({r for by in pieces.values() for r in by}):
                got = sum(by.get(rank, by[min(by)]) for by in pieces.values()) & MASK
                if got != want:
                    blamed.add(rank)
            for rank in blamed:
                if key not in out.setdefault(rank, []):
                    out[rank].append(key)
    return out


def _box(value: Any) -> Box:
    """A box as tuples (one that went through the side channel's pickling stays one, a JSON list would not)."""
    return tuple(int(x) for x in value[0]), tuple(int(x) for x in value[1])


def _names(keys: list[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:SHOWN])
    return shown + (f" (+{len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")


def _at(site: Site) -> str:
    return f" at {site.site}" if site.file else ""


def partial_load_finding(requested: list[str], in_checkpoint: list[str], site: Site) -> Finding | None:
    """``dcp.load`` with allow_partial_load: the keys of the state dict the checkpoint lacks were skipped. A finding
    when a wrapper's prefix explains them or nothing was loaded (checkpoint_load.load_finding's rules)."""
    have = set(in_checkpoint)
    missing = [k for k in requested if k not in have]
    if not missing:
        return None
    asked = set(requested)
    unexpected = [k for k in in_checkpoint if k not in asked]
    finding = load_finding("the state dict", len(requested), missing, unexpected, site,
                           call="dcp.load(allow_partial_load=True)", held="entries")
    if finding is not None:
        finding.detail["module"] = None
        finding.detail["api"] = "torch.distributed.checkpoint.load"
    return finding


def roundtrip_finding(differing: list[tuple[str, str, str]], load_site: Site, save_site: Site) -> Finding:
    """Loaded values that differ from the saved ones: ``differing`` is (key, saved dtype, loaded dtype)."""
    keys = [k for k, _, _ in differing]
    cast = sorted({(saved, loaded) for _, saved, loaded in differing if saved != loaded})
    if cast:
        why = (f"the checkpoint holds {cast[0][0]} and they were loaded into {cast[0][1]} tensors, which round "
               f"them: build the resumed model in the dtype it was saved in, and cast after the load if that is "
               f"intended")
    else:
        why = ("the checkpoint's files changed between the save and the load (another job, or a save to the same "
               "path that did not finish), or a custom planner or storage altered them")
    message = (f"dcp.load{_at(load_site)} read back other values than dcp.save{_at(save_site)} wrote to the same "
               f"checkpoint: {_names(keys)}; {why}. Training resumes from values that are not the checkpoint's")
    return Finding("bad_values", [], message,
                   {"cause": CAUSE, "why": "roundtrip_cast" if cast else "roundtrip_values", "keys": keys[:64],
                    "key_count": len(keys), "file": load_site.file, "line": load_site.line,
                    "save": save_site.detail()})


def not_resumed_finding(keys: list[str], n_params: int, load_site: Site, save_site: Site) -> Finding:
    """An optimizer steps parameters that hold none of the trained values the load read back."""
    message = (f"dcp.load{_at(load_site)} read the checkpoint dcp.save{_at(save_site)} wrote into a state dict "
               f"the model no longer uses: the next optimizer step updates {n_params} parameters, and none holds "
               f"the saved values of the checkpoint's {len(keys)} ({_names(keys)}). The state dict passed to dcp.load "
               f"was built "
               f"before the model was re-created (or sharded, or moved), or is a copy; build it from the model "
               f"that trains (model.state_dict() or get_state_dict(model, optimizer)) right before the load, or "
               f"apply it with set_state_dict / load_state_dict. Training resumes from the initial values, not "
               f"the checkpoint")
    return Finding("bad_values", [], message,
                   {"cause": CAUSE, "why": "not_in_model", "keys": keys[:64], "key_count": len(keys),
                    "file": load_site.file, "line": load_site.line, "save": save_site.detail()})


def _tensors(state_dict: dict[str, Any]) -> list[tuple[str, Any]]:
    import torch

    return [(k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor) and not v.is_meta]


def _saved_tensor(fp: Fingerprint, t: Any, trained: bool) -> SavedTensor:
    from distcheck.rank.checks.fingerprint import local_tensor

    box = box_of(t)
    return SavedTensor(fp, region(t), trained, layout(t), box,
                       additive_sum(local_tensor(t)) if box is not None else None)


def _loaded_pieces(t: Any, before: SavedTensor, chunks: Any) -> list[tuple[Box, Box, int]]:
    """(chunk, piece, additive sum) of this rank's loaded values over each saved chunk they overlap, cast to the
    saved dtype first (a checkpoint loaded into bf16 tensors comes back rounded)."""
    import torch

    from distcheck.rank.checks.fingerprint import local_tensor

    box = box_of(t)
    if box is None:
        return []
    local = local_tensor(t)
    saved_dtype = getattr(torch, before.fp.dtype, None)
    out = []
    for chunk in chunks:
        c = (tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        piece = intersect(box, c)
        if piece is None:
            continue
        part = local
        for d, (lo, size) in enumerate(zip(piece[0], piece[1])):
            part = part.narrow(d, lo - box[0][d], size)
        if saved_dtype is not None and part.dtype != saved_dtype:
            part = part.to(saved_dtype)
        out.append((c, piece, additive_sum(part)))
    return out


def _ident(t: Any) -> tuple[int, int, tuple[int, ...]]:
    """Where a tensor's (local) values live: a state dict's tensor and the parameter it was taken from agree."""
    from distcheck.rank.checks.fingerprint import local_tensor

    local = local_tensor(t)
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)


class DcpWatch(Check):
    """DCP's saves and loads in this rank (the hooks: :func:`patch`); its findings go out through ``core.emit``."""

    name = "dcp_roundtrip"

    def __init__(self, core: Any) -> None:
        super().__init__(core)
        self.saved: OrderedDict[str, Saved] = OrderedDict()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # those that stepped: their params are "trained"
        self.loading: list[list[tuple[Any, Site]]] = []  # per dcp.load in flight: the planners it set up
        self.resumed: Resumed | None = None
        self.reported: set[tuple] = set()

    def _report(self, finding: Finding, key: tuple) -> None:
        if key in self.reported:
            return
        self.reported.add(key)
        finding.ranks = [self.core.rank]
        self.core.emit([finding])

    # -- save ------------------------------------------------------------------------------------------------------
    def on_dcp_save_plan(self, state_dict: dict[str, Any], checkpoint_id: Any, site: Site) -> None:
        from distcheck.rank.checks.fingerprint import fingerprint_many

        key = checkpoint_key(checkpoint_id)
        if key is None:
            return
        tensors = _tensors(state_dict)[:MAX_KEYS]
        trained = set()
        for opt in list(self.optimizers):
            for group in opt.param_groups:
                trained.update(_ident(p) for p in group["params"])
        fps = fingerprint_many(tensors)
        self.saved.pop(key, None)
        self.saved[key] = Saved(site, {k: _saved_tensor(fps[k], t, _ident(t) in trained)
                                       for k, t in tensors if k in fps})
        while len(self.saved) > MAX_CHECKPOINTS:
            self.saved.popitem(last=False)

    # -- load ------------------------------------------------------------------------------------------------------
    def on_dcp_load_plan(self, planner: Any, site: Site) -> None:
        metadata = getattr(planner, "metadata", None)
        state_dict = getattr(planner, "state_dict", None)
        if metadata is None or not isinstance(state_dict, dict):
            return
        if getattr(planner, "allow_partial_load", False):
            finding = partial_load_finding(list(state_dict), list(metadata.state_dict_metadata), site)
            if finding is not None:
                self._report(finding, ("partial", site.file, site.line))
        if self.loading:
            self.loading[-1].append((planner, site))

    def on_dcp_load_start(self) -> None:
        self.loading.append([])

    def on_dcp_load_end(self, completed: bool, ranks: list[int] | None = None) -> None:
        """A ``dcp.load`` returned (``completed``) on the load's ``ranks`` (None: every rank)."""
        planners = self.loading.pop() if self.loading else []
        if not completed:  # the load raised: the user sees torch's error
            return
        for planner, site in planners:
            storage_meta = getattr(planner.metadata, "storage_meta", None)
            saved = self.saved.get(checkpoint_key(getattr(storage_meta, "checkpoint_id", None)) or "")
            if saved is not None:
                self._compare(planner.state_dict, saved, site, planner.metadata, ranks)

    def _compare(self, state_dict: dict[str, Any], saved: Saved, site: Site, metadata: Any = None,
                 ranks: list[int] | None = None) -> None:
        import torch

        from distcheck.rank.checks.fingerprint import fingerprint, local_tensor

        differing, keys, trained = [], [], set()
        resharded: list[tuple[str, Any, SavedTensor]] = []
        for k, t in _tensors(state_dict):
            before = saved.tensors.get(k)
            if before is None:
                continue
            if before.region != region(t):  # resharded: other values on this rank, checked across the ranks
                resharded.append((k, t, before))
                continue
            local = local_tensor(t)
            saved_dtype = getattr(torch, before.fp.dtype, None)
            now = fingerprint(local if saved_dtype in (None, local.dtype) else local.to(saved_dtype))
            if now != before.fp:
                differing.append((k, before.fp.dtype, str(local.dtype).replace("torch.", "")))
            elif before.trained:
                keys.append(k)
                if local.numel():  # an empty shard (FSDP2's of a small tensor) equals any other: it proves nothing
                    trained.add(before.fp)
        if any(before.layout != layout(t) for _, t, before in resharded):  # the same on every rank of the load
            differing += self._compare_resharded(resharded, metadata, ranks)
        if differing:
            self._report(roundtrip_finding(differing, site, saved.site), ("roundtrip", site.file, site.line))
        elif trained:
            self.resumed = Resumed(site, saved.site, sorted(keys), trained)

    def _compare_resharded(self, resharded: list[tuple[str, Any, SavedTensor]], metadata: Any,
                           ranks: list[int] | None) -> list[tuple[str, str, str]]:
        """(key, saved dtype, loaded dtype) of the keys whose loaded values on this rank, summed with its peers'
        over the checkpoint's chunks, are not what was saved (:func:`reshard_verdict`)."""
        from distcheck.rank.runtime import current_channel

        channel = current_channel()
        chunks_of = getattr(metadata, "state_dict_metadata", None) or {}
        if channel is None:
            return []
        mine_saved: dict[str, tuple] = {}
        mine_loaded: dict[str, list[tuple]] = {}
        dtypes: dict[str, tuple[str, str]] = {}
        for k, t, before in resharded:
            if before.box is not None and before.total is not None:
                mine_saved[k] = (before.box, before.total)
            pieces = _loaded_pieces(t, before, getattr(chunks_of.get(k), "chunks", None) or ())
            if pieces:
                mine_loaded[k] = pieces
                dtypes[k] = (before.fp.dtype, str(t.dtype).replace("torch.", ""))
        members = list(range(channel.world_size)) if ranks is None else sorted(ranks)
        if self.core.rank not in members:
            return []
        parts = channel.exchange("dcp_reshard", (mine_saved, mine_loaded), members, timeout=EXCHANGE_TIMEOUT)
        verdict = reshard_verdict([p[0] for p in parts], [p[1] for p in parts], members)
        return [(k, *dtypes[k]) for k in verdict.get(self.core.rank, []) if k in dtypes]

    # -- the optimizer steps after a load ---------------------------------------------------------------------------
    def on_dcp_step(self, optimizer: Any) -> None:
        self.optimizers.add(optimizer)
        resumed = self.resumed
        if resumed is None or id(optimizer) in resumed.checked:
            return
        resumed.checked.add(id(optimizer))
        from distcheck.rank.checks.fingerprint import fingerprint_many, local_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        now = fingerprint_many((str(i), p) for i, p in enumerate(params) if local_tensor(p).numel())
        held = resumed.trained
        shapes = {(fp.dtype, fp.shape) for fp in held}
        # Shaped like the checkpoint's parameters (not a new head's optimizer) and holding none of their values:
        # a resume that reached the model holds all of them, one that rounded or resharded was reported or skipped.
        if any((fp.dtype, fp.shape) in shapes for fp in now.values()) and not any(fp in held for fp in now.values()):
            finding = not_resumed_finding(resumed.keys, len(params), resumed.load_site, resumed.save_site)
            self._report(finding, ("not_in_model", resumed.load_site.file, resumed.load_site.line))


# -- the hooks ---------------------------------------------------------------------------------------------------------

def _load_ranks(kwargs: dict[str, Any]) -> list[int] | None:
    """The ranks a ``dcp.load`` runs on: its process_group's (None: every rank); [] for ``no_dist`` (one rank,
    nothing to exchange)."""
    import torch.distributed as dist

    if kwargs.get("no_dist") or not dist.is_initialized():
        return []
    group = kwargs.get("process_group")
    return None if group is None else [int(r) for r in dist.get_process_group_ranks(group)]


def patch(module: Any, replace: Any, current: Any, as_user: Any) -> None:
    """Wrap DCP's planners and ``load``, from patches.py (which passes its helpers, so that this module does not
    import it): ``replace`` rebinds ``load`` in every torch.distributed.checkpoint module that re-exports it,
    ``current`` gives the active AutoCheck, ``as_user`` calls torch on the user's behalf. Every wrapper calls the
    original first and fires its event (``dcp_*``, rank/autocheck/protocol.py), which never raises."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from distcheck.rank.usersite import caller_site

    load = module.load
    if hasattr(load, "__distcheck_original__"):
        return

    @functools.wraps(load)
    def load_wrapper(*args: Any, **kwargs: Any) -> Any:
        check = current()
        if check is None:
            return as_user(load, *args, **kwargs)
        check.fire("dcp_load_start")
        completed = False
        try:
            result = as_user(load, *args, **kwargs)
            completed = True
        finally:
            try:
                ranks = _load_ranks(kwargs)
            except Exception as exc:  # the check must never break the user's load
                log.debug("distcheck: DCP round-trip check failed: %s", exc)
            else:
                check.fire("dcp_load_end", completed, ranks)
        return result

    load_wrapper.__distcheck_original__ = load  # type: ignore[attr-defined]
    replace("load", load, load_wrapper, "torch.distributed.checkpoint")

    create_local_plan = DefaultLoadPlanner.create_local_plan

    @functools.wraps(create_local_plan)
    def load_plan_wrapper(self: Any) -> Any:
        plan = create_local_plan(self)  # raises first on a key missing without allow_partial_load
        check = current()
        if check is not None:
            check.fire("dcp_load_plan", self, caller_site())
        return plan

    DefaultLoadPlanner.create_local_plan = load_plan_wrapper

    set_up_planner = DefaultSavePlanner.set_up_planner

    # DCP inspects this signature for ``storage_meta``: keep the parameters torch's own has.
    @functools.wraps(set_up_planner)
    def save_plan_wrapper(self: Any, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> Any:
        result = set_up_planner(self, state_dict, storage_meta, is_coordinator)
        check = current()
        if check is not None:  # (async_save plans in a thread of its own: its caller's line is not on that stack,
            # the save's line stays unknown)
            check.fire("dcp_save_plan", self.state_dict, getattr(storage_meta, "checkpoint_id", None), caller_site())
        return result

    DefaultSavePlanner.set_up_planner = save_plan_wrapper

    def step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        check = current()
        if check is not None:  # every level of a nested step: an inner optimizer's parameters are trained too
            check.fire("dcp_step", optimizer)

    register_optimizer_step_pre_hook(step_pre_hook)
