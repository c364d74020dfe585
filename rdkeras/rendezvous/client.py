"""A rank's client of the rendezvous store (and, on the rank that hosts it, the server too)."""

from __future__ import annotations

import builtins
import hmac
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from rdkeras.errors import AuthenticationError, EngineError, TimeoutError, peer_error  # noqa: A004
from rdkeras.rendezvous.server import StoreServer
from rdkeras.rendezvous.wire import HANDSHAKE_S, frame, mac, recv


class Store:
    """A client of the job's store. Rank 0 hosts the store unless `serve` says otherwise
    (``RDKERAS_STORE=launcher``: a launcher hosts it and reports its workers' deaths).

    Args:
        rank: This process's rank (a launcher's client: ``LAUNCHER``).
        world_size: Number of ranks in the job.
        host: Address of the store (rank 0's, or the launcher's).
        port: Its port (a hosting rank 0 may pass 0 to pick a free one).
        token: The job token every rank shares.
        timeout: Seconds any wait may take.
        serve: Whether this process hosts the store (default: rank 0 does).
        connect_timeout: Seconds to reach the store at start-up (default: `timeout`).
    """

    def __init__(
        self,
        rank: int | str,
        world_size: int,
        host: str,
        port: int,
        token: bytes,
        timeout: float,
        serve: bool | None = None,
        connect_timeout: float | None = None,
    ):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._owner = "rank 0" if serve is None else "the launcher"  # who hosts it, for error messages
        serve = rank == 0 if serve is None else serve
        bind = "" if host in ("0.0.0.0", "") else host
        connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._server = StoreServer(bind, port, token, world_size, arrival_timeout=connect_timeout) if serve else None
        self.port = self._server.port if self._server else port
        self._lock = threading.Lock()
        self._broken: Exception | None = None  # set once a call timed out: the stream may be mid-frame
        # Called with (rank, message) when the store reports a failed rank (the face tells the transport).
        self.on_failure: Any = None
        try:
            self._sock = self._connect(host, self.port, token, connect_timeout)
        except BaseException:
            if self._server:
                self._server.close()
            raise
        # The local address peers can reach us at (what the store sees us come from).
        self.local_host = self._sock.getsockname()[0]

    def _connect(self, host: str, port: int, token: bytes, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        me, world = str(self.rank).encode(), str(self.world_size).encode()
        while True:
            if time.monotonic() >= deadline:
                if self._owner == "rank 0" and self.rank != 0:
                    raise peer_error(
                        0,
                        f"rank 0 never answered at {host}:{port} within {timeout:g} s ({last}): it did not start, "
                        "died, or is unreachable from here (check RDKERAS_MASTER_ADDR/PORT and the firewall)",
                    )
                raise TimeoutError(f"could not reach the job's store at {host}:{port} within {timeout:g} s ({last})")
            try:
                sock = socket.create_connection((host, port), timeout=min(5.0, timeout))
            except OSError as e:  # the store may not listen yet
                last = e
                time.sleep(0.05)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.settimeout(min(timeout, HANDSHAKE_S))
                challenge = recv(sock)
                nonce = os.urandom(32)
                proof = mac(token, b"client", bytes.fromhex(challenge["nonce"]), me, world)
                # "answers": the nonce this proof answers, so a store refusing it can tell a stale nonce (a
                # replayed hello) from another token; it proves nothing itself (the MAC covers the nonce).
                hello = {"rank": self.rank, "world": self.world_size, "nonce": nonce.hex(), "mac": proof}
                sock.sendall(frame({**hello, "answers": challenge["nonce"]}))
                reply = recv(sock)
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
        if not hmac.compare_digest(str(reply.get("mac")), mac(token, b"server", nonce, me, world)):
            sock.close()
            raise AuthenticationError(f"the store at {host}:{port} does not know this job's token")
        sock.settimeout(None)
        return sock

    def _call(self, req: dict, timeout: float | None = None) -> dict:
        """One request and its answer, within `timeout` seconds (default: the engine's timeout) in all: a
        store whose host stopped or hung is named, never waited for forever."""
        timeout = self.timeout if timeout is None else timeout
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError(f"another thread of rank {self.rank} held the job's store for {timeout:g} s")
        try:
            if self._broken is not None:
                raise self._broken
            self._sock.settimeout(timeout)
            self._sock.sendall(frame(req))
            return recv(self._sock)
        except builtins.TimeoutError:
            # Half a frame may be in flight: this connection is done for.
            self._broken = peer_error(
                0 if self._owner == "rank 0" else None,
                f"{self._owner}'s store did not answer within {timeout:g} s: {self._owner} is stopped, hung or "
                "unreachable",
            )
            raise self._broken from None
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
            self._lock.release()

    def set(self, key: str, value: bytes) -> None:
        # A store answers a set at once: 30 s without an answer means its host is stopped or hung.
        self._call({"op": "set", "key": key, "value": value.hex()}, timeout=min(self.timeout, 30.0))

    def get(
        self,
        keys: Sequence[str],
        waiting_for: Sequence[int] | None = None,
        timeout: float | None = None,
        despite_failure: bool = False,
    ) -> list[bytes]:
        """Waits until every key is set. `waiting_for[i]` names the rank expected to set keys[i].
        `despite_failure`: a failure the store knows of does not end the wait (an elastic job's survivors wait
        for the launcher's next group)."""
        timeout = self.timeout if timeout is None else timeout
        reply = self._call(
            {
                "op": "get",
                "keys": list(keys),
                "timeout": timeout,
                "from": list(waiting_for) if waiting_for is not None else None,
                "despite_failure": despite_failure,
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
        waited: list[int] = []
        if waiting_for is not None:
            waited = sorted({waiting_for[list(keys).index(k)] for k in missing})
            who = f"rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))}"
        else:
            who = "keys " + ", ".join(missing)
        err = TimeoutError(f"timed out after {timeout:g} s waiting for {who} ({missing[0]!r})")
        err.ranks = waited  # type: ignore[attr-defined]  # the ranks that never answered
        raise err

    def peek(self, key: str) -> bytes | None:
        """What `key` holds now, or None: no waiting."""
        reply = self._call({"op": "get", "keys": [key], "timeout": 0.0, "despite_failure": True}, timeout=30.0)
        return bytes.fromhex(reply["values"][0]) if reply["ok"] else None

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
