"""supervise/store_client.py, torchrun's store without torch: against torch's own TCPStore server (both backends),
each client reading what the other wrote, and what happens when the server is not one or stops answering."""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from distcheck.supervise.node_exchange import NodeEnv, StoreChannel
from distcheck.supervise.store_client import ProtocolError, StoreClient


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_distchecks_client_and_torchs_read_what_the_other_wrote(libuv):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False,
                           use_libuv=libuv)
    theirs = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10), wait_for_workers=False)
    mine = StoreClient("127.0.0.1", server.port, 10.0)
    mine.set("distcheck/run/0/node/1", b"\x00summary")
    assert theirs.get("distcheck/run/0/node/1") == b"\x00summary"
    theirs.set("distcheck/run/0/hang", "1:node-b")
    assert mine.check(["distcheck/run/0/hang"]) and not mine.check(["distcheck/run/0/hang", "distcheck/run/0/x"])
    assert mine.get("distcheck/run/0/hang") == b"1:node-b"
    assert [mine.add("v", 1), theirs.add("v", 2), mine.add("v", 0)] == [1, 3, 3]
    big = bytes(range(256)) * 4096  # 1 MiB: a node's stacks after a hang
    mine.set("big", big)
    assert theirs.get("big") == big and mine.get("big") == big
    mine.close()


def serve(answer: bytes, then_silent: bool = True) -> tuple[int, threading.Event]:
    """A server that answers each connection's first 10 bytes (the handshake) with ``answer`` and nothing else."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def run() -> None:
        conns = []
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.recv(10)
            conn.sendall(answer)
            conns.append(conn)
        for c in conns:
            c.close()
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1], done


def test_a_server_that_does_not_echo_the_nonce_is_not_spoken_to():
    port, done = serve(b"\xff\xff\xff\xff")
    try:
        with pytest.raises(ProtocolError, match="answered the handshake with 4294967295"):
            StoreClient("127.0.0.1", port, 2.0)
    finally:
        done.set()


def test_a_call_that_times_out_drops_the_connection_and_the_next_opens_another(monkeypatch):
    import os

    monkeypatch.setattr(os, "getpid", lambda: 7)
    port, done = serve((7).to_bytes(4, "little"))  # answers the handshake, then nothing
    try:
        client = StoreClient("127.0.0.1", port, 0.3)
        with pytest.raises(socket.timeout):
            client.add("version", 0)
        assert client.sock is None  # a late answer can never be read as the next call's
        with pytest.raises(socket.timeout):
            client.check(["x"])  # reconnected (a second handshake), then no answer again
        assert client.sock is None
    finally:
        done.set()


def test_the_channel_takes_torchs_client_when_the_store_speaks_another_protocol(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    env = NodeEnv(0, 2, 0, 1, 2, "node-a", "127.0.0.1", server.port, "distcheck/r/0/")
    channel = StoreChannel.connect(env, timeout=5.0)
    assert isinstance(channel.store, StoreClient) and channel.bump_progress() == 1

    from distcheck.supervise import store_client

    def refuse(*_):
        raise ProtocolError("the store at 127.0.0.1 answered the handshake with 1, not 2")

    monkeypatch.setattr(store_client.StoreClient, "__init__", refuse)
    channel = StoreChannel.connect(env, timeout=5.0)
    assert isinstance(channel.store, dist.TCPStore) and channel.bump_progress() == 2
