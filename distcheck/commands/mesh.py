"""Check a device mesh shape against a world size, simulated in one process (no real ranks).

    python -m distcheck mesh --world-size 4096 --shape 64,8,8 --names dp,tp,pp
    python -m distcheck mesh --world-size 1024 --shape 8,8,8 --rank 600
    python -m distcheck mesh --world-size 64 --shape 8,-1 --names dp,tp --model my_pkg.model:build

Reports each mesh dim's process groups and the coordinate and groups of the queried ranks (``--rank``, default the
first and last rank), as computed by distcheck and as torch's own init_device_mesh gives them on the fake process
group. A mesh whose dims do not multiply to the world size is a ``mesh_mismatch`` (exit 1); one dim may be -1
(inferred). ``--model`` builds the model on the meta device and checks that its sharded dims divide by the mesh
dims (Linear/Embedding shapes, heads and hidden size by tp, experts by ep, layers by pp).
Exit codes: 0 ok, 1 mesh_mismatch found, 2 bad input.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from distcheck.analysis.mesh import (MeshSpec, dim_role, mesh_findings, model_findings, plan_mesh,
                                     resolve_shape)
from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding
from distcheck.contract.report import Report, command_line, prepare_report_dir, publish

log = logging.getLogger("distcheck")

# Above this many ranks torch's LocalTensorMode (exact collectives in one process) gets too slow to be useful.
LOCAL_TENSOR_MAX_RANKS = 64


def parse_world_size(value: int | str) -> int:
    try:
        world = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--world-size {value!r} is not an integer: pass the number of ranks, e.g. 4096") from None
    if world < 1:
        raise UsageError(f"--world-size {world} must be at least 1: pass the number of ranks, e.g. 4096")
    return world


def parse_shape(text: str, world_size: int) -> tuple[tuple[int, ...], list[Finding]]:
    """``"64,8,8"`` -> (64, 8, 8). One dim may be ``-1``: world_size divided by the others (torchtitan style).

    Returns the shape and a mesh_mismatch finding when ``-1`` cannot be inferred because the world size does not
    divide by the other dims (then the -1 dim is set to 0 so callers stop there).
    """
    parts = [p.strip() for p in str(text).split(",")]
    if not text or any(not p for p in parts):
        raise UsageError(f"--shape {text!r} is not a comma-separated list of sizes: pass e.g. --shape 8,4,2")
    shape: list[int] = []
    for p in parts:
        try:
            shape.append(int(p))
        except ValueError:
            raise UsageError(f"--shape {text!r}: {p!r} is not an integer: pass e.g. --shape 8,4,2") from None
    if shape.count(-1) > 1:
        raise UsageError(f"--shape {text!r} has more than one -1: at most one dim can be inferred")
    bad = [s for s in shape if s < 1 and s != -1]
    if bad:
        raise UsageError(f"--shape {text!r}: dim size {bad[0]} is not positive: every dim needs at least 1 rank")
    return resolve_shape(shape, world_size)


def parse_names(text: str | None, ndim: int) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(","))
    if any(not n for n in names):
        raise UsageError(f"--names {text!r} has an empty name: pass e.g. --names dp,tp,pp")
    if len(names) != ndim:
        raise UsageError(f"--names {text!r} has {len(names)} names but --shape has {ndim} dims: "
                         f"pass one name per dim")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"--names {text!r} repeats {dup[0]!r}: mesh dim names must be unique")
    return names



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", required=True, help="number of ranks of the job to simulate")
    parser.add_argument("--shape", required=True, help="mesh shape, comma-separated, e.g. 64,8,8 (one dim may be -1)")
    parser.add_argument("--names", default=None, help="mesh dim names, comma-separated, e.g. dp,tp,pp")
    parser.add_argument("--model", default=None, metavar="MODULE_OR_FILE:FACTORY",
                        help="check that the model's sharded dims divide by the mesh dims (needs --names)")
    parser.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                        help="show this rank's coordinate and groups (repeatable; default: first and last rank)")
    parser.add_argument("--report-dir", default=None, help="where report.json/report.txt go")


def load_factory(spec: str):
    try:
        from distcheck.rank.checks.models import load_factory as impl
    except ImportError:  # distcheck.rank.checks.models is the one place --model specs are parsed
        raise UsageError("--model needs distcheck.rank.checks.models, which this installation lacks") from None
    return impl(spec)


def main(args: argparse.Namespace) -> int:
    from distcheck.rank.checks import mesh as meshlib

    t0 = time.perf_counter()
    world = parse_world_size(args.world_size)
    shape, findings = parse_shape(args.shape, world)
    names = parse_names(args.names, len(shape))
    spec = MeshSpec(world, shape, names)
    query = sorted(set(args.rank)) if args.rank else sorted({0, world - 1})
    bad = [r for r in query if not 0 <= r < world]
    if bad:
        raise UsageError(f"--rank {bad[0]} is outside the world (0..{world - 1}): pass a rank below --world-size")
    if args.model and not names:
        raise UsageError("--model needs --names to know which mesh dim is tp, dp/fsdp, pp, ...: pass e.g. "
                         "--names dp,tp")
    factory = load_factory(args.model) if args.model else None
    report_dir = prepare_report_dir(args.report_dir)

    findings += mesh_findings(spec)
    plan = plan_mesh(spec)
    checks = [CheckResult("mesh layout", not findings, time.perf_counter() - t0)]
    sections: dict[str, str] = {}
    data: dict = {"mesh": plan.to_json()}

    lines = [f"world {world}, mesh {spec.label()} = {spec.product} ranks"]
    lines += ["  " + d.summary() for d in plan.dims]
    sections["mesh"] = "\n".join(lines)

    # torch's own answer for the queried ranks (plus the first rank left out, to show what torch does with it).
    t1 = time.perf_counter()
    views = []
    if spec.product > 0:
        probe = list(query)
        if plan.uncovered and plan.uncovered[0] not in probe:
            probe.append(plan.uncovered[0])
        views = [meshlib.simulate_rank(spec, r) for r in sorted(probe)]
    disagree = [v.rank for v in views if not v.agrees]
    checks.append(CheckResult("torch DeviceMesh (fake process group)", not disagree, time.perf_counter() - t1,
                              note=f"torch disagrees with distcheck on ranks {disagree}" if disagree else ""))
    rank_lines = []
    for v in views:
        if v.error:
            rank_lines.append(f"rank {v.rank}: torch raises: {v.error}")
        elif v.coordinate is None:
            rank_lines.append(f"rank {v.rank}: no coordinate (torch raises nothing; get_coordinate() is None)")
        else:
            coord = ", ".join(f"{spec.dim_name(d)}={c}" for d, c in enumerate(v.coordinate))
            groups = "; ".join(f"{spec.dim_name(d)} {_short(g)}" for d, g in enumerate(v.groups))
            rank_lines.append(f"rank {v.rank}: ({coord})  groups: {groups}")
    if rank_lines:
        sections["ranks"] = "\n".join(rank_lines)
    data["ranks"] = [{"rank": v.rank, "coordinate": list(v.coordinate) if v.coordinate else None,
                      "groups": v.groups, "torch_error": v.error or None, "agrees_with_torch": v.agrees}
                     for v in views]

    if factory is not None:
        t2 = time.perf_counter()
        model = meshlib.build_meta_model(factory)
        params, attrs, layers = meshlib.model_shapes(model)
        check = model_findings(spec, params, attrs, layers)
        notes = list(check.notes)
        roles = {dim_role(n) for n in names}
        if "tp" in roles and world <= LOCAL_TENSOR_MAX_RANKS:
            notes.append(f"{world} ranks is small enough for torch's LocalTensorMode to run TP numerics exactly in "
                         f"one process (FSDP2 does not run under it); this command checks shapes only")
        model_data: dict = {"spec": args.model, "params": check.params, "notes": notes}
        if spec.product == world and not findings:
            # torch's own local shapes for the queried ranks, under the placements the analysis chose.
            shard_rows = []
            for r in query:
                empty = []
                for sv in meshlib.simulate_shards(spec, r, params, check):
                    shard_rows.append({"rank": r, "param": sv.name, "placements": sv.placements,
                                       "local_shape": sv.local_shape})
                    if sv.local_shape and 0 in sv.local_shape:
                        empty.append(sv)
                if empty:
                    notes.append(f"rank {r}: torch gives {len(empty)} parameter(s) an empty local shard, e.g. "
                                 f"{empty[0].name} {empty[0].placements} -> {empty[0].local_shape}")
            model_data["local_shapes"] = shard_rows
        findings += check.findings
        data["model"] = model_data
        text = [f"{len(params)} parameters of {args.model}: {len(check.findings)} problem(s)"]
        text += [f"note: {n}" for n in notes]
        sections["model"] = "\n".join(text)
        checks.append(CheckResult("model dims divide by mesh dims", not check.findings, time.perf_counter() - t2))

    report = Report(command_line(args.argv), world, findings=findings, checks=checks, data=data,
                    sections=sections)
    publish(report, report_dir, echo=sys.stdout)
    return report.exit_code


def _short(group: list[int]) -> str:
    if len(group) <= 8:
        return "[" + ", ".join(map(str, group)) + "]"
    return f"[{group[0]}, {group[1]}, ..., {group[-1]}] ({len(group)})"


__all__ = ["add_arguments", "main"]
