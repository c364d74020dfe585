"""The rendezvous store's client never waits forever: a store whose host stopped is named within the call's bound."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from rdkeras.errors import PeerError
from rdkeras.launch import free_port
from rdkeras.rendezvous import Store, StoreServer

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
