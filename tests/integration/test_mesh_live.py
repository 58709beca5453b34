"""distcheck's live mesh check on real torchrun ranks (the pure and fake-process-group parts are in tests/unit)."""
from __future__ import annotations

from launch_helpers import FIXTURES, torchrun


def test_live_mesh_under_torchrun_is_clean():
    res = torchrun([str(FIXTURES / "mesh_ok.py")], nproc=2, timeout=120)
    assert res.returncode == 0, res.output
    assert "0 findings" in res.stdout
