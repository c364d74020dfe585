"""Rendezvous: a small key-value store hosted by rank 0 (or by a launcher), and its clients.

Every connection starts with a mutual HMAC-SHA256 challenge over the job token,
so a process that does not know the token learns nothing and can set nothing.
The store carries only setup-time data (endpoint descriptors, channel keys);
tensors never pass through it. Every wait has a deadline and, on timeout, the
error names the ranks that never answered.

Failures name their root cause: the first authenticated rank whose connection
drops without saying goodbye (or a failure a rank or the launcher reports) is
recorded, and every wait on the store, now or later, fails naming that rank.

The server is one thread and one selector: a connection that has not proven
itself gets at most ``_MAX_HELLO`` bytes read and ``_HANDSHAKE_S`` seconds, at
most ``_MAX_STRANGERS`` such connections exist at once (the oldest is dropped
first; a rank whose handshake was cut off so connects again), and none of them
can mark a rank as gone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from rdkeras.errors import AuthenticationError, EngineError, TimeoutError, peer_error  # noqa: A004

_MAX_FRAME = 16 << 20  # from an authenticated rank
_MAX_HELLO = 1024  # before authentication
_HANDSHAKE_S = 10.0
_MAX_STRANGERS = 128
LAUNCHER = "launcher"  # the rank name a launcher authenticates with (it may report failures)
CLOSING_BARRIER = "barrier/close/"  # once every rank set its key here, the store takes no new connections


def _frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


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


class _Conn:
    """One client connection, as the server's event loop sees it."""

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock, self.nonce = sock, nonce
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.until = time.monotonic() + _HANDSHAKE_S  # strangers only
        self.who: str | None = None  # "0", "1", ... or LAUNCHER once authenticated
        self.said_bye = False

    @property
    def rank(self) -> int | None:
        return int(self.who) if self.who is not None and self.who.isdigit() else None


class _Waiter:
    def __init__(self, conn: _Conn, keys: list[str], setters: dict[str, Any], deadline: float):
        self.conn, self.keys, self.setters, self.deadline = conn, keys, setters, deadline


