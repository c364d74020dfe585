"""rpc+shm, rpc+tcp, rpc+verbs: the RPC baseline carried over the engine's own fast transports.

The seed's "gRPC.RDMA" (TensorFlow's ``grpc+verbs``): the same wire as rdkeras,
with RPC's abstraction on top of it. Every tensor becomes a TensorProto-style
message (the grpc baseline's ``TensorMessage``: dtype, shape,
tensor_content), and what it costs is what the seed blames RPC for:

1. serialization: the sender copies header and tensor into its RPC-managed
   send buffer (one copy; the header is protobuf-encoded, the tensor bytes
   follow as the ``tensor_content`` field, so the bytes are a valid message);
2. packet split: the message goes out in frames of at most ``FRAME_BYTES``,
   each one write into the receiver's RPC-managed receive buffer (a ring of
   frame slots in its registered arena) plus a flag, over the inner
   transport (shm: a memcpy into the peer's arena; tcp: a socket; verbs: RDMA
   WRITE);
3. merge and deserialization on arrival: the receiver parses the header
   (protobuf) and copies each frame's bytes into a freshly allocated tensor
   (one copy, as TensorFlow's ``TensorResponse`` parses gRPC's slices
   straight into the tensor), then acks the frame slot.

So a tensor is copied three times (rdkeras: once), and the receiver's CPU
parses every message (rdkeras: polls a flag). Nothing else is made slower than
it must be: buffers are registered and reused (no page faults per message),
copies are single memcpy calls that release the GIL, frames pipeline (the
receiver parses frame k while frame k+1 is written), and a channel's receive
buffer holds two whole messages so, as with the native channels, a send waits
only when two messages are unread.

One-sided region access (``write``/``read``/``write_flag``, the parameter
server's push and pull) becomes unary RPCs, as in the grpc baseline: a request
stream to the target, served in order by a server thread there (started once
this rank registers memory, the only thing requests can address), and a reply
stream back that the caller reads itself. ``RpcBackend`` is a
``rdkeras.transports.baseline.BaselineBackend`` (region table, channel ends,
ring: the base's); this module is only the serialization and framing over the
native transport. ``rdkeras.transports`` registers it once per inner transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras.errors import EngineError, PeerError, RemoteAccessError, TimeoutError  # noqa: A004
from rdkeras.transports.base import BackendConfig, Buffer
from rdkeras.transports.baseline import BaselineBackend
from rdkeras.transports.grpc import TensorMessage
from rdkeras.transports.rpc_frames import (
    SERVICE_FRAMES,
    _fields,
    _frames_for,
    _RecvStream,
    _SendStream,
)


class RpcBackend(BaselineBackend):
    """The baseline as RPC over a native transport (see the module docstring)."""

    reuses_landing = True  # received tensors land in RPC-managed buffers, reused

    def __init__(self, config: BackendConfig, inner: str, native: Any):
        """`native` is the backend of the native transport named `inner` (rdkeras._engine.Engine, as the
        registry configured it), listening, not connected."""
        super().__init__(config)
        self.inner_name = inner
        self.inner: Any = native  # Any: numpy arrays are buffers, which the stub's typing misses
        self._traffic.update(copy_seconds=0.0, wire_seconds=0.0)  # where an RPC's time goes (benchmarks)
        peers = [p for p in range(self.world_size) if p != self.rank]
        # Per peer: requests to it and their replies, requests from it and our replies.
        self._requests = {p: _SendStream(self, p) for p in peers}
        self._replies_in = {p: _RecvStream(self, p, SERVICE_FRAMES) for p in peers}
        self._requests_in = {p: _RecvStream(self, p, SERVICE_FRAMES) for p in peers}
        self._replies = {p: _SendStream(self, p) for p in peers}
        self._call_locks = {p: threading.Lock() for p in peers}
        self._servers: list[threading.Thread] = []
        self._server_error: dict[int, BaseException] = {}
        self._closing = False
        service = ",".join(
            f"{p}:{self._requests[p].ack_key}:{self._replies_in[p].key}:{self._requests_in[p].key}:"
            f"{self._replies[p].ack_key}"
            for p in peers
        )
        self.descriptor = f"rpc+{inner} service={service or '-'} inner={self.inner.descriptor}"

    # -- lifecycle -----------------------------------------------------------------

    def connect(
        self, descriptors: Sequence[str], key: bytes, watch: Callable[[], None] | None = None, timeout: float = 0.0
    ) -> None:
        inner_descriptors, service = [], {}
        for r, d in enumerate(descriptors):
            kind, rest = d.split(" ", 1)
            if kind != f"rpc+{self.inner_name}":
                raise EngineError(f"rpc: rank {r} runs transport {kind!r}, this rank rpc+{self.inner_name}")
            svc, inner = rest.split(" inner=", 1)
            inner_descriptors.append(inner)
            entries = svc.split("=", 1)[1]
            service[r] = {
                int(e.split(":")[0]): [int(k) for k in e.split(":")[1:]] for e in entries.split(",") if e != "-"
            }
        self.inner.connect(inner_descriptors, key, watch, timeout)  # the native handshake authenticates the peers
        for p in self._requests:
            # Peer p's entry for this rank: its requests' ack, its reply inbox, its request inbox, its replies' ack.
            req_ack, reply_inbox, request_inbox, reply_ack = service[p][self.rank]
            self._requests[p].connect(request_inbox, SERVICE_FRAMES)
            self._replies_in[p].connect(reply_ack)
            self._requests_in[p].connect(req_ack)
            self._replies[p].connect(reply_inbox, SERVICE_FRAMES)

    def _start_servers(self) -> None:
        if self._servers or self._closing:
            return
        for p in self._requests_in:
            t = threading.Thread(target=self._serve, args=(p,), name=f"rdkeras-rpc-server-{p}", daemon=True)
            t.start()
            self._servers.append(t)

    def begin_close(self) -> None:
        """Nothing yet: this rank's service thread answers the peers' requests over the inner transport until
        close(), as they may still need it on their way to the close barrier."""

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for stream in self._requests_in.values():
            stream.poke()
        for t in self._servers:
            t.join(timeout=10)
        self.inner.close()

    # -- what the native engine underneath does better: memory, waiting, failures ---------

    def alloc(self, nbytes: int) -> np.ndarray:
        return self.inner.alloc(nbytes)

    def register(self, buffer: Buffer) -> int:
        key = super().register(buffer)
        self._start_servers()  # requests can address this rank from now on
        return key

    def counters(self) -> dict[str, int]:
        return self.inner.counters()

    def check_peer(self, peer: int) -> None:
        self.inner.check_peer(peer)

    def wait_flag(self, buffer: Buffer, offset: int, value: int, peer: int) -> None:
        start = time.monotonic()
        try:
            self.inner.wait_flag(buffer, offset, value, peer)
        finally:
            self.count_wait(time.monotonic() - start)

    @property
    def failure(self) -> tuple[int, int, str] | None:
        return self.inner.failure  # a peer's death is seen on the native wire: its root-cause record

    def report_failure(self, rank: int, why: str) -> None:
        self.inner.report_failure(rank, why)

    def count_time(self, copy: float = 0.0, wire: float = 0.0) -> None:
        """Seconds spent (de)serializing (copies) and writing frames (the inner wire, slot waits included)."""
        self._traffic["copy_seconds"] += copy
        self._traffic["wire_seconds"] += wire

    # -- one-sided access, as unary RPCs -----------------------------------------------------

    def _call(self, peer: int, request: Any, content: np.ndarray | None = None, into: np.ndarray | None = None) -> Any:
        """Sends `request` to `peer`'s server and waits for its reply (whose content lands in `into`)."""
        if peer not in self._requests:
            raise EngineError(f"rpc: no connection to rank {peer}")
        with self._call_locks[peer]:
            self._requests[peer].send(request, content)

            def destination(reply: Any, n: int) -> np.ndarray | None:
                return into[:n] if into is not None and n <= into.nbytes else None

            start = time.monotonic()  # from here on, the server's turn: serving, replying
            reply, _ = self._replies_in[peer].recv(destination)
            self.count_wait(time.monotonic() - start - self._replies_in[peer].last_copy_seconds)
        if reply.dtype == "RemoteAccessError":
            raise RemoteAccessError(reply.channel)
        if reply.dtype:
            raise EngineError(reply.channel)
        return reply

    def remote_write(self, peer: int, data: np.ndarray, key: int, offset: int) -> None:
        self._call(peer, TensorMessage(key=key, offset=offset, length=data.nbytes, channel="Write"), data)

    def remote_read(self, peer: int, into: np.ndarray, key: int, offset: int) -> None:
        self._call(peer, TensorMessage(key=key, offset=offset, length=into.nbytes, channel="Read"), into=into)

    def remote_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        self._call(peer, TensorMessage(key=key, offset=offset, value=value, channel="Flag"))

    # -- the server side -----------------------------------------------------------------

    def _serve(self, peer: int) -> None:
        """Serves `peer`'s requests in order until the backend closes or the peer dies."""
        inbox, replies = self._requests_in[peer], self._replies[peer]
        failure: list[BaseException] = []  # what the request being received did wrong

        def destination(req: Any, n: int) -> np.ndarray | None:
            if req.channel != "Write":
                return None
            try:
                return self.regions.find("write", req.key, req.offset, n)  # deserialized straight into the region
            except RemoteAccessError as e:
                failure.append(e)
                return None

        while not self._closing:
            failure.clear()
            try:
                req, _ = inbox.recv(destination)
            except TimeoutError:
                continue  # idle: nobody asked for anything within the timeout
            except (PeerError, EngineError) as e:
                if not self._closing:
                    self._server_error[peer] = e
                return
            reply, content = TensorMessage(), None
            try:
                if failure:
                    raise failure[0]
                if req.channel == "Write":
                    self.count_received(req.length)
                elif req.channel == "Read":
                    content = self.regions.find("read", req.key, req.offset, req.length)
                elif req.channel == "Flag":
                    self.regions.store_flag(req.key, req.offset, req.value)
                else:
                    raise EngineError(f"rpc: rank {peer} sent an unknown request {req.channel!r}")
            except EngineError as e:
                reply = TensorMessage(dtype=type(e).__name__, channel=str(e))
            try:
                replies.send(reply, content)
            except EngineError as e:
                if not self._closing:
                    self._server_error[peer] = e
                return

    # -- channels: each direction a stream of framed messages --------------------------------

    def link(self, sender: bool, peer: int, message_bytes: int | None) -> _RpcLink:
        return _RpcLink(self, sender, peer, message_bytes)


