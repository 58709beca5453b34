"""The model compared across ranks where it is parallelized, before torch's own code runs.

    python -m distcheck run --nproc 2 -- train.py      # every rank; DISTCHECK_AUTOCHECK=0 turns it off

At each call of ``fully_shard``, ``DistributedDataParallel(...)``, ``FullyShardedDataParallel(...)``,
``parallelize_module`` or ``distribute_module`` (rank/autocheck/patches.py), before torch runs, the ranks of the
call's mesh or process group compare the module's not-yet-parallelized parameters and buffers: names, shapes, dtypes
and fingerprints (rank/checks/fingerprint.py) in one side-channel exchange, never the user's process group (no entry in
the user's trace). That is the only point where
rank-seeded init is visible: fully_shard slices each rank's own copy, DDP's construction broadcast copies rank 0's
values over the others. A tensor-parallel DTensor is compared with the ranks holding the same shard (its
coordinate on every non-Replicate mesh dim); a meta tensor holds nothing yet (rank 0 alone built real weights and
broadcasts them later): its name, shape and dtype are compared, never its values, and it is never "missing".
What each call leaves per rank follows torch's own code (read in torch 2.13):
- ``fully_shard`` broadcasts nothing: every rank keeps its slice of its own copy, so every value must agree.
- ``DistributedDataParallel`` broadcasts rank 0's parameters and buffers at construction (``init_sync=True``, the
  default): only the structure counts before it; values too with ``init_sync=False``.
- FSDP1's ``FullyShardedDataParallel`` (its outermost call: an auto-wrap policy builds the inner units inside it)
  shards each rank's own copy unless ``sync_module_states=True`` (not the default) broadcasts rank 0's first: values
  count without it, only the structure with it.
- ``parallelize_module`` / ``distribute_module``: every ``ParallelStyle`` (and distribute_module's default
  replication) converts parameters with ``distribute_tensor(..., src_data_rank=...)``, default 0, which scatters (or
  broadcasts) rank 0's values and discards the others' (torch/distributed/tensor/parallel/style.py, _api.py). The
  comparison is made before the call, and what the call scattered is dropped when it returns (a wrapper of
  ``distribute_tensor`` notes which tensors it converted and with which ``src_data_rank``); what the plan left as a
  plain tensor, and what a style built with ``src_data_rank=None`` converted (each rank keeps its own values), must
  agree.
- ``distribute_tensor(t, mesh, placements, src_data_rank=None)`` called by the user keeps each rank's ``t``: the
  ranks of the mesh compare ``t`` at that call (its first ``DIRECT_CHECKS`` such calls: they are collective over the
  side channel, and one per training step would cost every step) and a difference is one finding at its line.

A model whose structure differs (a vocabulary built from each rank's own data) is one finding at once, before
torch's size error. Values that differ are kept until the first forward, where one exchange over every rank makes
them one finding for the whole model, however many calls and groups saw them; the last ``torch.manual_seed`` of
each rank (patched to note its seed and line) names the cause when the seeds differ. A tensor whose local values
changed between the end of its parallelizing call and the first forward (pretrained weights loaded after
fully_shard) was overwritten, so its init does not matter: it is dropped from the finding.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from distcheck.analysis.replicas import Divergence, Entry, Fingerprint, find_divergences
from distcheck.contract.findings import Finding, format_names, format_ranks
from distcheck.rank.autocheck.discovery import FirstForward, user_name
from distcheck.rank.autocheck.protocol import Check
from distcheck.rank.usersite import Site, caller_site
from distcheck.contract.site import file_line

log = logging.getLogger("distcheck")

SHOWN = 4  # names a message spells out; detail.params has them all
DIRECT_CHECKS = 16  # distribute_tensor(..., src_data_rank=None) calls compared per process (see the docstring)

_LABEL = {"fully_shard": "fully_shard", "ddp": "DistributedDataParallel(...)",
          "fsdp1": "FullyShardedDataParallel(...)", "parallelize_module": "parallelize_module",
          "distribute_module": "distribute_module",
          "distribute_tensor": "distribute_tensor(..., src_data_rank=None)"}

# Why a call leaves these values as each rank built them (row["why"]), for the finding's message.
_WHY = {
    "fully_shard": "fully_shard broadcasts nothing: each rank keeps its own slice of its own copy",
    "ddp_no_sync": "DistributedDataParallel(init_sync=False) skips the construction broadcast of rank 0's values",
    "fsdp1": ("FullyShardedDataParallel broadcasts nothing without sync_module_states=True: each rank keeps its own "
              "chunk of its own copy"),
    "left_plain": "no ParallelStyle of the plan converts them, so they stay plain tensors with each rank's values",
    "src_none": "they were converted with src_data_rank=None, which keeps each rank's local values instead of "
                "scattering rank 0's",
}
_SCATTERING = ("parallelize_module", "distribute_module")  # calls whose distribute_tensor may scatter rank 0's values


def tensor_ident(t: Any) -> tuple | None:
    """Identifies a tensor's memory across aliases: distribute_module passes ``param.data``, not the parameter."""
    try:
        if t.is_meta or getattr(t, "placements", None) is not None:
            return None
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
    except Exception:
        return None


