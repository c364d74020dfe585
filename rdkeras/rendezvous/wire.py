"""The rendezvous store's wire: length-prefixed JSON frames and the MACs both ends compute.

Shared by the server and its clients (and by the store's fuzzer); nothing here keeps state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct

MAX_FRAME = 16 << 20  # from an authenticated rank
MAX_HELLO = 1024  # before authentication
HANDSHAKE_S = 10.0
MAX_STRANGERS = 128
LAUNCHER = "launcher"  # the rank name a launcher authenticates with (it may report failures)
CLOSING_BARRIER = "barrier/close/"  # once every rank set its key here, the store takes no new connections


def frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    (n,) = struct.unpack("!I", recv_exact(sock, 4))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes is too large")
    obj = json.loads(recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("a store message must be a JSON object")
    return obj


def mac(token: bytes, *parts: bytes) -> str:
    return hmac.new(token, b"|".join(parts), hashlib.sha256).hexdigest()


def transport_key(token: bytes) -> bytes:
    """The 32-byte key every transport connection proves knowledge of (csrc/engine/handshake.h).

    Derived from the job token with a label of its own, so neither the token nor the
    store's MACs can stand in for it, and it never leaves the process.
    """
    return hmac.new(token, b"rdkeras transport key v1", hashlib.sha256).digest()
