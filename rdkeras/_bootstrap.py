"""Rendezvous: a small key-value store hosted by rank 0.

Every connection starts with a mutual HMAC-SHA256 challenge over the job
token, so a process that does not know the token learns nothing and can set
nothing. The store carries only setup-time data (endpoint descriptors, channel
keys); tensors never pass through it. Every wait has a deadline and, on
timeout, the error names the ranks that never answered.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from rdkeras.errors import AuthenticationError, PeerError, TimeoutError  # noqa: A004

_MAX_FRAME = 16 << 20  # from an authenticated rank
_MAX_HELLO = 1024  # before authentication


def _send(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, limit: int = _MAX_FRAME) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes is too large")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("a store message must be a JSON object")
    return obj


def _mac(token: bytes, *parts: bytes) -> str:
    return hmac.new(token, b"|".join(parts), hashlib.sha256).hexdigest()


def transport_key(token: bytes) -> bytes:
    """The 32-byte key every transport connection proves knowledge of (csrc/engine/handshake.h).

    Derived from the job token with a label of its own, so neither the token nor the
    store's MACs can stand in for it, and it never leaves the process.
    """
    return hmac.new(token, b"rdkeras transport key v1", hashlib.sha256).digest()


class _StoreServer:
    """Serves the store from a thread of rank 0's process."""

    def __init__(self, host: str, port: int, token: bytes):
        self._token = token
        self._data: dict[str, str] = {}
        self._gone: set[int] = set()  # ranks whose connection closed
        self._cond = threading.Condition()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._closing = False
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, name="rdkeras-store", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # includes the accept timeout
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        rank: int | None = None  # set once the client proved it holds the token
        try:
            conn.settimeout(10)
            nonce = os.urandom(32)
            _send(conn, {"nonce": nonce.hex()})
            hello = _recv(conn, limit=_MAX_HELLO)  # a stranger gets no more than this read
            claimed = str(hello.get("rank"))
            expect = _mac(self._token, b"client", nonce, claimed.encode())
            if not hmac.compare_digest(expect, str(hello.get("mac", ""))):
                _send(conn, {"ok": False, "error": "job token mismatch"})
                conn.close()
                return
            client_nonce = bytes.fromhex(hello["nonce"])
            _send(conn, {"ok": True, "mac": _mac(self._token, b"server", client_nonce, claimed.encode())})
            rank = int(claimed) if claimed.isdigit() else None
            conn.settimeout(None)
            with self._cond:
                self._conns.append(conn)
            while True:
                req = _recv(conn)
                _send(conn, self._handle(req))
        except (ConnectionError, OSError, ValueError, KeyError):
            conn.close()
            with self._cond:
                if conn in self._conns:
                    self._conns.remove(conn)
                self._cond.notify_all()
            if rank is not None:  # only an authenticated rank's hang-up means it left
                with self._cond:  # waits on this rank now fail at once instead of timing out
                    self._gone.add(rank)
                    self._cond.notify_all()

    def _handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "set":
            with self._cond:
                self._data[req["key"]] = req["value"]
                self._cond.notify_all()
            return {"ok": True}
        if op == "get":
            keys = req["keys"]
            setters = dict(zip(keys, req.get("from") or [None] * len(keys), strict=True))
            deadline = time.monotonic() + float(req["timeout"])
            with self._cond:
                while True:
                    missing = [k for k in keys if k not in self._data]
                    gone = sorted({setters[k] for k in missing if setters[k] in self._gone})
                    left = deadline - time.monotonic()
                    if not missing or gone or left <= 0:
                        break
                    self._cond.wait(min(left, 1.0))
                if missing:
                    return {"ok": False, "missing": missing, "gone": gone}
                return {"ok": True, "values": [self._data[k] for k in keys]}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def close(self, linger: float = 0.0) -> None:
        """Stops serving, after waiting up to `linger` seconds for the clients to hang up first
        (one still reading its last reply must not see the store vanish)."""
        end = time.monotonic() + linger
        with self._cond:
            while self._conns and time.monotonic() < end:
                self._cond.wait(min(0.05, max(end - time.monotonic(), 0)))
        self._closing = True
        self._listener.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


