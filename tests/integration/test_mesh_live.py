"""distcheck's live mesh check on real torchrun ranks (the pure and fake-process-group parts are in tests/unit)."""
from __future__ import annotations

import re

from launch_helpers import FIXTURES, plain_ranks


def findings_count(stdout: str) -> list[int]:
    """The counts the script printed as "N findings" on a line of its own ("10 findings" is not "0 findings")."""
    return [int(n) for n in re.findall(r"^(\d+) findings$", stdout, re.MULTILINE)]


def test_live_mesh_in_plain_ranks_is_clean():
    """The script's own distcheck calls, in ranks that distcheck did not start (torchrun's environment)."""
    res = plain_ranks([str(FIXTURES / "mesh_ok.py")], nproc=2, timeout=120)
    assert res.returncode == 0, res.output
    assert findings_count(res.stdout) == [0], res.output
