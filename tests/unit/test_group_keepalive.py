"""A destroyed process group stays alive, held from Python, until release(): see distcheck/rank/group_keepalive.py.

A 1-rank gloo group in this process (its worker threads, named pt_gloo_runloop, show whether it still exists).
"""
from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distcheck.rank import group_keepalive


def gloo_workers(expected: int) -> int:
    """The count of gloo worker threads, once it is ``expected`` or 2 s have passed (threads name themselves as
    they start and end on their own time)."""
    deadline = time.monotonic() + 2.0
    while (count := _count()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def _count() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


@pytest.fixture
def keepalive(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    # torch's functions come back after the test; the keep-alive patches them for the whole process otherwise
    monkeypatch.setattr(c10d, "destroy_process_group", c10d.destroy_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    monkeypatch.setattr(group_keepalive, "_installed", False)
    yield
    group_keepalive.release()


def one_rank_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_without_it_torch_destroys_the_group_at_once():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this worker")
    before = _count()
    one_rank_group()
    try:
        assert gloo_workers(before + 2) == before + 2
    finally:
        dist.destroy_process_group()
    assert gloo_workers(before) == before


def test_destroyed_groups_live_until_released(keepalive):
    before = _count()
    group_keepalive.install()
    one_rank_group()
    dist.new_group([0])  # torch.distributed's name and distributed_c10d's are the same wrapper
    assert dist.destroy_process_group is c10d.destroy_process_group
    dist.destroy_process_group()
    assert group_keepalive.kept() == 2
    assert gloo_workers(before + 4) == before + 4  # both groups are still there: no destructor ran under the GIL
    assert not dist.is_initialized()  # for torch they are gone
    group_keepalive.release()  # the last references go from Python: torch's binding drops the GIL first
    assert group_keepalive.kept() == 0
    assert gloo_workers(before) == before


def test_destroying_one_subgroup_keeps_that_one(keepalive):
    group_keepalive.install()
    group_keepalive.install()  # once per process: a second call wraps nothing twice
    one_rank_group()
    sub = dist.new_group([0])
    dist.destroy_process_group(sub)
    assert group_keepalive.kept() == 1
    assert dist.is_initialized()
    dist.destroy_process_group()
    assert group_keepalive.kept() == 2
