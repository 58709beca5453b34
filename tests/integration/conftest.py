"""The integration tier: real ranks, every launch with a timeout.

The test session has one shared zygote (distcheck/supervise/zygote.py; under xdist the controller starts it for
every worker, tests/conftest.py) named in DISTCHECK_ZYGOTE, which every `python -m distcheck run/compare` the
tests start inherits (launch_helpers): its ranks are forked with torch, FSDP2, DTensor and torch._dynamo already
imported instead of importing them afresh, about 4 s of CPU each, which on a 2-core machine is most of the suite's
time. So are the ranks of `torchrun -m distcheck ...`: the processes torchrun starts stand in for them
(zygote.stand_in). The path users get by default, fresh interpreters, is what torchrun runs for a plain script
and what the tests that pass ``FRESH`` (launch_helpers) run: the fault tests, a crash and a hang under torchrun,
among others.
"""
from __future__ import annotations

import os
import sys

import pytest

from launch_helpers import start_zygote, stop_zygote

from distcheck.supervise.zygote import ENV


@pytest.fixture(scope="session", autouse=True)
def shared_zygote():
    """This process's zygote, unless one was chosen already: by the caller (DISTCHECK_ZYGOTE=0: none), or by the
    xdist controller for every worker (tests/conftest.py)."""
    if sys.platform != "linux" or os.environ.get(ENV) is not None:
        yield os.environ.get(ENV)
        return
    proc, folder = start_zygote()
    try:
        yield os.environ[ENV]
    finally:
        stop_zygote(proc, folder)
