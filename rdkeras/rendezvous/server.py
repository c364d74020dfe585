"""The rendezvous store's server: one thread, one selector, every connection authenticated first.

A connection that has not proven itself gets at most ``MAX_HELLO`` bytes read and
``HANDSHAKE_S`` seconds, at most ``MAX_STRANGERS`` such connections exist at once (the
oldest is dropped first; a rank whose handshake was cut off so connects again), and none
of them can mark a rank as gone.
"""

from __future__ import annotations

import hmac
import json
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

from rdkeras.errors import EngineError
from rdkeras.rendezvous.wire import (
    CLOSING_BARRIER,
    HANDSHAKE_S,
    LAUNCHER,
    MAX_FRAME,
    MAX_HELLO,
    MAX_STRANGERS,
    frame,
    mac,
)


class _Conn:
    """One client connection, as the server's event loop sees it."""

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock, self.nonce = sock, nonce
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.until = time.monotonic() + HANDSHAKE_S  # strangers only
        self.who: str | None = None  # "0", "1", ... or LAUNCHER once authenticated
        self.said_bye = False

    @property
    def rank(self) -> int | None:
        return int(self.who) if self.who is not None and self.who.isdigit() else None


class _Waiter:
    def __init__(self, conn: _Conn, keys: list[str], setters: dict[str, Any], deadline: float, despite: bool):
        self.conn, self.keys, self.setters, self.deadline = conn, keys, setters, deadline
        self.despite_failure = despite  # an elastic job's survivors wait for the next group after a failure


class StoreServer:
    """The job's key-value store: one thread, bounded per connection.

    Args:
        host: The address to listen on (the job's network; "" for every address).
        port: The port (0 picks a free one: see ``.port``).
        token: The job token.
        world_size: Ranks in the job (a client claiming another world is refused).
        arrival_timeout: Seconds from now within which every rank should arrive (the rendezvous timeout):
            after a failure in start-up, closing waits that long for the ranks still on their way, to tell
            them the cause (nobody else can).
    """

    def __init__(self, host: str, port: int, token: bytes, world_size: int, arrival_timeout: float = 0.0):
        self._token, self._world = token, world_size
        self._arrive_by = time.monotonic() + arrival_timeout
        self._arrived: set[int] = set()
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

    def put(self, key: str, value: bytes) -> None:
        """Sets `key` from this process (a launcher answering its workers); waiters see it at once."""
        with self._lock:
            self._data[key] = value.hex()
        self._wake_w.send(b"x")

    def value(self, key: str) -> bytes | None:
        """What `key` holds, or None."""
        with self._lock:
            found = self._data.get(key)
        return None if found is None else bytes.fromhex(found)

    @property
    def failure(self) -> dict | None:
        """The first failure recorded ({"rank", "reason", "reporter"}), or None."""
        with self._lock:
            return None if self._failure is None else dict(self._failure)

    def connected(self) -> set[int]:
        """The ranks connected now that did not say goodbye."""
        with self._lock:
            return {r for r, c in self._ranks.items() if c.sock.fileno() >= 0 and not c.said_bye}

    def launchers(self) -> int:
        """Launchers' clients connected now (other nodes' launchers: rdkeras.launch_nodes)."""
        with self._lock:
            conns = [key.data for key in self._selector.get_map().values() if isinstance(key.data, _Conn)]
        return sum(1 for c in conns if c.who == LAUNCHER)

    def arrived(self) -> set[int]:
        """The ranks that ever connected."""
        with self._lock:
            return set(self._arrived)

    def clients(self, but_failed: bool = False) -> int:
        """Ranks connected now (`but_failed`: not counting the rank the store knows failed)."""
        with self._lock:
            failed = self._failure["rank"] if but_failed and self._failure is not None else None
            return sum(1 for r, c in self._ranks.items() if c.sock.fileno() >= 0 and r != failed)

    def _still_arriving(self) -> bool:
        """After a failure: whether a rank other than the failed one has not arrived yet, and may still
        (within the arrival timeout) -- it will wait for the others, and only this store can tell it why."""
        with self._lock:
            if self._failure is None or time.monotonic() >= self._arrive_by:
                return False
            expected = set(range(self._world)) - {self._failure["rank"]}
            return not expected <= self._arrived

    def close(self, linger: float = 0.0, arrivals: bool = True) -> None:
        """Stops serving, after waiting up to `linger` seconds for the ranks to hang up first
        (one still reading its last reply must not see the store vanish) -- all but a rank known to
        have failed, which may be stopped and never hang up -- and, after a failure in start-up, for
        the ranks still on their way (see `arrival_timeout`; not with `arrivals` False: a launcher whose workers
        all ended)."""
        end = time.monotonic() + linger
        while arrivals and self._still_arriving():
            time.sleep(0.02)
        with self._lock:  # no new connections: the next job on this port must not reach this store
            self._stop_listening()
        while self.clients(but_failed=True) and time.monotonic() < end:
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
            if len(self._strangers) >= MAX_STRANGERS:
                self._drop(self._strangers[0])  # the oldest stranger makes room
            self._strangers.append(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._send(conn, {"nonce": conn.nonce.hex()})

    def _io(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE and conn.outbox:
            if not self._flush(conn):
                return self._hang_up(conn)
            if not conn.outbox:
                self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        if not events & selectors.EVENT_READ:
            return
        limit = MAX_FRAME if conn.who is not None else MAX_HELLO
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
        expect = mac(self._token, b"client", conn.nonce, claimed.encode(), world.encode())
        if not hmac.compare_digest(expect, str(hello.get("mac", ""))):
            self._send(conn, {"ok": False, "error": self._why_refused(conn, hello, claimed, world)})
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
            self._arrived.add(rank)
        self._send(
            conn, {"ok": True, "mac": mac(self._token, b"server", client_nonce, claimed.encode(), world.encode())}
        )

    def _why_refused(self, conn: _Conn, hello: dict, claimed: str, world: str) -> str:
        """Why a hello's proof did not verify: made with this job's token for another connection's nonce (the hello
        names the nonce it answers), i.e. a replayed or delayed handshake, or made with another token."""
        answers = hello.get("answers")
        if isinstance(answers, str) and answers != conn.nonce.hex():
            try:
                stale = mac(self._token, b"client", bytes.fromhex(answers), claimed.encode(), world.encode())
            except ValueError:
                stale = ""
            if hmac.compare_digest(stale, str(hello.get("mac", ""))):
                return (
                    "stale nonce: this hello answers the challenge of an earlier connection, not this one's (a "
                    "replayed or delayed handshake); connect again and answer the new nonce"
                )
        return "job token mismatch"

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
            deadline = time.monotonic() + float(req["timeout"])
            self._waiters.append(_Waiter(conn, keys, setters, deadline, bool(req.get("despite_failure"))))
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
            elif self._failure is not None and not w.despite_failure:
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

    @staticmethod
    def _flush(conn: _Conn) -> bool:
        """Sends what the socket takes now of `conn`'s outbox; False if the connection broke."""
        try:
            sent = conn.sock.send(conn.outbox)
            del conn.outbox[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return False
        return True

    def _send(self, conn: _Conn, obj: dict) -> None:
        if conn.sock.fileno() < 0:
            return
        conn.outbox += frame(obj)
        if not self._flush(conn):
            return
        if conn.outbox:
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
