"""Pure placement analysis (no process group): placement rows, the compact table, and FSDP2/FSDP1/TP coverage rules.

The rows come from distcheck.rank.checks.placement.describe_model; everything here works on them alone, so the rules are
unit-tested on hand-made rows as well as on real FSDP2/FSDP1/TP models. An FSDP1 row is one original parameter of a
unit's flat parameter (rank/checks/fsdp1.py): its global shape, the elements this rank holds as its local shape, and
what every rank of the unit's shard group holds (``flat_shard``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distcheck.analysis.flat_shards import holdings_text
from distcheck.contract.findings import Finding, Note, format_names
from distcheck.contract.site import file_line

# Styles whose job is to leave parameters replicated (norms under SequenceParallel) or that hold none.
REPLICATING_STYLES = frozenset({"SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
                                "PrepareModuleInputOutput", "NoParallel", "ReplicateParallel"})
# Styles that shard a module's weight: left Replicate, that weight is "a TP module left replicated".
WEIGHT_SHARDING_STYLES = frozenset({"ColwiseParallel", "RowwiseParallel"})


# The attribute the fully_shard hook (rank/autocheck/patches.py) sets on each parameter passed as ignored_params:
# FSDP2 keeps no record of them, and they are unmanaged on purpose.
FSDP_IGNORED = "_distcheck_fsdp_ignored"


@dataclass
class PlacementRow:
    name: str
    role: str  # "parameter" | "buffer"
    cls: str  # "Tensor" | "DTensor" | other tensor subclass name
    dtype: str
    mesh_shape: list[int] | None
    mesh_dim_names: list[str] | None
    mesh_ranks: str | None  # the ranks of the tensor's mesh (this rank's view), compact
    placements: list[str] | None
    global_shape: list[int]
    local_shape: list[int]
    bytes_per_rank: int
    requires_grad: bool
    module: str  # fqn of the module that owns it ("" for the root)
    module_type: str
    fsdp: str | None = None  # fqn of the fully_shard module that manages it ("<root>" for the root)
    tp_style: str | None = None  # parallel style applied to the owning module
    ddp: bool = False
    fsdp_ignored: bool = False  # fully_shard(ignored_params=...), FSDP1's ignored_modules: unmanaged on purpose
    fsdp1: str | None = None  # the sharding strategy of the FSDP1 unit that manages it (``fsdp`` names the unit)
    flat_shard: list[int] | None = None  # FSDP1: elements of it each rank of the unit's shard group holds
    file: str | None = None  # where the user's code defines it, when it is user code
    line: int | None = None

    @property
    def mesh_key(self) -> tuple:
        return (tuple(self.mesh_shape or ()), tuple(self.mesh_dim_names or ()), self.mesh_ranks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlacementRow:
        return cls(**data)


def short_placement(p: str) -> str:
    """``Shard(dim=0)`` -> ``S(0)``, ``Replicate()`` -> ``R``, ``_StridedShard(dim=0, sf=2)`` -> ``SS(0,sf=2)``."""
    p = p.replace(" ", "")
    if p.startswith("Shard(dim="):
        return f"S({p[len('Shard(dim='):-1]})"
    if p.startswith("_StridedShard(dim="):
        return f"SS({p[len('_StridedShard(dim='):-1]})"
    if p == "Replicate()":
        return "R"
    if p.startswith("Partial("):
        return "P(" + p[len("Partial("):-1].replace("reduce_op=", "") + ")"
    return p


def is_shard(p: str) -> bool:
    """Shard or _StridedShard, in repr (``Shard(dim=0)``) or str (``S(0)``) form."""
    return "Shard(" in p or p.startswith(("S(", "SS(", "_S("))


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def mesh_label(row: PlacementRow) -> str:
    if row.mesh_shape is None:
        return "-"
    if row.mesh_dim_names:
        return "(" + ",".join(f"{n}={s}" for n, s in zip(row.mesh_dim_names, row.mesh_shape)) + ")"
    return "(" + ",".join(map(str, row.mesh_shape)) + ")"


def manager(row: PlacementRow) -> str:
    if row.fsdp1 is not None:
        return f"fsdp1:{row.fsdp} {row.fsdp1}"
    if row.fsdp is not None:
        return f"fsdp:{row.fsdp}"
    if row.fsdp_ignored:
        return "ignored"
    if row.ddp:
        return "ddp"
    if row.tp_style:
        return f"tp:{row.tp_style}"
    return "-"


def render_placement_table(rows: list[PlacementRow]) -> str:
    """The compact table for report.txt; report.json carries the full rows."""
    header = ("name", "kind", "class", "mesh", "placements", "global", "local", "bytes/rank", "managed by")
    body = []
    for r in rows:
        placements = ",".join(short_placement(p) for p in r.placements) if r.placements else flat_label(r)
        body.append((r.name, "param" if r.role == "parameter" else "buffer", r.cls, mesh_label(r), placements,
                     "x".join(map(str, r.global_shape)) or "()", "x".join(map(str, r.local_shape)) or "()",
                     human_bytes(r.bytes_per_rank), manager(r)))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    params = [r for r in rows if r.role == "parameter"]
    fsdp2 = [r for r in params if r.fsdp is not None and r.fsdp1 is None]
    fsdp1 = [r for r in params if r.fsdp1 is not None]
    managed = f"{len(fsdp2)} managed by FSDP2"
    if fsdp2:
        managed += f" (fully_shard on: {', '.join(sorted({r.fsdp for r in fsdp2}))})"
    if fsdp1:
        managed = (f"{len(fsdp1)} managed by FSDP1 (units: {', '.join(dict.fromkeys(r.fsdp for r in fsdp1))}; "
                   f"{', '.join(sorted({r.fsdp1 for r in fsdp1}))})" + (f"; {managed}" if fsdp2 else ""))
    ignored = sum(r.fsdp_ignored for r in params)
    lines.append(f"{len(params)} parameters, {human_bytes(sum(r.bytes_per_rank for r in params))} per rank; "
                 f"{managed}" + (f"; {ignored} ignored by FSDP" if ignored else "")
                 + f"; {sum(r.cls == 'DTensor' for r in params)} DTensor, "
                 f"{sum(r.cls != 'DTensor' for r in params)} plain")
    return "\n".join(lines) + "\n"


def flat_label(row: PlacementRow) -> str:
    """The placements cell of an FSDP1 row: ``flat 161|95`` (the elements ranks 0, 1 of the shard group hold),
    ``R`` where every rank holds all of it (NO_SHARD), ``R,flat ...`` under HYBRID_SHARD; ``-`` for other rows."""
    if row.flat_shard is None:
        return "-"
    flat = "R" if len(row.flat_shard) == 1 else f"flat {holdings_text(row.flat_shard)}"
    return f"R,{flat}" if row.mesh_dim_names and row.mesh_dim_names[0] == "replicate" and flat != "R" else flat


def _where(row: PlacementRow) -> str:
    return f" (defined at {file_line(row.file, row.line)})" if row.file and row.line else ""


def _size(row: PlacementRow) -> str:
    return f"{list(row.global_shape)} {row.dtype.replace('torch.', '')}, {human_bytes(_global_bytes(row))}"


def _global_bytes(row: PlacementRow) -> int:
    local = 1
    for s in row.local_shape:
        local *= s
    glob = 1
    for s in row.global_shape:
        glob *= s
    return row.bytes_per_rank * glob // local if local else row.bytes_per_rank


def _nearest(fqn: str, containers: list[str]) -> str | None:
    """The deepest fully_shard module (or FSDP1 unit) fqn that contains module ``fqn`` ("<root>" contains
    everything)."""
    best = None
    for c in containers:
        if c == "<root>" or fqn == c or fqn.startswith(c + "."):
            if best is None or best == "<root>" or (c != "<root>" and len(c) > len(best)):
                best = c
    return best


def _finding(row: PlacementRow, ranks: list[int], reason: str, message: str, **extra: Any) -> Finding:
    detail: dict[str, Any] = {"param": row.name, "reason": reason, "shape": row.global_shape,
                              "dtype": row.dtype, "bytes": _global_bytes(row), "class": row.cls,
                              "placements": row.placements, "mesh": mesh_label(row), "module": row.module,
                              "module_type": row.module_type}
    if row.file and row.line:
        detail["file"] = row.file
        detail["line"] = row.line
    detail.update(extra)
    return Finding("uncovered_param", ranks, message, detail)


def _consequence(row: PlacementRow, scope: str) -> str:
    if not row.requires_grad:
        return "every rank holds all of it (it is frozen, so it cannot drift, but it is not sharded)"
    if row.cls == "DTensor":
        return (f"its gradient is reduced only over its own mesh {mesh_label(row)}, never across {scope}: "
                f"it will drift apart")
    return f"its gradient is never reduced across {scope}: it will drift apart on every rank"


def coverage_findings(rows: list[PlacementRow], fsdp_modules: list[str], ranks: list[int]) -> list[Finding]:
    """Parameters left out of FSDP2/FSDP1/TP sharding or placed unexpectedly: one finding per cause, naming every
    parameter it covers (``detail.params``; ``detail.param`` is the first). ``fsdp_modules``: the fully_shard
    modules' or FSDP1 units' names ("<root>" for the model)."""
    params = [r for r in rows if r.role == "parameter"]
    out: dict[str, Finding] = {}
    # A TP style whose module kept its weight replicated (on every mesh dim FSDP does not shard).
    by_module: dict[str, list[PlacementRow]] = {}
    for r in params:
        if r.tp_style and r.tp_style not in REPLICATING_STYLES:
            by_module.setdefault(r.module, []).append(r)
    for module, mrows in by_module.items():
        def replicated(r: PlacementRow) -> bool:
            if r.placements is None:
                return True
            tp_dims = r.placements[1:] if r.fsdp is not None and len(r.placements) > 1 else r.placements
            return not any(is_shard(p) for p in tp_dims)

        style = mrows[0].tp_style
        if style in WEIGHT_SHARDING_STYLES:
            targets = [r for r in mrows if r.name.rsplit(".", 1)[-1] == "weight" and replicated(r)]
        else:
            targets = mrows if all(replicated(r) for r in mrows) else []
        for r in targets:
            out[r.name] = _finding(
                r, ranks, "tp_replicated",
                f"{r.name} {_size(r)}: module '{module}' has {style} but this parameter stayed replicated "
                f"({','.join(r.placements or ['plain tensor'])}){_where(r)}: every tensor-parallel rank holds and "
                f"computes all of it, so the module is not parallelized at all",
                style=style)
    if fsdp_modules:
        fsdp1 = any(r.fsdp1 for r in params)
        label, call, unit = ("FSDP1", "FullyShardedDataParallel", "FSDP1 unit") if fsdp1 else \
            ("FSDP2", "fully_shard", "fully_shard module")
        for r in params:
            # ignored_params (FSDP2) and ignored_modules (FSDP1) are the documented ways to leave a parameter out
            # (its user reduces its gradient; the replicas' drift check sees it if not): not a coverage gap
            if r.name in out or r.fsdp is not None or r.ddp or r.fsdp_ignored:
                continue
            anc = _nearest(r.module, fsdp_modules)
            if anc is not None:
                why = (f"it sits under {unit} '{anc}' but {label} does not manage it: it was added "
                       f"after {call}")
                reason = "added_after_fully_shard"
            else:
                path = f"'{r.module}' nor the root module has" if r.module else "the root module has"
                why = (f"neither {path} {call}; wrap the root module with {call}(model) after its "
                       f"blocks") if r.module else (f"{path} no {call}; wrap it with {call}(model) "
                                                     f"after its blocks")
                reason = "not_wrapped"
            out[r.name] = _finding(
                r, ranks, reason,
                f"{r.name} {_size(r)} is not managed by {label} while the rest of the model is{_where(r)}: {why}; "
                f"{_consequence(r, 'the data-parallel ranks')}",
                fsdp_ancestor=anc)
    # Under tensor parallelism alone, plain replicated parameters outside any parallel style (norms, embedding,
    # head in PyTorch's TP recipe) are legal: their inputs are replicated, so their gradients agree. Actual drift
    # is caught by value (replicated_state / check_consistent), not flagged here by type.
    # DTensors on another mesh than the model's are legal while nothing stacks them: mixed_mesh_notes (a warning).
    return _grouped([out[r.name] for r in params if r.name in out], {r.name: r for r in params})


def _other_mesh(params: list[PlacementRow]) -> tuple[list[PlacementRow], PlacementRow | None, int, int]:
    """DTensor parameters on another mesh than the model's (the mesh most of them live on): (them, one row on the
    main mesh, how many live there, how many DTensors in all)."""
    dtensor = [r for r in params if r.cls == "DTensor"]
    if not dtensor:
        return [], None, 0, 0
    counts: dict[tuple, int] = {}
    for r in dtensor:
        counts[r.mesh_key] = counts.get(r.mesh_key, 0) + 1
    main_key = max(counts.items(), key=lambda kv: kv[1])[0]
    if counts[main_key] * 2 <= len(dtensor):
        return [], None, 0, len(dtensor)
    main = next(r for r in dtensor if r.mesh_key == main_key)
    return [r for r in dtensor if r.mesh_key != main_key], main, counts[main_key], len(dtensor)


def mixed_mesh_notes(rows: list[PlacementRow], ranks: list[int]) -> list[Note]:
    """Parameters on another mesh than the rest of a model that is otherwise sharded correctly (a last Linear left
    out of the TP plan, FSDP2 on dp only): nothing is wrong while the script trains, so it is a warning, not a
    finding. It says what breaks if the script adds an operation that rejects mixed meshes, and the fix. Such an
    operation, when it does run, raises and is its own finding (analysis/torch_errors.py: ``mixed_meshes``)."""
    params = [r for r in rows if r.role == "parameter"]
    others, main, on_main, total = _other_mesh(params)
    by_mesh: dict[tuple, list[PlacementRow]] = {}
    for r in others:
        by_mesh.setdefault(r.mesh_key, []).append(r)
    notes = []
    for group in by_mesh.values():
        first = group[0]
        names = [r.name for r in group]
        sites = list(dict.fromkeys(file_line(r.file, r.line) for r in group if r.file and r.line))
        where = f" (defined at {', '.join(sites[:SHOWN])})" if sites else ""
        message = (f"{len(names)} parameter{'s' if len(names) != 1 else ''} live{'s' if len(names) == 1 else ''} "
                   f"on mesh {mesh_label(first)} ranks {first.mesh_ranks} while {on_main} of the model's {total} "
                   f"DTensor parameters live on {mesh_label(main)} ranks {main.mesh_ranks}: "
                   f"{format_names(names, SHOWN)}{where}. Training is correct as it is (each gradient is reduced "
                   f"over its own mesh), but torch.nn.utils.clip_grad_norm_ and foreach/fused optimizers stack all "
                   f"gradients and raise on mixed meshes. If you add one, put these parameters on the model's mesh "
                   f"(a plan entry such as ColwiseParallel(output_layouts=Replicate()), or distribute_tensor(..., "
                   f"{mesh_label(main)} mesh, [Replicate()])), or clip per mesh.")
        notes.append(Note("mixed_meshes", ranks, message,
                          {"params": names, "count": len(names), "mesh": mesh_label(first),
                           "mesh_ranks": first.mesh_ranks, "expected_mesh": mesh_label(main),
                           "expected_mesh_ranks": main.mesh_ranks,
                           "tensors": [{"param": r.name, "file": r.file, "line": r.line} for r in group]}))
    return notes


SHOWN = 3  # parameter names a grouped message spells out; detail.params lists them all


def _group_key(f: Finding) -> tuple:
    """Findings with equal keys have one cause (and one fix): the root left unwrapped, one fully_shard module that
    missed parameters added later, one TP module, one stray mesh."""
    d = f.detail
    return (d["reason"], d.get("fsdp_ancestor"), d.get("style") and d.get("module"), d.get("expected_mesh"),
            d.get("mesh") if d["reason"] == "other_mesh" else None)


def _grouped(found: list[Finding], rows: dict[str, PlacementRow]) -> list[Finding]:
    """One finding per cause: the first parameter's finding, widened to name them all (``detail.params``)."""
    groups: dict[tuple, list[Finding]] = {}
    for f in found:
        groups.setdefault(_group_key(f), []).append(f)
    out = []
    for members in groups.values():
        first = members[0]
        if len(members) == 1:
            first.detail.update(params=[first.detail["param"]], count=1)
            out.append(first)
            continue
        names = [f.detail["param"] for f in members]
        member_rows = [rows[n] for n in names]
        total = sum(_global_bytes(r) for r in member_rows)
        shown = format_names(names, SHOWN)
        sites = []
        for r in member_rows:
            site = file_line(r.file, r.line)
            if site and site not in sites:
                sites.append(site)
        where = f" (defined at {', '.join(sites[:SHOWN])})" if sites else ""
        # The single finding's message after "<name> <size>": the cause and the consequence, which the group shares.
        cause = first.message.split(_where(member_rows[0]) + ": ", 1)[-1] if _where(member_rows[0]) else \
            first.message.split(": ", 1)[-1]
        label, call = ("FSDP1", "FullyShardedDataParallel") if any(r.fsdp1 for r in rows.values()) else \
            ("FSDP2", "fully_shard")
        if first.detail["reason"] == "not_wrapped":
            modules = [m for m in dict.fromkeys(r.module for r in member_rows) if m]
            cause = ((f"no {call} covers {', '.join(repr(m) for m in modules[:SHOWN])}" + (" or " if modules
                      else "") + "the root module") if modules else f"the root module has no {call}") + \
                f"; wrap the root module with {call}(model) after its blocks; " + \
                _consequence(member_rows[0], "the data-parallel ranks")
        for one, many in (("its gradient is never", "their gradients are never"), ("it will drift", "they will drift"),
                          ("its gradient is reduced", "their gradients are reduced"),
                          ("every rank holds all of it (it is", "every rank holds all of them (they are")):
            cause = cause.replace(one, many)
        lead = {"not_wrapped": f"are not managed by {label} while the rest of the model is",
                "added_after_fully_shard": f"are not managed by {label} while the rest of the model is",
                "tp_replicated": f"of module '{first.detail['module']}' stayed replicated",
                "other_mesh": f"live on mesh {first.detail['mesh']}"}.get(first.detail["reason"], "")
        message = f"{len(names)} parameters, {human_bytes(total)} in all, {lead}: {shown}{where}: {cause}"
        detail = dict(first.detail, params=names, count=len(names),
                      tensors=[{"param": r.name, "shape": r.global_shape, "dtype": r.dtype,
                                "bytes": _global_bytes(r), "module": r.module, "file": r.file, "line": r.line}
                               for r in member_rows])
        out.append(Finding("uncovered_param", first.ranks, message, detail))
    return out


def merge_rank_findings(per_rank: list[list[dict[str, Any]]], ranks: list[int]) -> list[Finding]:
    """Union the ranks of identical coverage findings computed independently on each rank."""
    merged: dict[tuple, Finding] = {}
    for rank, found in zip(ranks, per_rank):
        for data in found:
            f = Finding.from_json(data)
            key = (f.kind, f.detail.get("param"), f.detail.get("reason"))
            if key in merged:
                merged[key].ranks = sorted(set(merged[key].ranks) | {rank})
            else:
                f.ranks = [rank]
                merged[key] = f
    return list(merged.values())