def prewrap_key(t: Any) -> Any:
    """Ranks with equal keys must hold equal values before the call: every plain tensor; a DTensor (tensor
    parallelism applied before fully_shard) with the ranks that hold the same shard of it, whatever its mesh's
    ranks are (the dp peers of a TP rank sit on other TP meshes)."""
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    coord = mesh.get_coordinate() or []
    return ("dtensor", tuple(mesh.mesh.shape), tuple(repr(p) for p in placements),
            tuple((d, coord[d]) for d, p in enumerate(placements) if not p.is_replicate()))


def _site_json(site: Site | None) -> list | None:
    return [site.file, site.line] if site is not None and site.file and site.line else None


def _where(site: list | None) -> str:
    return file_line(site[0], site[1]) or "?" if site else "?"


def seed_note(seed: Any) -> tuple[int, Site] | None:
    """``torch.manual_seed(seed)`` at the user's line, for a cause that names it (None: not an int seed)."""
    try:
        return int(seed), caller_site()
    except (TypeError, ValueError):
        return None


class PreWrap(Check):
    """This rank's comparisons at parallelizing calls, and what they found until the first forward reports it."""

    name = "prewrap"

    def __init__(self, core: Any) -> None:
        super().__init__(core)  # the rank, wrap_depth (a call inside a parallelizing call is its part), keep()
        self.seed: tuple[int, Site] | None = None  # the last torch.manual_seed(n) and its line
        self.points: list[dict[str, Any]] = []  # one per comparison: how, site, ranks, names, identical
        self.pending: list[dict[str, Any]] = []  # value differences not yet reported (JSON-able)
        self.reported = False
        self.seconds = 0.0
        self._modules: list[tuple[weakref.ref, int]] = []  # (module compared, index in points)
        self._after: list[dict[str, Any]] = []  # pending rows not yet fingerprinted after their call returned
        self._converted: dict[tuple, int | None] = {}  # inside a call: tensor ident -> its src_data_rank
        self._idents: dict[int, tuple | None] = {}  # id(pending row) -> the ident of its tensor before the call
        self._styles_without_src: list[str] = []  # the plan's ParallelStyles built with src_data_rank=None
        self.direct_checks = 0

    # -- events -----------------------------------------------------------------------------------------------------
    def on_seed_set(self, seed: Any) -> None:
        self.seed = seed_note(seed) or self.seed

    def on_wrap_returned(self) -> None:
        self._settle()
        self._note_after()

    def on_plan(self, module: Any, plan: Any, ranks: list[int] | None, src_data_rank: Any = 0) -> None:
        """parallelize_module's plan and its ``src_data_rank`` (which torch sets on every style of the plan): what
        keeps each rank's values (src_data_rank=None), for the message."""
        if src_data_rank is None:
            self._styles_without_src = ["parallelize_module(..., src_data_rank=None)"]
            return
        styles = plan.values() if isinstance(plan, dict) else [plan]
        self._styles_without_src = sorted({type(s).__name__ + "(src_data_rank=None)" for s in styles
                                           if getattr(s, "src_data_rank", 0) is None})

    def on_distribute_tensor(self, tensor: Any, ranks: list[int] | None, placements: Any, src_data_rank: Any
                             ) -> None:
        """A ``distribute_tensor`` call over a mesh of ``ranks`` (None: every rank): inside a parallelizing call,
        which tensor it converted and how; called by the user with ``src_data_rank=None``, its tensor compared
        across the mesh at once."""
        if self.core.wrap_depth:
            ident = tensor_ident(tensor)
            if ident is not None:
                self._converted[ident] = src_data_rank
            return
        if src_data_rank is None and tensor_ident(tensor) is not None and self.direct_checks < DIRECT_CHECKS:
            self.direct_checks += 1
            started = time.perf_counter()
            try:
                self._compare_direct(tensor, ranks, placements)
            except Exception as exc:  # the check must never break the user's training
                log.warning("distcheck: comparing a tensor at distribute_tensor failed: %s: %s",
                            type(exc).__name__, exc)
            finally:
                self.seconds += time.perf_counter() - started

    def _settle(self) -> None:
        """The outermost parallelizing call returned: drop the rows whose tensors it scattered from rank 0 (they are
        rank 0's values now on every rank), and say for the others why the call left them per rank."""
        converted, self._converted = self._converted, {}
        keep = []
        for row in self.pending:
            ident = self._idents.pop(id(row), None) if "why" not in row else None
            if "why" not in row:
                if row.get("how") in _SCATTERING:
                    src = converted.get(ident, "plain") if ident is not None else "plain"
                    if src is not None and src != "plain":
                        continue  # scattered from rank src_data_rank: consistent by construction
                    row["why"] = "src_none" if src is None else "left_plain"
                    if src is None and self._styles_without_src:
                        row["styles"] = self._styles_without_src
                else:
                    row["why"] = {"ddp": "ddp_no_sync", "fsdp1": "fsdp1"}.get(row.get("how"), "fully_shard")
            keep.append(row)
        kept = {id(r) for r in keep}
        dropped = [r for r in self.pending if id(r) not in kept]
        self.pending = keep
        self._after = [r for r in self._after if id(r) in kept]
        for point in {r["point"] for r in dropped}:
            if not any(r["point"] == point for r in keep):
                self.points[point]["identical"] = True

    def _note_after(self) -> None:
        """The call returned: note each new pending tensor's local values, to see at the first forward whether
        something (a checkpoint load) overwrote them since."""
        rows, self._after = self._after, []
        for row in rows:
            try:
                row["after"] = _local_fp(self._module_at(row["point"]), row["name"])
            except Exception as exc:  # never break the user's training: the row stays reported
                log.debug("distcheck: could not fingerprint %s after parallelizing: %s", row["name"], exc)

    def _module_at(self, point: int) -> Any:
        ref = next((r for r, i in self._modules if i == point), None)
        return ref() if ref is not None else None

    def _still_pending(self) -> list[dict[str, Any]]:
        """Pending rows less those whose local tensor changed since their call returned (overwritten)."""
        keep = []
        for row in self.pending:
            after = row.get("after")
            try:
                now = _local_fp(self._module_at(row["point"]), row["name"]) if after is not None else None
            except Exception:
                now = None
            if after is not None and now is not None and now != after:
                continue
            keep.append(row)
        return keep

    def on_wrap_call(self, how: str, module: Any, ranks: list[int] | None, values: bool = True) -> None:
        """Compare ``module`` across ``ranks`` (None: every rank) before ``how`` parallelizes it; ``values``
        False: the call itself makes the values equal (DDP's construction broadcast), only the structure counts."""
        if self.core.wrap_depth:
            return
        from distcheck.rank.runtime import current_channel

        channel = current_channel()
        if channel is None:
            return
        ranks = sorted(ranks) if ranks else list(range(channel.world_size))
        if len(ranks) < 2 or channel.rank not in ranks:
            return
        started = time.perf_counter()
        try:
            self._compare(how, module, ranks, channel, values)
        except Exception as exc:  # the check must never break the user's training
            log.warning("distcheck: comparing the model before %s failed: %s: %s", how, type(exc).__name__, exc)
        finally:
            self.seconds += time.perf_counter() - started

    # -- the comparison ---------------------------------------------------------------------------------------------
    def _compare(self, how: str, module: Any, ranks: list[int], channel: Any, values: bool = True) -> None:
        import torch

        from distcheck.rank.checks.replicas import compare_entries

        site = caller_site()
        items = _unwrapped_tensors(how, module)
        real = [it for it in items if not _is_meta(it[2])]
        meta = [(n, role, prewrap_key(t), _structure(t)) for n, role, t in items if _is_meta(t)]
        extra = {"seed": self.seed[0] if self.seed else None, "seed_site": _site_json(self.seed[1]) if self.seed
                 else None, "meta": meta}
        with torch.no_grad():
            compared = compare_entries(f"prewrap/{how}", real, channel, ranks, key=prewrap_key, extra=extra)
        # A tensor on meta on some rank holds no values there: its structure alone is compared, on every rank.
        per_meta = {r: (e or {}).get("meta") or [] for r, e in zip(ranks, compared.extras)}
        meta_names = {m[0] for ms in per_meta.values() for m in ms}
        divergences = [d for d in compared.divergences if d.name not in meta_names]
        shapes = {r: {e.name: (e.replica_key, e.fp.shape, e.fp.dtype, e.role) for e in entries}
                  for r, entries in zip(ranks, compared.entries)}
        for r, ms in per_meta.items():
            for name, role, key, (shape, dtype) in ms:
                shapes[r][name] = (key, tuple(shape), dtype, role)
        if meta_names:
            divergences += _structure_divergences(shapes, meta_names)
        structural = [d for d in divergences if d.structural]
        identical = not structural if not values else not divergences
        point = {"how": how, "site": _site_json(site), "ranks": ranks, "count": len(items), "identical": identical}
        self.points.append(point)
        self._modules.append((weakref.ref(module), len(self.points) - 1))
        if not divergences:
            return
        seeds = {r: e for r, e in zip(ranks, compared.extras)}
        if structural:  # the values that differ too follow from it (each rank's RNG drew other amounts): one cause
            self._report_structure(how, module, point, structural, shapes)
            return
        if not values:
            return
        idents = {n: tensor_ident(t) for n, _, t in items}
        for d in divergences:
            per = compared.summaries.get(d.name, {})
            worst = max(per.values(), key=lambda s: s.max_abs_diff, default=None)
            self.pending.append({
                "name": d.name, "role": d.role, "ranks": d.ranks, "blamed": d.blamed, "reference": d.reference,
                "point": len(self.points) - 1, "how": how, "site": point["site"],
                "max_abs_diff": worst.max_abs_diff if worst else None, "diff_rank": worst.rank if worst else None,
                "built": _site_json(_param_site(module, d.name)),
                "seeds": {str(r): s.get("seed") for r, s in seeds.items()},
                "seed_sites": {str(r): s.get("seed_site") for r, s in seeds.items()}})
            self._idents[id(self.pending[-1])] = idents.get(d.name)
            self._after.append(self.pending[-1])

    def _compare_direct(self, tensor: Any, ranks: list[int] | None, placements: Any) -> None:
        """The user's ``distribute_tensor(tensor, mesh, ..., src_data_rank=None)``: torch keeps each rank's values, so
        the mesh's ranks must all pass the same tensor; a difference is one finding at the call's line."""
        import torch

        from distcheck.rank.checks.replicas import compare_entries
        from distcheck.rank.runtime import current_channel

        channel = current_channel()
        if channel is None:
            return
        ranks = sorted(ranks) if ranks else list(range(channel.world_size))
        if len(ranks) < 2 or channel.rank not in ranks:
            return
        site = caller_site()
        with torch.no_grad():
            compared = compare_entries("prewrap/distribute_tensor", [("tensor", "tensor", tensor)], channel, ranks,
                                       key=prewrap_key)
        if not compared.divergences or self.core.rank != ranks[0]:
            return
        d = compared.divergences[0]
        per = compared.summaries.get(d.name, {})
        worst = max(per.values(), key=lambda s: s.max_abs_diff, default=None)
        shapes = {str(e.fp.shape) for entries in compared.entries for e in entries}
        what = ("shapes " + " vs ".join(sorted(shapes))) if d.structural else (
            f"max abs diff {worst.max_abs_diff:.4g} on rank {worst.rank}" if worst else "values")
        where = _where(_site_json(site))
        placed = ", ".join(repr(p) for p in placements) if placements else "Replicate()"
        message = (f"distribute_tensor(..., src_data_rank=None) at {where}: {format_ranks(ranks)} passed different "
                   f"tensors ({what}; placements [{placed}]). With src_data_rank=None torch keeps each rank's own "
                   f"values instead of scattering rank 0's, so the DTensor holds pieces of different tensors. Build "
                   f"the tensor identically on every rank, leave src_data_rank at its default (0) to take rank 0's, "
                   f"or use DTensor.from_local for per-rank shards.")
        detail = {"cause": "src_data_rank_none", "when": "at distribute_tensor", "call": "distribute_tensor",
                  "src_data_rank": None, "ranks_compared": ranks, "reference": d.reference,
                  "max_abs_diff": worst.max_abs_diff if worst else None, "file": site.file, "line": site.line}
        self.core.keep([Finding("tensor_divergence", sorted(d.blamed or ranks), message, detail)])

    def _report_structure(self, how: str, module: Any, point: dict, divs: list,
                          structure: dict[int, dict[str, tuple]]) -> None:
        """Ranks built different models: say which tensors, with every rank's shape, before torch's size error."""
        ranks = point["ranks"]
        shapes: dict[str, dict[int, str]] = {}
        for r, entries in structure.items():
            for name, (_, shape, dtype, _) in entries.items():
                shapes.setdefault(name, {})[r] = f"{list(shape)} {dtype}"
        parts, rows = [], []
        first_site = None
        for d in divs:
            per = shapes.get(d.name, {})
            built = _param_site(module, d.name)
            first_site = first_site or built
            groups: dict[str, list[int]] = {}
            for r in ranks:
                groups.setdefault(per.get(r, "missing"), []).append(r)
            text = ", ".join(f"{s} on {format_ranks(rs)}" for s, rs in groups.items())
            parts.append(f"{d.name} {text}" + (f", built at {built}" if built and built.site else ""))
            rows.append({"param": d.name, "shapes": {str(r): per.get(r) for r in ranks},
                         "file": built.file if built else None, "line": built.line if built else None})
        label = _LABEL.get(how, how)
        message = (f"the model differs across {format_ranks(ranks)} before {label} at {_where(point['site'])}: "
                   f"{len(divs)} tensor{'s' if len(divs) != 1 else ''} with different shapes or missing: "
                   + "; ".join(parts[:SHOWN]) + (f"; (+{len(parts) - SHOWN} more)" if len(parts) > SHOWN else "")
                   + ". Each rank must build the same model (a vocabulary or a size computed from each rank's own "
                   "data differs); compute such sizes once and share them (broadcast_object_list) before building.")
        detail = {"cause": "structure", "when": f"before {how}", "params": [d.name for d in divs], "count": len(divs),
                  "tensors": rows, "wrap_site": point["site"],
                  "file": first_site.file if first_site else None, "line": first_site.line if first_site else None}
        finding = Finding("tensor_divergence", sorted({r for d in divs for r in d.blamed}), message, detail)
        if self.core.rank == ranks[0]:
            self.core.keep([finding])

    # -- reporting --------------------------------------------------------------------------------------------------
    def on_first_forward(self, ctx: FirstForward) -> None:
        """What differed before parallelizing joins the model's first-forward check (discovery.py), and the last
        call that found the ranks identical dates what differs at that forward."""
        ctx.before, ctx.reported = self.flush(ctx.root, ctx.site)
        ctx.identical_at = self.identical_before(ctx.root)

    def identical_before(self, root: Any) -> dict[str, Any] | None:
        """The last comparison of a module inside ``root`` that found every rank identical (DDP's construction)."""
        inside = {id(m) for m in root.modules()}
        for ref, index in reversed(self._modules):
            m = ref()
            if m is not None and id(m) in inside and self.points[index]["identical"]:
                return self.points[index]
        return None

    def flush(self, root: Any, forward_site: Site) -> tuple[list[Finding], set[str]]:
        """At the first forward: one exchange over every rank; the lead returns (and emits) one finding for every
        value difference seen before parallelizing. Returns (findings, names already reported)."""
        from distcheck.rank.runtime import current_channel

        if self.reported:
            return [], set()
        self.reported = True
        prefixes = {id(m): n for n, m in root.named_modules()}
        rows = []
        for row in self._still_pending():
            m = self._module_at(row["point"])
            prefix = prefixes.get(id(m), "") if m is not None else ""
            row = {k: v for k, v in row.items() if k != "after"}
            rows.append(dict(row, name=user_name(f"{prefix}.{row['name']}" if prefix else row["name"])))
        channel = current_channel()
        per_rank = {self.core.rank: rows}
        if channel is not None:
            per_rank = dict(enumerate(channel.exchange("autocheck/prewrap", rows)))
        names = {row["name"] for rs in per_rank.values() for row in rs}
        if self.core.rank != min(per_rank):
            return [], names
        finding = prewrap_finding(per_rank)
        return ([finding] if finding else []), names

    def finish(self) -> None:
        """The script ended without a forward: each group's lowest rank reports what its group saw."""
        if self.reported or not self.pending:
            return
        self.reported = True
        mine = [r for r in self._still_pending() if r["ranks"][0] == self.core.rank]
        finding = prewrap_finding({self.core.rank: mine}) if mine else None
        if finding is not None:
            self.core.keep([finding])

    def state(self) -> dict[str, Any] | None:
        return {"points": self.points, "seconds": self.seconds} if self.points else None


