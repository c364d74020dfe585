"""A fake rank for hostile-input tests, and the transport handshake written again in Python.

The handshake here is an independent implementation of csrc/engine/handshake.h
(the byte layout and the two MACs), so a test that completes a handshake with a
real rank checks the C++ one against its specification, and a test can also send
what no real rank would: garbage, half a hello, a wrong key, a replayed proof.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Any

from rdkeras.launch import free_port
from rdkeras.rendezvous import Store, transport_key
from tests.conftest import run_ranks

MAGIC = 0x4B484452
VERSION = 1
LINKS = {"shm": 1, "tcp": 2, "verbs": 3}
OK, MALFORMED, UNEXPECTED, BAD_PROOF = 0, 1, 2, 3
HELLO_BYTES, CHALLENGE_BYTES, PROOF_BYTES, WELCOME_BYTES = 56, 72, 40, 8


def hello(link: str, client: int, server: int, world: int, channel: int, nonce: bytes | None = None) -> bytes:
    nonce = os.urandom(32) if nonce is None else nonce
    return struct.pack("<IHHIIII", MAGIC, VERSION, LINKS[link], client, server, world, channel) + nonce


def _mac(key: bytes, label: str, hello_bytes: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(key, label.encode() + b"\0" + hello_bytes + server_nonce, hashlib.sha256).digest()


def server_mac(key: bytes, hello_bytes: bytes, server_nonce: bytes) -> bytes:
    return _mac(key, "rdkeras handshake v1 server", hello_bytes, server_nonce)


def client_mac(key: bytes, hello_bytes: bytes, server_nonce: bytes) -> bytes:
    return _mac(key, "rdkeras handshake v1 client", hello_bytes, server_nonce)


def proof(mac: bytes) -> bytes:
    return struct.pack("<II", MAGIC, 0) + mac


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def challenge(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, server nonce, server MAC)."""
    magic, status = struct.unpack("<II", (raw := recv_exact(sock, CHALLENGE_BYTES))[:8])
    assert magic == MAGIC
    return status, raw[8:40], raw[40:72]


def welcome(sock: socket.socket) -> int:
    magic, status = struct.unpack("<II", recv_exact(sock, WELCOME_BYTES))
    assert magic == MAGIC
    return status


def send_with_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])


def authenticate(sock: socket.socket, key: bytes, link: str, me: int, server: int, world: int, channel: int) -> int:
    """A complete, honest client handshake; returns the welcome status."""
    h = hello(link, me, server, world, channel)
    sock.sendall(h)
    status, nonce, mac = challenge(sock)
    assert status == OK, status
    assert hmac.compare_digest(mac, server_mac(key, h, nonce)), "the real rank's MAC differs from the spec"
    sock.sendall(proof(client_mac(key, h, nonce)))
    return welcome(sock)


def fake_arena() -> int:
    """A memfd that passes for an arena (its region table's magic), for a fake shm rank."""
    fd = os.memfd_create("impostor-arena")
    os.ftruncate(fd, 2 << 20)
    os.pwrite(fd, struct.pack("<II", 0x52444B52, 16384), 0)
    return fd


class Job:
    """A 2-rank job whose rank 0 is a real process and whose rank 1 is this test.

    The test holds the token (as the launcher would), so it can join the store as rank 1
    and reach rank 0 while rank 0 waits for rank 1's transport connections.
    """

    def __init__(self, transport: str, target: str = "connect_only", **kwargs: Any):
        self.transport, self.token, self.port = transport, os.urandom(16).hex(), free_port()
        self.key = transport_key(self.token.encode())
        self.result: list = []
        env = {"RDKERAS_JOB_TOKEN": self.token, "RDKERAS_MASTER_PORT": str(self.port), "RDKERAS_TIMEOUT": "60"}
        kwargs.setdefault("timeout_s", 60)

        def run() -> None:
            self.result = run_ranks(
                target, 2, transport=transport, env=env, only_ranks=[0], check=False, timeout=120, **kwargs
            )

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        self.store = Store(1, 2, "127.0.0.1", self.port, self.token.encode(), timeout=60)
        self.endpoints: list[str] = []

    def publish(self, descriptor: str) -> str:
        """Publishes rank 1's descriptor (``{host}`` is replaced by rank 0's host); returns rank 0's."""
        (rank0,) = self.store.get(["endpoints/0"], waiting_for=[0])
        host = field(rank0.decode(), "host")  # shm: the same host, however the engine spells it
        descriptor = descriptor.replace("{host}", host) + ";abort_key=4294967297"  # where aborts would go
        self.store.set("endpoints/1", descriptor.encode())
        self.endpoints = [rank0.decode(), descriptor]
        return rank0.decode()

    def finish(self) -> Any:
        """Lets rank 0 close (its close barrier) and returns its result."""
        try:
            self.store.barrier("close", timeout=60)
        except Exception as e:
            self._thread.join(timeout=90)
            raise AssertionError(f"rank 0 went away: {self.result[0].output[-3000:] if self.result else '?'}") from e
        self.store.close()
        self._thread.join(timeout=90)
        assert self.result, "rank 0 never finished"
        return self.result[0]


def field(descriptor: str, key: str) -> str:
    return dict(kv.split("=", 1) for kv in descriptor.split(";")[1:])[key]


def connect_tcp(descriptor: str) -> socket.socket:
    return socket.create_connection((field(descriptor, "host"), int(field(descriptor, "port"))), timeout=10)


def connect_unix(descriptor: str) -> socket.socket:
    end = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect("\0" + field(descriptor, "sock"))
            return s
        except BlockingIOError:  # the listener's backlog is full: it has not accepted yet
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


def wait_until(predicate: Any, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def store_frame(obj: Any) -> bytes:
    import json

    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


def store_stranger(port: int, claimed_rank: int, how: str) -> str:
    """One connection to the rendezvous store without the token; returns what it saw."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        recv_exact(s, 4)  # the challenge's length; its body follows
        if how == "wrong_mac_then_reset":
            s.sendall(store_frame({"rank": claimed_rank, "nonce": os.urandom(32).hex(), "mac": "00" * 32}))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        elif how == "huge_frame":
            s.sendall(struct.pack("!I", 1 << 30) + b"x" * 1000)
        elif how == "garbage":
            s.sendall(os.urandom(300))
        elif how == "not_an_object":
            s.sendall(store_frame([1, 2, 3]))
        return "sent"
    finally:
        s.close()
