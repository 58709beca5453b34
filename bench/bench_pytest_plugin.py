"""Per-test cost of @pytest.mark.distributed versus torch's MultiProcessTestCase, 20 trivial 2-rank tests each.

    .venv/bin/python bench/bench_pytest_plugin.py

Both suites do the same thing per test (an all_reduce on 2 gloo ranks) and run in one pytest process each
(no xdist), measured in this run. The marker's total includes starting its rank pool once.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N = 20
MARKER = "import pytest, torch, torch.distributed as dist\n" + "".join(f'''
@pytest.mark.distributed(nprocs=2, timeout=60)
def test_{i}(dist_ctx):
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == 2
''' for i in range(N))

MPTC = '''import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestTrivial(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _body(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == 2
        dist.destroy_process_group()
''' + "".join(f'''
    def test_{i}(self):
        self._body()
''' for i in range(N))


def run_suite(path: Path) -> float:
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - start
    if res.returncode != 0 or f"{N} passed" not in res.stdout:
        raise SystemExit(f"{path.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return elapsed


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        marker, mptc = Path(tmp) / "test_marker.py", Path(tmp) / "test_mptc.py"
        marker.write_text(MARKER)
        mptc.write_text(MPTC)
        t_marker = run_suite(marker)
        t_mptc = run_suite(mptc)
    print(f"{N} trivial 2-rank tests: distcheck marker {t_marker:.1f} s ({t_marker / N:.2f} s/test incl. pool "
          f"start), MultiProcessTestCase {t_mptc:.1f} s ({t_mptc / N:.2f} s/test) -> "
          f"{t_mptc / t_marker:.1f}x faster per test (target >= 4x)")


if __name__ == "__main__":
    main()