def prewrap_finding(per_rank: dict[int, list[dict[str, Any]]]) -> Finding | None:
    """One ``tensor_divergence`` for every tensor some group of ranks held differently before parallelizing."""
    by_name: dict[str, dict[str, Any]] = {}
    for rows in per_rank.values():
        for row in rows:
            seen = by_name.setdefault(row["name"], dict(row, ranks=list(row["ranks"]), blamed=list(row["blamed"])))
            seen["ranks"] = sorted(set(seen["ranks"]) | set(row["ranks"]))
            seen["blamed"] = sorted(set(seen["blamed"]) | set(row["blamed"]))
            if (row.get("max_abs_diff") or 0) > (seen.get("max_abs_diff") or 0):
                seen.update(max_abs_diff=row["max_abs_diff"], diff_rank=row["diff_rank"])
            seen["seeds"] = {**seen.get("seeds", {}), **row.get("seeds", {})}
            seen["seed_sites"] = {**seen.get("seed_sites", {}), **row.get("seed_sites", {})}
    if not by_name:
        return None
    rows = list(by_name.values())
    names = [r["name"] for r in rows]
    ranks = sorted({x for r in rows for x in r["ranks"]})
    blamed = sorted({x for r in rows for x in r["blamed"]})
    first = rows[0]
    hows = list(dict.fromkeys(f"{_LABEL.get(r['how'], r['how'])} at {_where(r['site'])}" for r in rows))
    worst = max(rows, key=lambda r: r.get("max_abs_diff") or 0)
    count = f"{len(names)} parameter{'s' if len(names) != 1 else ''}"
    message = (f"{count} differ{'s' if len(names) == 1 else ''} across {format_ranks(ranks)} before the model was "
               f"parallelized ({', '.join(hows[:2])}{' ...' if len(hows) > 2 else ''}), so each rank trains from "
               f"another init: {format_names(names, SHOWN)}")
    if worst.get("max_abs_diff") is not None:
        message += f"; max abs diff {worst['max_abs_diff']:.4g} ('{worst['name']}', rank {worst['diff_rank']})"
    why = why_text(rows)
    message += f". {why}" if why else ""
    seeds = {int(r): s for r, s in first.get("seeds", {}).items()}
    seed_sites = {int(r): s for r, s in first.get("seed_sites", {}).items() if s}
    file, line = (first["built"] or [None, None])
    if len({s for s in seeds.values()}) > 1 and all(s is not None for s in seeds.values()):
        site = seed_sites.get(min(seed_sites)) if seed_sites else None
        shown = ", ".join(f"torch.manual_seed({s}) on rank {r}" for r, s in sorted(seeds.items())[:4])
        message += (f". Each rank seeded its RNG differently before building the model: {shown} at {_where(site)}; "
                    "seed every rank alike before building (a per-rank seed belongs after parallelizing, for data "
                    "and dropout)")
        cause = "rank_seeded"
        if site:
            file, line = site
    elif all(r.get("why") == "src_none" for r in rows):
        message += (". Build the model identically on every rank (the same torch.manual_seed before building), or "
                    "leave src_data_rank at its default (0) so that torch scatters rank 0's values")
        cause = "src_data_rank_none"
        file, line = first["site"] or [file, line]
    else:
        built = f" (first built at {_where(first['built'])})" if first["built"] else ""
        message += (f". The ranks built or initialized their copies differently{built}: an init that depends on "
                    "the rank, or state loaded on some ranks only; initialize identically on every rank before "
                    "parallelizing")
        cause = "rank_dependent_init"
        if not first["built"] and first["site"]:
            file, line = first["site"]
    detail = {"cause": cause, "when": "before parallelizing", "params": names, "count": len(names),
              "why": sorted({r.get("why") or "" for r in rows} - {""}),
              "max_abs_diff": worst.get("max_abs_diff"), "max_abs_diff_param": worst["name"],
              "wrap_sites": [r["site"] for r in rows], "seeds": {str(r): s for r, s in sorted(seeds.items())},
              "file": file, "line": line}
    return Finding("tensor_divergence", blamed or ranks, message + ".", detail)


