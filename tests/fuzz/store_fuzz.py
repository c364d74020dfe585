"""Fuzzes the rendezvous store's message handling with atheris (coverage-guided).

Each input opens one connection to a live StoreServer and sends it: the first byte picks
whether the connection first authenticates as a rank (so the fuzzer reaches the parsing
of requests, not only of hellos), the rest is sent as raw bytes. After every input the
server must still be up and a real rank must still get through.

    python tests/fuzz/store_fuzz.py -atheris_runs=20000 tests/fuzz/corpus/store
"""

from __future__ import annotations

import os
import socket
import sys

import atheris

with atheris.instrument_imports():
    from rdkeras.rendezvous import StoreServer, wire

TOKEN = b"fuzz-token"
SERVER = StoreServer("127.0.0.1", 0, TOKEN, 4)
_runs = 0


def _authenticated(rank: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", SERVER.port), timeout=5)
    challenge = wire.recv(s)
    nonce = os.urandom(32)
    mac = wire.mac(TOKEN, b"client", bytes.fromhex(challenge["nonce"]), str(rank).encode(), b"4")
    s.sendall(wire.frame({"rank": rank, "world": 4, "nonce": nonce.hex(), "mac": mac}))
    assert wire.recv(s)["ok"]
    return s


def _still_serves() -> None:
    s = _authenticated(3)
    s.sendall(wire.frame({"op": "set", "key": "alive", "value": "00"}))
    assert wire.recv(s) == {"ok": True}
    s.sendall(wire.frame({"op": "bye"}))
    wire.recv(s)
    s.close()


def test_one_input(data: bytes) -> None:
    global _runs
    if not data:
        return
    mode, payload = data[0] % 3, data[1:]
    try:
        s = _authenticated(mode) if mode else socket.create_connection(("127.0.0.1", SERVER.port), timeout=5)
        s.settimeout(0.002)
        s.sendall(payload)
        try:
            s.recv(65536)
        except (TimeoutError, OSError):
            pass
        s.close()
    except (ConnectionError, OSError):
        pass  # the server may drop garbage before it is all sent
    _runs += 1
    if _runs % 200 == 0:
        _still_serves()


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
