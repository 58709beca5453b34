"""The integration tier: real ranks, every launch with a timeout.

Each pytest process (each xdist worker) starts one shared zygote (distcheck/supervise/zygote.py) and names it in
DISTCHECK_ZYGOTE, which every `python -m distcheck run/compare` the tests start inherits (launch_helpers): its
ranks are forked with torch, FSDP2, DTensor and torch._dynamo already imported instead of importing them afresh,
about 4 s of CPU each, which on a 2-core machine is most of the suite's time. So are the ranks of
`torchrun -m distcheck ...`: the processes torchrun starts stand in for them (zygote.stand_in). The path users get
by default, fresh interpreters, is what torchrun runs for a plain script and what the tests that pass ``FRESH``
(launch_helpers) run: the fault tests, a crash and a hang under torchrun, among others.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from launch_helpers import env_for_ranks

from distcheck.processes import die_with_parent, terminate
from distcheck.supervise.zygote import ENV


@pytest.fixture(scope="session", autouse=True)
def shared_zygote():
    if sys.platform != "linux" or os.environ.get(ENV) is not None:  # the caller chose (DISTCHECK_ZYGOTE=0: none)
        yield None
        return
    folder = tempfile.mkdtemp(prefix="distcheck-test-zygote-")
    path = os.path.join(folder, "socket")
    proc = subprocess.Popen([sys.executable, "-m", "distcheck.supervise.zygote", path], env=env_for_ranks(),
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.environ[ENV] = path  # launches that find no zygote there fall back to fresh interpreters
    try:
        yield path
    finally:
        os.environ.pop(ENV, None)
        terminate([proc.pid], grace=3.0)  # its ranks die with it (PR_SET_PDEATHSIG)
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
