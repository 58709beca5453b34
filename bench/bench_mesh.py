"""Wall time of the simulated mesh check (``distcheck mesh``) at 64, 1024, 4096 and 16384 ranks.

    .venv/bin/python bench/bench_mesh.py

Two figures per world size, measured in this one run:
- ``check``: the check itself in-process (parse, layout findings, every dim's groups for every rank, and torch's
  init_device_mesh on the fake process group for the first and last rank, cross-checked), median of 3;
- ``cli``: ``python -m distcheck mesh ...`` end to end in a fresh process (Python and torch import included,
  report written), median of 3, next to a bare ``python -c "import torch"`` measured in the same run.
  Target: cli <= 5 s at 4096 ranks.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [(64, "4,4,4"), (1024, "16,8,8"), (4096, "64,8,8"), (16384, "256,8,8")]
REPEAT = 3


def check_once(world: int, shape_text: str) -> float:
    from distcheck.analysis.mesh import MeshSpec, mesh_findings, plan_mesh
    from distcheck.commands.mesh import parse_names, parse_shape
    from distcheck.rank.checks.mesh import simulate_rank

    t0 = time.perf_counter()
    shape, findings = parse_shape(shape_text, world)
    spec = MeshSpec(world, shape, parse_names("dp,tp,pp", len(shape)))
    findings += mesh_findings(spec)
    plan = plan_mesh(spec)
    views = [simulate_rank(spec, r) for r in (0, world - 1)]
    assert not findings and all(v.agrees for v in views) and len(plan.dims) == 3
    return time.perf_counter() - t0


def cli_once(world: int, shape_text: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "distcheck", "mesh", "--world-size", str(world), "--shape",
                              shape_text, "--names", "dp,tp,pp", "--report-dir", out],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        took = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    return took


def import_baseline() -> float:
    """A fresh ``python -c 'import torch'``: the floor under every cli figure."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.perf_counter() - t0


def main() -> None:
    import torch  # noqa: F401  (import cost out of the in-process figures)

    check_once(8, "2,2,2")  # warm-up: first fake process group, lazy imports
    baseline = statistics.median(import_baseline() for _ in range(REPEAT))
    print(f"python -c 'import torch': {baseline:.2f} s (median of {REPEAT})")
    print(f"{'ranks':>6} {'shape':>9} {'check (s)':>10} {'cli (s)':>8}")
    rows = []
    for world, shape in CASES:
        check = statistics.median(check_once(world, shape) for _ in range(REPEAT))
        cli = statistics.median(cli_once(world, shape) for _ in range(REPEAT))
        rows.append((world, check, cli))
        print(f"{world:>6} {shape:>9} {check:>10.3f} {cli:>8.2f}", flush=True)
    base = rows[0]
    for world, check, cli in rows[1:]:
        print(f"{world // base[0]:>4}x ranks ({base[0]} -> {world}): check x{check / base[1]:.1f}, "
              f"cli x{cli / base[2]:.2f}")


if __name__ == "__main__":
    main()