def why_text(rows: list[dict[str, Any]]) -> str:
    """Why each call left these tensors as each rank built them ("Why: ..."), one clause per (call, reason)."""
    clauses: dict[tuple, list[str]] = {}
    for row in rows:
        why = row.get("why") or ("fully_shard" if row["how"] == "fully_shard" else "")
        label = f"{_LABEL.get(row['how'], row['how'])} at {_where(row['site'])}"
        reason = _WHY.get(why, "")
        if why == "src_none" and row.get("styles"):
            reason = (f"{', '.join(row['styles'])} keep{'s' if len(row['styles']) == 1 else ''} each rank's local "
                      "values instead of scattering rank 0's")
        clauses.setdefault((label, reason), []).append(row["name"])
    parts = [f"{label}: {reason}" + (f" ({format_names(names, SHOWN)})" if len(clauses) > 1 else "")
             for (label, reason), names in clauses.items() if reason]
    return ("Why the call does not make them equal: " + "; ".join(parts)) if parts else ""


def _param_site(module: Any, name: str) -> Site | None:
    from distcheck.rank.usersite import param_site

    try:
        return param_site(module, name)
    except Exception:
        return None


def _is_meta(t: Any) -> bool:
    from distcheck.rank.checks.fingerprint import local_tensor

    return bool(t.is_meta or local_tensor(t).is_meta)


