"""distcheck/processes.py's /proc readers against a real process: an environment longer than one read (the
sweeps find a run's processes by a tag in it), its parent, liveness and start time; then gone.

    .venv/bin/python -m pytest -q tests/integration/test_proc_readers.py
"""
from __future__ import annotations

import os
import subprocess
import time

from distcheck import processes


def test_a_long_environment_its_parent_and_its_end_are_read_as_they_are():
    tail = "x" * 100_000  # far past the first 4096-byte read
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DISTCHECK_TEST_LONG": tail, "DISTCHECK_RUN_ID": "readers"}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        # /proc shows the new environment once the exec is through. The kernel renames the process (comm) before it
        # lays out the new stack, so for a moment comm says "sleep" and environ reads empty: wait for both.
        deadline = time.monotonic() + 10
        while (processes.proc_name(proc.pid) != "sleep" or not processes.read_environ(proc.pid)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert processes.read_environ(proc.pid) == env
        assert processes.role_of(proc.pid) is None
        assert proc.pid in processes.children_map()[os.getpid()]
        assert processes.alive(proc.pid) and isinstance(processes.start_ticks(proc.pid), int)
        assert list(processes.tagged("readers")) == [proc.pid]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not processes.alive(proc.pid) and processes.start_ticks(proc.pid) is None
    assert processes.tagged("readers") == {}
