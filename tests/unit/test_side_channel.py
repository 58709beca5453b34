"""The ranks' side channel (rank/runtime.py, SideChannel): where rank 0's own process serves the store (env://
without torchrun's agent store: mp.spawn, MASTER_ADDR/MASTER_PORT by hand), rank 0 leaves an exchange only once the
others have read it, so a script that ends right after ``check_model`` cannot take the store from under a reader.

    .venv/bin/python -m pytest -q tests/unit/test_side_channel.py
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from distcheck.rank import runtime
from distcheck.rank.runtime import SideChannel


class Rank0Store:
    """A store served by rank 0's process: every call fails once rank 0 has left, as a TCPStore client's does."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.gone = False

    def _serving(self) -> None:
        if self.gone:
            raise dist.DistNetworkError("Connection reset by peer")

    def set(self, key: str, value: bytes) -> None:
        self._serving()
        with self.lock:
            self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        self._serving()
        with self.lock:
            return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._serving()
        with self.lock:
            return [self.data[k] for k in keys]


def channels(store: Rank0Store, rank0_hosts_store: bool, timeout: float = 10.0) -> list[SideChannel]:
    made = [SideChannel(dist.HashStore(), r, 2, timeout=timeout, rank0_hosts_store=rank0_hosts_store) for r in (0, 1)]
    for channel in made:
        channel.store = store
    return made


def slow_reader(channel: SideChannel, pause: float) -> None:
    """Rank 1 sees every part published, then is descheduled before it reads them (a loaded machine)."""
    wait = channel._wait

    def waited(*args, **kwargs):
        wait(*args, **kwargs)
        time.sleep(pause)

    channel._wait = waited


def exchange_then_leave(rank0: SideChannel, rank1: SideChannel, store: Rank0Store) -> tuple[list, object]:
    """Both ranks exchange; rank 0 leaves (its store with it) the moment its exchange returns."""
    got: dict[int, object] = {}

    def run_rank1() -> None:
        try:
            got[1] = rank1.exchange("check_model", "from 1")
        except Exception as exc:  # noqa: BLE001 - what the reader sees is the result
            got[1] = exc

    reader = threading.Thread(target=run_rank1)
    reader.start()
    got[0] = rank0.exchange("check_model", "from 0")
    store.gone = True  # rank 0's script ended: destroy_process_group, exit
    reader.join(timeout=30)
    return got[0], got[1]


def test_rank0_serving_the_store_leaves_an_exchange_only_once_the_others_have_read_it():
    store = Rank0Store()
    rank0, rank1 = channels(store, rank0_hosts_store=True)
    slow_reader(rank1, 0.3)
    mine, theirs = exchange_then_leave(rank0, rank1, store)
    assert mine == ["from 0", "from 1"]
    assert theirs == ["from 0", "from 1"]  # without the wait: DistNetworkError, Connection reset by peer


def test_a_store_outside_rank_0_costs_rank_0_no_wait():
    """The same exchange where the store is not rank 0's (torchrun's agent, distcheck's launcher): rank 0 returns at
    once. Were the store rank 0's after all, the slow reader would lose it: the failure the wait above prevents."""
    store = Rank0Store()
    rank0, rank1 = channels(store, rank0_hosts_store=False, timeout=1.0)
    slow_reader(rank1, 0.3)
    mine, theirs = exchange_then_leave(rank0, rank1, store)
    assert mine == ["from 0", "from 1"]
    assert isinstance(theirs, Exception), theirs  # reset by peer, or no answer before the timeout


def test_a_reader_that_never_reads_holds_rank_0_only_so_long(monkeypatch):
    monkeypatch.setattr(runtime, "READ_WAIT", 0.2)
    store = Rank0Store()
    rank0, _ = channels(store, rank0_hosts_store=True)
    store.set("check_model#1/1", __import__("pickle").dumps("from 1"))  # rank 1 published, then died
    started = time.monotonic()
    assert rank0.exchange("check_model", "from 0") == ["from 0", "from 1"]
    assert 0.2 <= time.monotonic() - started < 5


def test_which_process_serves_the_store_is_read_as_torch_reads_it(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent, distcheck's launcher
    assert not SideChannel(dist.HashStore(), 0, 2).rank0_hosts_store
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert SideChannel(dist.HashStore(), 0, 2).rank0_hosts_store
