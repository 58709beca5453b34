"""Pure device-mesh arithmetic and checks (no process group): layouts, groups, coordinates, shard sizes.

A mesh of shape (s0, s1, ...) over the world lays ranks 0..prod-1 out row-major, exactly like
``init_device_mesh``: rank r has coordinate ``unravel(r)``, and its group on dim d is every rank that shares its
other coordinates. Everything here is integer arithmetic on tensors, so a 16384-rank mesh costs milliseconds;
distcheck.rank.checks.mesh cross-checks the same answers against torch's own DeviceMesh on the fake process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from distcheck.contract.findings import Finding, format_ranks

# How distcheck reads mesh dim names: the dims a model's tensors are sharded over, and what gets sharded.
TP_NAMES = frozenset({"tp", "tensor", "tensor_parallel", "mp", "model"})
SHARD_NAMES = frozenset({"dp", "fsdp", "dp_shard", "shard", "dp_shard_cp", "data"})
REPLICATE_NAMES = frozenset({"dp_replicate", "ddp", "replicate", "hsdp", "dp_rep"})
PP_NAMES = frozenset({"pp", "pipeline", "stage"})
CP_NAMES = frozenset({"cp", "context", "context_parallel", "sp"})
EP_NAMES = frozenset({"ep", "expert", "expert_parallel"})

HEAD_ATTRS = ("num_heads", "heads", "n_heads", "n_head", "nhead", "num_attention_heads", "num_key_value_heads",
              "n_kv_heads", "num_kv_heads")
HIDDEN_ATTRS = ("hidden_size", "hidden_dim", "d_model", "n_embd", "embed_dim", "dim", "model_dim")
EXPERT_ATTRS = ("num_experts", "n_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class MeshSpec:
    world_size: int
    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def product(self) -> int:
        return math.prod(self.shape)

    def dim_name(self, d: int) -> str:
        return self.names[d] if self.names else f"dim{d}"

    def label(self) -> str:
        """``(dp=64, tp=8, pp=8)`` or ``(64, 8, 8)``."""
        if self.names:
            return "(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape)) + ")"
        return "(" + ", ".join(map(str, self.shape)) + ")"


def resolve_shape(shape: Sequence[int], world_size: int) -> tuple[tuple[int, ...], list[Finding]]:
    """Fill in the one ``-1`` dim (torchtitan style: world_size divided by the others).

    Returns the shape and a mesh_mismatch finding when ``-1`` cannot be inferred because the world size does not
    divide by the other dims (then the -1 dim is set to 0 so callers stop there).
    """
    shape = list(shape)
    text = ",".join(map(str, shape))
    findings: list[Finding] = []
    if -1 in shape:
        i = shape.index(-1)
        rest = math.prod(s for s in shape if s != -1)
        if world_size % rest:
            findings.append(Finding(
                "mesh_mismatch", list(range(world_size)),
                f"mesh shape {text}: world size {world_size} is not divisible by {rest} (the product of the other "
                f"dims), so dim {i} cannot be inferred: choose dims whose product divides {world_size}",
                {"shape": shape, "world_size": world_size, "other_dims_product": rest}))
            shape[i] = 0
        else:
            shape[i] = world_size // rest
    return tuple(shape), findings


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def coordinate(shape: Sequence[int], rank: int) -> tuple[int, ...] | None:
    """The rank's coordinate in a row-major mesh, or None when the mesh does not contain it (torch: same)."""
    if rank < 0 or rank >= math.prod(shape):
        return None
    out = []
    for s in strides(shape):
        out.append(rank // s)
        rank %= s
    return tuple(out)


def group_of(shape: Sequence[int], dim: int, rank: int) -> list[int] | None:
    """The ranks of ``rank``'s process group on mesh dim ``dim`` (None when the rank is not in the mesh)."""
    coord = coordinate(shape, rank)
    if coord is None:
        return None
    stride = strides(shape)[dim]
    base = rank - coord[dim] * stride
    return [base + k * stride for k in range(shape[dim])]


def dim_groups(shape: Sequence[int], dim: int) -> torch.Tensor:
    """All groups of mesh dim ``dim`` as a (num_groups, shape[dim]) tensor, ordered by their lowest rank."""
    mesh = torch.arange(math.prod(shape), dtype=torch.int64).reshape(tuple(shape))
    return mesh.movedim(dim, -1).reshape(-1, shape[dim])


@dataclass
class DimReport:
    dim: int
    name: str
    size: int
    stride: int
    num_groups: int
    groups: list[list[int]] = field(default_factory=list)

    def summary(self, examples: int = 2) -> str:
        def short(g: list[int]) -> str:
            if len(g) <= 6:
                return "[" + ", ".join(map(str, g)) + "]"
            return f"[{g[0]}, {g[1]}, {g[2]}, ..., {g[-1]}]"

        shown = ", ".join(short(g) for g in self.groups[:examples])
        more = f", ... ({self.num_groups} groups)" if self.num_groups > examples else ""
        return (f"{self.name:<8} size {self.size:<6} {self.num_groups:>6} groups  stride {self.stride:<6} "
                f"{shown}{more}")


@dataclass
class MeshPlan:
    spec: MeshSpec
    dims: list[DimReport]
    uncovered: tuple[int, int] | None  # [start, end) of world ranks with no coordinate

    def to_json(self, max_ranks: int = 4096) -> dict:
        """Every group of every dim up to ``max_ranks`` ranks; above, the first 8 per dim (the rest follow from
        ``stride``: rank r's group on dim d is r's base plus k*stride), so report.json stays small."""
        full = self.spec.product <= max_ranks
        return {"world_size": self.spec.world_size, "shape": list(self.spec.shape),
                "names": list(self.spec.names) if self.spec.names else None, "product": self.spec.product,
                "ranks_without_coordinate": list(self.uncovered) if self.uncovered else None,
                "dims": [{"dim": d.dim, "name": d.name, "size": d.size, "stride": d.stride,
                          "num_groups": d.num_groups, "groups": d.groups if full else d.groups[:8],
                          "groups_truncated": not full} for d in self.dims]}


def plan_mesh(spec: MeshSpec) -> MeshPlan:
    """Every dim's groups for a mesh that fits in the world; callers check ``mesh_findings`` first."""
    dims: list[DimReport] = []
    if spec.product <= spec.world_size and spec.product > 0:
        st = strides(spec.shape)
        for d, size in enumerate(spec.shape):
            groups = dim_groups(spec.shape, d).tolist()
            dims.append(DimReport(d, spec.dim_name(d), size, st[d], len(groups), groups))
    uncovered = (spec.product, spec.world_size) if 0 < spec.product < spec.world_size else None
    return MeshPlan(spec, dims, uncovered)


def mesh_findings(spec: MeshSpec) -> list[Finding]:
    """A mesh that needs more ranks than the world has (torch raises), or fewer (torch silently leaves ranks out)."""
    world, product = spec.world_size, spec.product
    if product == 0:
        return []  # an uninferable -1 dim, already reported by parse_shape
    dims = "*".join(map(str, spec.shape))
    if product > world:
        return [Finding(
            "mesh_mismatch", list(range(world)),
            f"mesh {spec.label()} needs {dims}={product} ranks but the world has {world}: init_device_mesh raises "
            f"on every rank; make the product of the dims equal the world size",
            {"shape": list(spec.shape), "names": list(spec.names or []), "world_size": world, "product": product})]
    if product < world:
        missing = list(range(product, world))
        return [Finding(
            "mesh_mismatch", missing,
            f"mesh {spec.label()} covers {dims}={product} ranks but the world has {world}: "
            f"{format_ranks(missing)} get no coordinate; torch raises nothing, and their DTensor shards are "
            f"0-element tensors while they still join collectives; make the product of the dims equal {world}",
            {"shape": list(spec.shape), "names": list(spec.names or []), "world_size": world, "product": product,
             "ranks_without_coordinate": [product, world]})]
    return []


def shard_sizes(n: int, k: int) -> list[int]:
    """Sizes of the k shards of a length-n dim under Shard (torch.chunk semantics: ceil-sized, then empty)."""
    if k <= 0:
        return []
    step = -(-n // k) if n else 0
    return [max(0, min(step, n - i * step)) for i in range(k)]


@dataclass(frozen=True)
class ParamShape:
    """What the model check needs to know about one parameter (built from a meta-device model)."""

    name: str
    shape: tuple[int, ...]
    module_type: str  # "Linear", "Embedding", ...


@dataclass(frozen=True)
class ModuleAttr:
    module: str
    attr: str
    value: int


@dataclass
class ModelCheck:
    findings: list[Finding]
    notes: list[str]
    # name -> {"placements": [...], "shards": {dim name: [min, max]}} for report.json
    params: dict[str, dict] = field(default_factory=dict)


def dim_role(name: str) -> str:
    n = name.lower()
    for role, names in (("tp", TP_NAMES), ("shard", SHARD_NAMES), ("replicate", REPLICATE_NAMES),
                        ("pp", PP_NAMES), ("cp", CP_NAMES), ("ep", EP_NAMES)):
        if n in names:
            return role
    return "unknown"


def tp_placement(p: ParamShape, tp: int) -> tuple[int | None, str]:
    """Which tensor dim TP shards for this parameter, the way Colwise/RowwiseParallel would, and why.

    Colwise shards a Linear weight's dim 0 (out features) and its bias; Rowwise shards dim 1 (in features) and
    replicates the bias. We take whichever divides evenly (Colwise first), as a TP plan author would.
    None means replicated (norms, scalars).
    """
    if p.module_type in ("Linear", "Embedding") and len(p.shape) == 2:
        if p.shape[0] % tp == 0:
            return 0, "colwise"
        if p.shape[1] % tp == 0:
            return 1, "rowwise"
        return 0, "uneven"
    if p.module_type == "Linear" and len(p.shape) == 1:
        return (0, "colwise") if p.shape[0] % tp == 0 else (None, "replicated")
    return None, "replicated"


def model_findings(spec: MeshSpec, params: Iterable[ParamShape], attrs: Iterable[ModuleAttr],
                   layer_counts: dict[str, int]) -> ModelCheck:
    """Do the model's sharded dims divide by the mesh dims? Uneven TP shards, heads, experts, pipeline stages.

    FSDP2 pads uneven dim-0 shards itself (correct, only memory is lost), so uneven or empty FSDP shards are
    notes, not findings; TP has no such padding for heads and reshapes, so an uneven TP dim is a finding.
    """
    findings: list[Finding] = []
    notes: list[str] = []
    per_param: dict[str, dict] = {}
    roles = {spec.dim_name(d): (dim_role(spec.dim_name(d)), spec.shape[d]) for d in range(spec.ndim)}
    all_ranks = list(range(min(spec.product, spec.world_size)))
    params = list(params)
    attrs = list(attrs)
    for dim_name, (role, size) in roles.items():
        if size <= 1:
            continue
        if role == "tp":
            # One finding per (heads or hidden size, value): a config and every layer repeat the same number.
            grouped: dict[tuple[str, int], list[str]] = {}
            for a in attrs:
                if a.attr in HEAD_ATTRS + HIDDEN_ATTRS and a.value % size:
                    what = "heads" if a.attr in HEAD_ATTRS else "hidden size"
                    grouped.setdefault((what, a.value), []).append(f"{a.module}.{a.attr}")
            for (what, value), where in grouped.items():
                shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
                findings.append(Finding(
                    "mesh_mismatch", all_ranks,
                    f"{what} {value} ({shown}) does not divide by {dim_name}={size}: tensor parallelism splits "
                    f"the {what} across the {dim_name} ranks, so ranks get unequal {what} (or none); pick a "
                    f"{dim_name} size that divides {value}",
                    {"what": what, "value": value, "where": where, "mesh_dim": dim_name, "mesh_dim_size": size}))
            for p in params:
                tdim, style = tp_placement(p, size)
                if style == "uneven":
                    sizes = [shard_sizes(p.shape[0], size), shard_sizes(p.shape[1], size)]
                    findings.append(Finding(
                        "mesh_mismatch", all_ranks,
                        f"{p.name} {list(p.shape)} ({p.module_type}) divides by {dim_name}={size} on neither dim: "
                        f"colwise shards would be {_size_range(sizes[0])} rows, rowwise {_size_range(sizes[1])} "
                        f"columns per rank; pick a {dim_name} size that divides {p.shape[0]} or {p.shape[1]}",
                        {"param": p.name, "shape": list(p.shape), "mesh_dim": dim_name, "mesh_dim_size": size}))
                if tdim is not None:
                    per_param.setdefault(p.name, {}).setdefault("shards", {})[dim_name] = {
                        "tensor_dim": tdim, "style": style, "sizes": _size_range(shard_sizes(p.shape[tdim], size))}
        elif role == "shard":
            uneven = empty = 0
            example = ""
            for p in params:
                if not p.shape:
                    continue
                # FSDP2 shards dim 0 of the TP-local tensor when TP has already split dim 0.
                length = p.shape[0]
                for other, (orole, osize) in roles.items():
                    if orole == "tp" and osize > 1 and tp_placement(p, osize)[0] == 0:
                        length = max(shard_sizes(length, osize))
                sizes = shard_sizes(length, size)
                per_param.setdefault(p.name, {}).setdefault("shards", {})[dim_name] = {
                    "tensor_dim": 0, "style": "fsdp", "sizes": _size_range(sizes)}
                if 0 in sizes:
                    empty += 1
                    if not example:
                        first = sizes.index(0)
                        example = (f" (e.g. {p.name} {list(p.shape)}: {dim_name} coordinates {first}-{size - 1} "
                                   f"hold 0 elements)")
                elif len(set(sizes)) > 1:
                    uneven += 1
            if uneven or empty:
                notes.append(f"FSDP2 shards dim 0 over {dim_name}={size}: {uneven} parameter(s) shard unevenly and "
                             f"{empty} leave ranks an empty shard{example}; FSDP2 pads these itself (memory only)")
        elif role == "ep":
            for a in attrs:
                if a.attr in EXPERT_ATTRS and a.value % size:
                    findings.append(Finding(
                        "mesh_mismatch", all_ranks,
                        f"{a.module}.{a.attr}={a.value} does not divide by {dim_name}={size}: expert parallelism "
                        f"places num_experts/{dim_name} experts on each rank; pick an {dim_name} size that divides "
                        f"{a.value}",
                        {"module": a.module, "attr": a.attr, "value": a.value, "mesh_dim": dim_name,
                         "mesh_dim_size": size}))
        elif role == "pp":
            for container, n in layer_counts.items():
                if n < size:
                    findings.append(Finding(
                        "mesh_mismatch", all_ranks,
                        f"{container} has {n} layers but {dim_name}={size} pipeline stages: {size - n} stage(s) "
                        f"get no layer; use at most {n} stages",
                        {"container": container, "layers": n, "mesh_dim": dim_name, "mesh_dim_size": size}))
                elif n % size:
                    notes.append(f"{container}: {n} layers over {dim_name}={size} stages is uneven "
                                 f"({n // size}-{n // size + 1} per stage): the slowest stage sets the pace")
        elif role == "cp":
            notes.append(f"{dim_name}={size}: context parallelism splits the sequence, a property of the data: "
                         f"check that seq_len divides by {2 * size} (load-balanced CP) yourself")
        elif role == "unknown":
            notes.append(f"mesh dim {dim_name!r} has no known role (tp, dp/fsdp, dp_replicate, pp, cp, ep): "
                         f"its model dims are not checked")
    return ModelCheck(findings, notes, per_param)


def _size_range(sizes: list[int]) -> list[int]:
    return [min(sizes), max(sizes)] if sizes else [0, 0]


@dataclass
class LiveMeshView:
    """One rank's view of a live DeviceMesh, as exchanged over the side channel."""

    rank: int
    world_size: int
    shape: tuple[int, ...]
    names: tuple[str, ...] | None
    mesh_ranks: tuple[int, ...]  # the mesh tensor flattened row-major
    coordinate: tuple[int, ...] | None
    groups: list[list[int] | None]  # this rank's process group members on each dim (None: no group)


def expected_group(view: LiveMeshView, dim: int) -> list[int] | None:
    """The group the mesh tensor says this rank belongs to on ``dim``."""
    if view.coordinate is None:
        return None
    mesh = torch.tensor(view.mesh_ranks, dtype=torch.int64).reshape(view.shape)
    index = list(view.coordinate)
    index[dim] = slice(None)
    return sorted(mesh[tuple(index)].tolist())


def live_mesh_findings(views: dict[int, LiveMeshView], label: str = "device mesh") -> list[Finding]:
    """Cross-rank checks of one mesh: same layout and names everywhere, covers the world, consistent groups."""
    findings: list[Finding] = []
    ranks = sorted(views)
    if not ranks:
        return findings
    layouts: dict[tuple, list[int]] = {}
    for r in ranks:
        v = views[r]
        layouts.setdefault((v.shape, v.names, v.mesh_ranks), []).append(r)
    if len(layouts) > 1:
        ordered = sorted(layouts.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        (ref_layout, ref_ranks) = ordered[0]
        for layout, odd in ordered[1:]:
            findings.append(Finding(
                "mesh_mismatch", odd,
                f"{label}: {format_ranks(odd)} built shape {list(layout[0])} names {list(layout[1] or [])} but "
                f"{format_ranks(ref_ranks)} built shape {list(ref_layout[0])} names {list(ref_layout[1] or [])}: "
                f"every rank must call init_device_mesh with the same arguments (else collectives hang)",
                {"shape": list(layout[0]), "names": list(layout[1] or []), "reference_ranks": ref_ranks,
                 "reference_shape": list(ref_layout[0]), "reference_names": list(ref_layout[1] or [])}))
        return findings
    v0 = views[ranks[0]]
    world = v0.world_size
    in_mesh = set(v0.mesh_ranks)
    missing = sorted(set(range(world)) - in_mesh)
    if missing:
        findings.append(Finding(
            "mesh_mismatch", missing,
            f"{label} {list(v0.shape)} covers {len(in_mesh)} of {world} ranks: {format_ranks(missing)} have no "
            f"coordinate and hold 0-element shards; make the product of the dims equal the world size",
            {"shape": list(v0.shape), "names": list(v0.names or []), "world_size": world,
             "ranks_without_coordinate": missing}))
    if len(set(v0.mesh_ranks)) != len(v0.mesh_ranks):
        findings.append(Finding("mesh_mismatch", ranks, f"{label} lists a rank more than once: {list(v0.mesh_ranks)}",
                                {"mesh_ranks": list(v0.mesh_ranks)}))
        return findings
    bad: dict[tuple[int, str], list[int]] = {}
    details: dict[tuple[int, str], dict] = {}
    for d in range(len(v0.shape)):
        name = v0.names[d] if v0.names else f"dim{d}"
        for r in ranks:
            v = views[r]
            if v.coordinate is None:
                continue
            want = expected_group(v, d)
            got = v.groups[d] if d < len(v.groups) else None
            # Layouts are identical on all ranks here, so a rank whose group equals the layout's agrees with every
            # peer; a rank with another group splits (or hangs) every collective on this dim.
            if got is None:
                problem = "no process group"
            elif len(got) != v.shape[d]:
                problem = "a group of the wrong size"
            elif sorted(got) != want:
                problem = "a group whose members differ from the mesh layout"
            else:
                continue
            key = (d, problem)
            bad.setdefault(key, []).append(r)
            details.setdefault(key, {"mesh_dim": name, "expected": want, "got": got, "problem": problem})
    for key, odd in bad.items():
        det = details[key]
        findings.append(Finding(
            "mesh_mismatch", odd,
            f"{label} dim {det['mesh_dim']!r}: {format_ranks(odd)} have {det['problem']} (expected "
            f"{det['expected']}, got {det['got']}): collectives over this dim will hang or mix ranks",
            det))
    return findings
