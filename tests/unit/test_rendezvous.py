"""The rendezvous store's client never waits forever: a store whose host stopped is named within the call's bound."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time

import pytest

from rdkeras.errors import PeerError
from rdkeras.launch import free_port
from rdkeras.rendezvous import Store, StoreServer
from rdkeras.rendezvous.wire import frame, mac, recv

TOKEN = b"test-token"


def _host(port: int, ready) -> None:
    server = StoreServer("127.0.0.1", port, TOKEN, 2)
    ready.set()
    time.sleep(120)
    server.close()


def _wait_stopped(pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {within} s")


def test_a_stopped_store_host_is_named_within_the_bound():
    ctx = multiprocessing.get_context("fork")
    port, ready = free_port(), ctx.Event()
    host = ctx.Process(target=_host, args=(port, ready), daemon=True)
    host.start()
    try:
        assert ready.wait(30)
        store = Store(1, 2, "127.0.0.1", port, TOKEN, timeout=1.5)  # rank 1: rank 0 (that process) hosts it
        store.set("alive", b"1")
        os.kill(host.pid, signal.SIGSTOP)  # as a stopped rank 0 would
        _wait_stopped(host.pid)  # the signal lands asynchronously: a loaded machine could still let it answer
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"rank 0's store did not answer within 1.5 s: rank 0 is stopped") as e:
            store.set("k", b"v")
        assert e.value.rank == 0
        with pytest.raises(PeerError, match="did not answer"):  # the connection is done for: at once
            store.barrier("close", timeout=1.0)
        store.close()  # says goodbye as best it can, bounded
        assert time.monotonic() - started < 6
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.join(10)


def _hello(token: bytes, challenge: dict, rank: int = 1, world: int = 2) -> bytes:
    """A client's hello answering `challenge`, as rdkeras.rendezvous.client sends it."""
    proof = mac(token, b"client", bytes.fromhex(challenge["nonce"]), str(rank).encode(), str(world).encode())
    return frame({"rank": rank, "world": world, "nonce": os.urandom(32).hex(), "mac": proof,
                  "answers": challenge["nonce"]})  # fmt: skip


def test_a_replayed_hello_is_refused_as_a_stale_nonce_and_another_token_as_a_mismatch():
    port = free_port()
    server = StoreServer("127.0.0.1", port, TOKEN, 2)
    connections: list[socket.socket] = []

    def connect() -> tuple[socket.socket, dict]:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        connections.append(s)
        return s, recv(s)

    try:
        first, challenge = connect()
        recorded = _hello(TOKEN, challenge)
        first.sendall(recorded)
        assert recv(first)["ok"] is True  # rank 1 joins
        again, _ = connect()  # the same hello, recorded on the wire and sent again: a new connection, a new nonce
        again.sendall(recorded)
        assert recv(again) == {
            "ok": False,
            "error": "stale nonce: this hello answers the challenge of an earlier connection, not this one's (a "
            "replayed or delayed handshake); connect again and answer the new nonce",
        }
        other, challenge = connect()
        other.sendall(_hello(b"another-token", challenge))
        assert recv(other) == {"ok": False, "error": "job token mismatch"}
        forged, challenge = connect()  # a made-up earlier nonce: the proof is not this job's for it either
        forged.sendall(_hello(b"another-token", {"nonce": "ab" * 32}))
        assert recv(forged) == {"ok": False, "error": "job token mismatch"}
    finally:
        for s in connections:
            s.close()
        server.close()