class StoreServer:
    """The job's key-value store: one thread, bounded per connection.

    Args:
        host: The address to listen on (the job's network; "" for every address).
        port: The port (0 picks a free one: see ``.port``).
        token: The job token.
        world_size: Ranks in the job (a client claiming another world is refused).
    """

    def __init__(self, host: str, port: int, token: bytes, world_size: int):
        self._token, self._world = token, world_size
        self._data: dict[str, str] = {}
        self._left: set[int] = set()  # ranks that said goodbye
        self._failure: dict | None = None  # the first failure: {"rank", "reason", "reporter"}
        self._ranks: dict[int, _Conn] = {}
        self._waiters: list[_Waiter] = []
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise EngineError(
                f"cannot listen for the job's rendezvous on {host or '*'}:{port}: {e.strerror or e} "
                "(another job on this port? choose another RDKERAS_MASTER_PORT)"
            ) from None
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._strangers: list[_Conn] = []
        self._lock = threading.Lock()  # guards the state above against abort()/close() from other threads
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="rdkeras-store", daemon=True)
        self._thread.start()

    # -- what other threads call --------------------------------------------------

    def abort(self, rank: int, reason: str, reporter: str = LAUNCHER) -> None:
        """Records that `rank` failed (a launcher saw it exit): every wait fails naming it."""
        with self._lock:
            self._fail(rank, reason, reporter)
        self._wake_w.send(b"x")

    def clients(self) -> int:
        with self._lock:
            return sum(1 for c in self._ranks.values() if c.sock.fileno() >= 0)

    def close(self, linger: float = 0.0) -> None:
        """Stops serving, after waiting up to `linger` seconds for the ranks to hang up first
        (one still reading its last reply must not see the store vanish)."""
        end = time.monotonic() + linger
        with self._lock:  # no new connections: the next job on this port must not reach this store
            self._stop_listening()
        while self.clients() and time.monotonic() < end:
            time.sleep(0.02)
        self._closing = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._wake_r.close()
        self._selector.close()
        self._wake_w.close()

    # -- the event loop -------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing:
            now = time.monotonic()
            with self._lock:
                wake = min([w.deadline for w in self._waiters] + [c.until for c in self._strangers] + [now + 0.5])
            for key, events in self._selector.select(timeout=max(0.0, wake - now)):
                with self._lock:
                    if key.data == "wake":
                        self._wake_r.recv(4096)
                    elif key.data is None:
                        self._accept()
                    else:
                        self._io(key.data, events)
            with self._lock:
                self._expire(time.monotonic())
                self._answer_waiters(time.monotonic())

    def _stop_listening(self) -> None:
        if self._listener.fileno() >= 0:
            self._selector.unregister(self._listener)
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, os.urandom(32))
            if len(self._strangers) >= _MAX_STRANGERS:
                self._drop(self._strangers[0])  # the oldest stranger makes room
            self._strangers.append(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, {"nonce": conn.nonce.hex()})

    def _io(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE and conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)
                del conn.outbox[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._hang_up(conn)
            if not conn.outbox:
                self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        if not events & selectors.EVENT_READ:
            return
        limit = _MAX_FRAME if conn.who is not None else _MAX_HELLO
        try:
            chunk = conn.sock.recv(min(1 << 20, limit + 4 - len(conn.inbox)) or 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            return self._hang_up(conn)
        conn.inbox += chunk
        while len(conn.inbox) >= 4 and conn.sock.fileno() >= 0:
            (n,) = struct.unpack("!I", conn.inbox[:4])
            if n > limit:
                return self._hang_up(conn)
            if len(conn.inbox) < 4 + n:
                return
            raw, conn.inbox = bytes(conn.inbox[4 : 4 + n]), conn.inbox[4 + n :]
            try:
                msg = json.loads(raw)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
                self._authenticate(conn, msg) if conn.who is None else self._request(conn, msg)
            except (ValueError, KeyError, TypeError):
                return self._hang_up(conn)  # garbage: a stranger is dropped, a rank's connection too

    def _authenticate(self, conn: _Conn, hello: dict) -> None:
        claimed = str(hello.get("rank"))
        world = str(hello.get("world"))
        expect = _mac(self._token, b"client", conn.nonce, claimed.encode(), world.encode())
        if not hmac.compare_digest(expect, str(hello.get("mac", ""))):
            self._send(conn, {"ok": False, "error": "job token mismatch"})
            return self._drop(conn, after_send=True)
        client_nonce = bytes.fromhex(str(hello["nonce"]))
        if world != str(self._world):
            self._send(conn, {"ok": False, "error": f"rank 0's job has {self._world} ranks, this one {world}"})
            return self._drop(conn, after_send=True)
        rank = int(claimed) if claimed.isdigit() else None
        if claimed != LAUNCHER and (rank is None or rank >= self._world):
            self._send(conn, {"ok": False, "error": f"rank {claimed} is not in a world of {self._world}"})
            return self._drop(conn, after_send=True)
        if rank is not None and rank in self._ranks:
            self._send(conn, {"ok": False, "error": f"rank {rank} is connected already (two processes as one rank?)"})
            return self._drop(conn, after_send=True)
        self._strangers.remove(conn)
        conn.who = claimed
        if rank is not None:
            self._ranks[rank] = conn
        self._send(
            conn, {"ok": True, "mac": _mac(self._token, b"server", client_nonce, claimed.encode(), world.encode())}
        )

    def _request(self, conn: _Conn, req: dict) -> None:
        op = req.get("op")
        if op == "set":
            key = str(req["key"])
            self._data[key] = str(req["value"])
            self._send(conn, {"ok": True})
            if key.startswith(CLOSING_BARRIER) and self._listener.fileno() >= 0:
                if all(f"{CLOSING_BARRIER}{r}" in self._data for r in range(self._world)):
                    self._stop_listening()  # the job is leaving: the next one on this port must not land here
        elif op == "get":
            keys = [str(k) for k in req["keys"]]
            setters = dict(zip(keys, req.get("from") or [None] * len(keys), strict=True))
            self._waiters.append(_Waiter(conn, keys, setters, time.monotonic() + float(req["timeout"])))
        elif op == "abort":
            self._fail(int(req["rank"]), str(req["reason"])[:500], conn.who or "?")
            self._send(conn, {"ok": True})
        elif op == "failure":
            self._send(conn, {"ok": True, "failed": self._failure})
        elif op == "bye":
            conn.said_bye = True
            if conn.rank is not None:
                self._left.add(conn.rank)
            self._send(conn, {"ok": True})
        else:
            self._send(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def _answer_waiters(self, now: float) -> None:
        keep = []
        for w in self._waiters:
            if w.conn.sock.fileno() < 0:
                continue
            missing = [k for k in w.keys if k not in self._data]
            left = sorted({w.setters[k] for k in missing if w.setters[k] in self._left})
            if not missing:
                self._send(w.conn, {"ok": True, "values": [self._data[k] for k in w.keys]})
            elif self._failure is not None:
                self._send(w.conn, {"ok": False, "missing": missing, "failed": self._failure})
            elif left:
                self._send(w.conn, {"ok": False, "missing": missing, "left": left})
            elif now >= w.deadline:
                self._send(w.conn, {"ok": False, "missing": missing})
            else:
                keep.append(w)
        self._waiters = keep

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._strangers if c.until <= now]:
            self._drop(conn)

    def _fail(self, rank: int, reason: str, reporter: str) -> None:
        if self._failure is None:
            self._failure = {"rank": rank, "reason": reason, "reporter": reporter}

    def _hang_up(self, conn: _Conn) -> None:
        """A connection closed: an authenticated rank that did not say goodbye has failed."""
        rank = conn.rank
        if rank is not None and not conn.said_bye and not self._closing:
            self._fail(rank, "its connection to the store closed (process exited?)", "the store")
        self._drop(conn)

    def _drop(self, conn: _Conn, after_send: bool = False) -> None:
        if after_send and conn.outbox:
            try:  # the refusal is small: a non-blocking send almost always takes it whole
                conn.sock.send(conn.outbox)
            except OSError:
                pass
        if conn in self._strangers:
            self._strangers.remove(conn)
        if conn.rank is not None and self._ranks.get(conn.rank) is conn:
            del self._ranks[conn.rank]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _send(self, conn: _Conn, obj: dict) -> None:
        if conn.sock.fileno() < 0:
            return
        conn.outbox += _frame(obj)
        try:
            sent = conn.sock.send(conn.outbox)
            del conn.outbox[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return
        if conn.outbox:
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)


class Store:
    """A client of the job's store. Rank 0 hosts the store unless `serve` says otherwise
    (``RDKERAS_STORE=launcher``: a launcher hosts it and reports its workers' deaths).

    Args:
        rank: This process's rank.
        world_size: Number of ranks in the job.
        host: Address of the store (rank 0's, or the launcher's).
        port: Its port (a hosting rank 0 may pass 0 to pick a free one).
        token: The job token every rank shares.
        timeout: Seconds any wait may take.
        serve: Whether this process hosts the store (default: rank 0 does).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        token: bytes,
        timeout: float,
        serve: bool | None = None,
    ):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._owner = "rank 0" if serve is None else "the launcher"  # who hosts it, for error messages
        serve = rank == 0 if serve is None else serve
        bind = "" if host in ("0.0.0.0", "") else host
        self._server = StoreServer(bind, port, token, world_size) if serve else None
        self.port = self._server.port if self._server else port
        self._lock = threading.Lock()
        # Called with (rank, message) when the store reports a failed rank (the face tells the transport).
        self.on_failure: Any = None
        try:
            self._sock = self._connect(host, self.port, token)
        except BaseException:
            if self._server:
                self._server.close()
            raise
        # The local address peers can reach us at (what the store sees us come from).
        self.local_host = self._sock.getsockname()[0]

    def _connect(self, host: str, port: int, token: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        me, world = str(self.rank).encode(), str(self.world_size).encode()
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"could not reach the job's store at {host}:{port} within {self.timeout:g} s ({last})"
                )
            try:
                sock = socket.create_connection((host, port), timeout=min(5.0, self.timeout))
            except OSError as e:  # the store may not listen yet
                last = e
                time.sleep(0.05)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.settimeout(min(self.timeout, _HANDSHAKE_S))
                challenge = _recv(sock)
                nonce = os.urandom(32)
                mac = _mac(token, b"client", bytes.fromhex(challenge["nonce"]), me, world)
                sock.sendall(_frame({"rank": self.rank, "world": self.world_size, "nonce": nonce.hex(), "mac": mac}))
                reply = _recv(sock)
                break
            except (ConnectionError, OSError) as e:
                # Closed before it answered: a store under a flood of strangers drops the oldest
                # unauthenticated connection, which may be ours; nothing was agreed yet, so try again.
                sock.close()
                last = e
                time.sleep(0.05)
            except (ValueError, KeyError) as e:
                sock.close()
                raise AuthenticationError(f"the job's store at {host}:{port} broke the handshake: {e}") from None
        if not reply.get("ok"):
            sock.close()
            error = str(reply.get("error"))
            hint = " (every rank needs the same RDKERAS_JOB_TOKEN; the launcher sets it)" if "token" in error else ""
            raise AuthenticationError(f"the job's store refused rank {self.rank}: {error}{hint}")
        if not hmac.compare_digest(str(reply.get("mac")), _mac(token, b"server", nonce, me, world)):
            sock.close()
            raise AuthenticationError(f"the store at {host}:{port} does not know this job's token")
        sock.settimeout(None)
        return sock

    def _call(self, req: dict, timeout: float | None = None) -> dict:
        with self._lock:
            try:
                self._sock.settimeout(timeout)
                self._sock.sendall(_frame(req))
                return _recv(self._sock)
            except (ConnectionError, OSError) as e:
                if self._owner == "rank 0" and self.rank != 0:
                    err = peer_error(0, f"rank 0 is gone: lost the connection to its store ({e})")
                    if self.on_failure is not None:
                        self.on_failure(0, str(err))
                    raise err from None
                raise peer_error(None, f"lost the connection to the job's store ({self._owner}: {e})") from None
            finally:
                try:
                    self._sock.settimeout(None)
                except OSError:
                    pass

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
            },
            timeout=timeout + 30,  # the store answers by then at the latest
        )
        if reply["ok"]:
            return [bytes.fromhex(v) for v in reply["values"]]
        missing = reply["missing"]
        if failed := reply.get("failed"):
            by = f" (seen by {'rank ' if str(failed['reporter']).isdigit() else ''}{failed['reporter']})"
            raise peer_error(
                failed["rank"],
                f"rank {failed['rank']} failed: {failed['reason']}{by}; this rank waited for {missing[0]!r}",
            )
        if left := reply.get("left"):
            ranks = ", ".join(map(str, left))
            raise peer_error(left[0], f"rank {ranks} closed its engine (left the job) before setting {missing[0]!r}")
        if waiting_for is not None:
            waited = sorted({waiting_for[list(keys).index(k)] for k in missing})
            who = f"rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))}"
        else:
            who = "keys " + ", ".join(missing)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {who} ({missing[0]!r})")

    def _failed(self, failed: dict, context: str = "") -> Exception:
        by = f" (seen by {'rank ' if str(failed['reporter']).isdigit() else ''}{failed['reporter']})"
        err = peer_error(failed["rank"], f"rank {failed['rank']} failed: {failed['reason']}{by}{context}")
        if self.on_failure is not None:
            self.on_failure(failed["rank"], str(err))
        return err

    def check(self) -> None:
        """Raises PeerError naming the failed rank if the store knows of a failure."""
        failed = self._call({"op": "failure"}, timeout=min(self.timeout, 10.0)).get("failed")
        if failed:
            raise self._failed(failed)

    def abort(self, rank: int, reason: str) -> None:
        """Reports that `rank` failed: every wait on the store fails naming it (best effort, ≤ 2 s)."""
        try:
            self._call({"op": "abort", "rank": int(rank), "reason": reason}, timeout=2.0)
        except (EngineError, OSError):
            pass  # the store is gone too: the others see that

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        self.set(f"{name}/{self.rank}", value)
        ranks = list(range(self.world_size))
        return self.get([f"{name}/{r}" for r in ranks], waiting_for=ranks, timeout=timeout)

    def barrier(self, name: str, timeout: float | None = None) -> None:
        self.all_gather(f"barrier/{name}", b"", timeout=timeout)

    def close(self) -> None:
        """Says goodbye (so the others do not take this rank's leaving for a failure) and hangs up."""
        try:
            self._call({"op": "bye"}, timeout=2.0)
        except (EngineError, OSError):
            pass
        self._sock.close()
        if self._server:
            self._server.close(linger=min(self.timeout, 10.0))
