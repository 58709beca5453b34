"""The unit tier launches no process: a test that tries fails at once, naming the rule."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test launched a process: move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse, raising=False)


@pytest.fixture
def fake_world():
    """Rank 0 of 2 on torch's fake process group: collectives return at once, no process is launched."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