class _RpcLink:
    """One direction of a channel: the sender's half of a stream, or the receiver's (which owns the slots,
    room for two whole messages: ``SERVICE_FRAMES`` where their size is not known).

    Descriptors: the receiver's says where its slots are, the sender's where its ack word is.
    """

    def __init__(self, backend: RpcBackend, sender: bool, peer: int, message_bytes: int | None):
        self.backend = backend
        self.sent = 0
        slots = SERVICE_FRAMES if message_bytes is None else 2 * _frames_for(message_bytes)
        if sender:
            self._tx: _SendStream | None = _SendStream(backend, peer, message_bytes or 0)
            self._rx: _RecvStream | None = None
            self.descriptor = f"ack={self._tx.ack_key}"
        else:
            self._tx, self._rx = None, _RecvStream(backend, peer, slots)
            self.descriptor = f"key={self._rx.key} slots={slots}"

    def connect(self, remote_descriptor: str) -> None:
        f = _fields(remote_descriptor)
        if self._tx is not None:
            self._tx.connect(int(f["key"]), int(f["slots"]))
        else:
            assert self._rx is not None
            self._rx.connect(int(f["ack"]))

    def send(self, seq: int, dtype: str, shape: Sequence[int], content: np.ndarray) -> None:
        assert self._tx is not None
        self._tx.send(TensorMessage(dtype=dtype, shape=list(shape), seq=seq), content)
        self.sent += 1

    def recv(self, seq: int, land: Callable[[Any, int], np.ndarray]) -> tuple[Any, np.ndarray]:
        rx = self._rx
        assert rx is not None
        start = time.monotonic()
        header, content = rx.recv(land)
        self.backend.count_wait(time.monotonic() - start - rx.last_copy_seconds)
        if header.seq != seq:
            raise EngineError(f"rpc: expected message {seq} from rank {rx.peer}, got {header.seq}")
        assert content is not None
        return header, content

    # RPC copies the tensor when it is sent: the source is free at once.
    @property
    def acked(self) -> int:
        return self.sent

    def wait_acked(self, count: int) -> None:
        if count > self.sent:
            raise EngineError(f"wait_acked({count}): only {self.sent} messages were sent")