class Store:
    """A client of the job's store (rank 0 also hosts it).

    Args:
        rank: This process's rank.
        world_size: Number of ranks in the job.
        host: Address of rank 0's store.
        port: Port of rank 0's store (rank 0 may pass 0 to pick a free one).
        token: The job token every rank shares.
        timeout: Seconds any wait may take.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, token: bytes, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._server = _StoreServer("" if host in ("0.0.0.0", "") else host, port, token) if rank == 0 else None
        self.port = self._server.port if self._server else port
        self._lock = threading.Lock()
        self._sock = self._connect(host, self.port, token)
        # The local address peers can reach us at (what rank 0 sees us come from).
        self.local_host = self._sock.getsockname()[0]

    def _connect(self, host: str, port: int, token: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((host, port), timeout=min(5.0, self.timeout))
                break
            except OSError as e:  # rank 0 may not listen yet
                last = e
                time.sleep(0.05)
        else:
            raise TimeoutError(f"could not reach rank 0's store at {host}:{port} within {self.timeout:g} s ({last})")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            challenge = _recv(sock)
            nonce = os.urandom(32)
            me = str(self.rank).encode()
            _send(
                sock,
                {
                    "rank": self.rank,
                    "nonce": nonce.hex(),
                    "mac": _mac(token, b"client", bytes.fromhex(challenge["nonce"]), me),
                },
            )
            reply = _recv(sock)
        except (ConnectionError, OSError, ValueError, KeyError) as e:
            sock.close()
            raise AuthenticationError(f"rank 0's store at {host}:{port} broke the handshake: {e}") from None
        if not reply.get("ok"):
            sock.close()
            raise AuthenticationError(
                f"rank 0 refused rank {self.rank}: {reply.get('error')} (every rank needs the same "
                "RDKERAS_JOB_TOKEN; the launcher sets it)"
            )
        if not hmac.compare_digest(str(reply.get("mac")), _mac(token, b"server", nonce, me)):
            sock.close()
            raise AuthenticationError(f"the store at {host}:{port} does not know this job's token")
        sock.settimeout(None)
        return sock

    def _call(self, req: dict) -> dict:
        with self._lock:
            try:
                _send(self._sock, req)
                return _recv(self._sock)
            except (ConnectionError, OSError) as e:
                raise PeerError(f"lost the connection to rank 0's store ({e}); did rank 0 exit?") from None

    def set(self, key: str, value: bytes) -> None:
        self._call({"op": "set", "key": key, "value": value.hex()})

    def get(
        self, keys: Sequence[str], waiting_for: Sequence[int] | None = None, timeout: float | None = None
    ) -> list[bytes]:
        """Waits until every key is set. `waiting_for[i]` names the rank expected to set keys[i]."""
        timeout = self.timeout if timeout is None else timeout
        reply = self._call(
            {
                "op": "get",
                "keys": list(keys),
                "timeout": timeout,
                "from": list(waiting_for) if waiting_for is not None else None,
            }
        )
        if not reply["ok"]:
            missing = reply["missing"]
            if reply.get("gone"):
                ranks = ", ".join(map(str, reply["gone"]))
                raise PeerError(
                    f"rank {ranks} left the job (its connection to the store closed) "
                    f"while this rank waited for {missing[0]!r}"
                )
            if waiting_for is not None:
                ranks = sorted({waiting_for[list(keys).index(k)] for k in missing})
                who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            else:
                who = "keys " + ", ".join(missing)
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {who} ({missing[0]!r})")
        return [bytes.fromhex(v) for v in reply["values"]]

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        self.set(f"{name}/{self.rank}", value)
        ranks = list(range(self.world_size))
        return self.get([f"{name}/{r}" for r in ranks], waiting_for=ranks, timeout=timeout)

    def barrier(self, name: str, timeout: float | None = None) -> None:
        self.all_gather(f"barrier/{name}", b"", timeout=timeout)

    def close(self) -> None:
        self._sock.close()
        if self._server:
            self._server.close(linger=min(self.timeout, 10.0))
