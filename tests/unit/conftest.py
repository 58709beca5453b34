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
def fake_world(request):
    """Rank 0 of 2 on torch's fake process group: collectives return at once, no process is launched. Another
    (rank, world size): ``@pytest.mark.parametrize("fake_world", [(1, 4)], indirect=True)``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, world_size = getattr(request, "param", (0, 2))
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cli(capsys):
    """``distcheck ARGS`` in this process: its exit code, stdout and stderr (launch_helpers.Result)."""
    from launch_helpers import Result

    from distcheck import cli as cli_mod

    def run(argv: list[str]) -> Result:
        capsys.readouterr()
        code = cli_mod.main(argv)
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return run