def _structure(t: Any) -> tuple[tuple[int, ...], str]:
    """(local shape, dtype) as a fingerprint spells them."""
    from distcheck.rank.checks.fingerprint import local_tensor

    local = local_tensor(t)
    return tuple(local.shape), str(local.dtype).replace("torch.", "")


def _structure_divergences(shapes: dict[int, dict[str, tuple]], names: set[str]) -> list[Divergence]:
    """Shape, dtype or presence differences of ``names`` (tensors on meta on some rank), values never compared."""
    per_rank = {r: [Entry(n, role, key, Fingerprint(dtype, tuple(shape), (), ()))
                    for n, (key, shape, dtype, role) in entries.items() if n in names]
                for r, entries in shapes.items()}
    return [d for d in find_divergences(per_rank) if d.structural]


def _local_fp(module: Any, name: str) -> Any:
    """The fingerprint of ``module``'s parameter or buffer ``name`` (a DTensor's local shard); None if absent."""
    from distcheck.rank.checks.fingerprint import fingerprint

    if module is None:
        return None
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    t = tensors.get(name)
    return fingerprint(t) if t is not None else None


def _unwrapped_tensors(how: str, module: Any) -> list[tuple[str, str, Any]]:
    """(name, role, tensor) of what ``how`` is about to parallelize: the module's parameters and buffers (meta ones
    too: their structure is compared), less what an earlier fully_shard call already sharded (compared there)."""
    import torch.nn as nn

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()
    from distcheck.rank.checks.fsdp1 import is_fsdp1

    if not isinstance(module, nn.Module):
        return []
    # FSDP2 modules and FSDP1 units wrapped by an earlier call hold shards now (compared at that call)
    sharded = {name for name, m in module.named_modules() if m is not module and (
        FSDPModule and isinstance(m, FSDPModule) or is_fsdp1(m))}
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ()) if how == "ddp" else set()

    def skip(name: str, t: Any) -> bool:
        if t is None or name in ignored:
            return True
        return any(name.startswith(s + ".") for s in sharded)

    out = [(n, "parameter", p) for n, p in module.named_parameters() if not skip(n, p)]
    out += [(n, "buffer", b) for n, b in module.named_buffers() if not skip(n, b)]
    return out
