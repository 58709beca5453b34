"""A client of torchrun's TCPStore that needs no torch: the node watchers' link to each other on several nodes.

    torchrun --nnodes 2 ... -m distcheck run -- train.py   # each node's watcher: node_exchange.StoreChannel.connect

A node watcher needs four calls on the store (set, get, add, check). torch's own client (torch.distributed.TCPStore)
cost the watcher ``import torch``: 1.5 to 2.7 CPU-s and some 300 MB on every node, at every attempt, while the
node's ranks start beside it. This speaks c10d's wire format (torch/csrc/distributed/c10d/TCPStore.cpp and
TCPStoreBackend.hpp, the same in torch 2.6 to 2.13): a query-type byte, then each string or byte vector as a native
size_t length and its bytes, numbers as native int64; keys carry the "/" torch's client puts before every key; a
connection opens with VALIDATE (a magic number) and PING (a nonce the server echoes). A server that does not echo
the nonce raises :class:`ProtocolError`, and StoreChannel takes torch's client instead
(tests/unit/test_store_client.py runs both against torch's own server, each reading what the other wrote).
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Callable, TypeVar

T = TypeVar("T")

# c10d::detail::QueryType and CheckResponseType (TCPStoreBackend.hpp)
VALIDATE, SET, GET, ADD, CHECK, PING = 0, 1, 3, 4, 5, 13
READY = 0
VALIDATION_MAGIC = 0x3C85F7CE
KEY_PREFIX = "/"  # TCPStore::keyPrefix_

_SIZE, _INT64, _UINT32 = struct.Struct("=Q"), struct.Struct("=q"), struct.Struct("=I")


class ProtocolError(OSError):
    """The server at the address does not speak the protocol this client knows."""


class StoreClient:
    """Not thread-safe (StoreChannel holds a lock around each call). Every call is bounded by ``timeout`` and raises
    OSError (socket.timeout included) when the store does not answer; the connection is then dropped and the next
    call opens a new one, so that a late answer is never read as the next call's."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._connect()

    def set(self, key: str, value: bytes | str) -> None:
        self._call(bytes([SET]) + _string(key) + _bytes(value), None)

    def get(self, key: str) -> bytes:
        """The value of a key that exists (check it first: torch's server waits for a missing one)."""
        return self._call(bytes([GET]) + _string(key), lambda: self._recv(_SIZE.unpack(self._recv(_SIZE.size))[0]))

    def add(self, key: str, delta: int) -> int:
        return self._call(bytes([ADD]) + _string(key) + _INT64.pack(delta),
                          lambda: _INT64.unpack(self._recv(_INT64.size))[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(bytes([CHECK]) + _SIZE.pack(len(keys)) + b"".join(_string(k) for k in keys),
                          lambda: self._recv(1)[0] == READY)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:  # the store may not listen yet: retried, as torch's client does
            try:
                self.sock = socket.create_connection((self.host, self.port),
                                                     timeout=max(0.1, deadline - time.monotonic()))
                break
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        self.sock.settimeout(self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.getpid() & 0xFFFFFFFF
        try:
            self.sock.sendall(bytes([VALIDATE]) + _UINT32.pack(VALIDATION_MAGIC) + bytes([PING]) + _UINT32.pack(nonce))
            echoed = _UINT32.unpack(self._recv(_UINT32.size))[0]
        except (socket.timeout, ConnectionError) as exc:
            self.close()
            raise ProtocolError(f"no answer to the handshake of the store at {self.host}:{self.port}: {exc}") from exc
        if echoed != nonce:
            self.close()
            raise ProtocolError(f"the store at {self.host}:{self.port} answered the handshake with {echoed}, not "
                                f"{nonce}")

    def _call(self, query: bytes, answer: Callable[[], T] | None) -> T | None:
        if self.sock is None:
            self._connect()
        try:
            self.sock.sendall(query)
            return answer() if answer is not None else None
        except BaseException:
            self.close()
            raise

    def _recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionResetError("the store closed the connection")
            out += chunk
        return bytes(out)


def _bytes(value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _SIZE.pack(len(data)) + data


def _string(key: str) -> bytes:
    return _bytes(KEY_PREFIX + key)
