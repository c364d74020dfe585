"""grpc: the RPC baseline the paper beats, behind the engine's API.

Tensors travel as TensorProto-style protobuf messages (dtype, shape,
tensor_content) through grpcio, the way TensorFlow's gRPC runtime moves them:
serialized on the sender, copied through RPC-managed buffers, deserialized on
the receiver. Channels are receiver-pull like TF's RecvTensor. One-sided
region access becomes Write/Read/Flag RPCs so the conformance tests apply.
Every RPC carries ``rank:counter:HMAC(key, ranks | counter | method | header
fields)`` in its metadata: the key never travels, and a recorded RPC cannot be
replayed (each counter is accepted once). Payloads are not covered, as on every
rdkeras transport (see docs/security.md). ``GrpcBackend`` is a
``rdkeras.transports.baseline.BaselineBackend`` (region table, channel ends,
ring: the base's), so the face and every benchmark treat it as one more
transport; this module is only gRPC's RPCs and messages.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from rdkeras.errors import EngineError, RemoteAccessError, TimeoutError  # noqa: A004
from rdkeras.transports.base import BackendConfig, Buffer
from rdkeras.transports.baseline import BaselineBackend, FailureRecord

_SERVICE = "rdkeras.Baseline"
_METHODS = ("Write", "Read", "Flag", "RecvTensor", "Ping", "Abort")
_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _build_message_class() -> Any:
    """TensorMessage, built at import time (no protoc step in the build)."""
    f = descriptor_pb2.FileDescriptorProto(name="rdkeras_baseline.proto", package="rdkeras", syntax="proto3")
    m = f.message_type.add(name="TensorMessage")
    fd = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind, label) in enumerate(
        [
            ("dtype", fd.TYPE_STRING, fd.LABEL_OPTIONAL),  # TensorProto: dtype
            ("shape", fd.TYPE_INT64, fd.LABEL_REPEATED),  # tensor_shape
            ("tensor_content", fd.TYPE_BYTES, fd.LABEL_OPTIONAL),
            ("channel", fd.TYPE_STRING, fd.LABEL_OPTIONAL),
            ("seq", fd.TYPE_UINT64, fd.LABEL_OPTIONAL),
            ("key", fd.TYPE_UINT64, fd.LABEL_OPTIONAL),
            ("offset", fd.TYPE_UINT64, fd.LABEL_OPTIONAL),
            ("length", fd.TYPE_UINT64, fd.LABEL_OPTIONAL),
            ("value", fd.TYPE_UINT64, fd.LABEL_OPTIONAL),
        ],
        start=1,
    ):
        m.field.add(name=name, number=number, type=kind, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("rdkeras.TensorMessage"))


TensorMessage = _build_message_class()


class _ReplayWindow:
    """Counters already accepted from one sender: each is accepted once; ones far behind are refused."""

    SPAN = 4096  # RPCs may arrive out of order (several client threads); this many behind is fine

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._floor = 0  # everything at or below was accepted or is too old

    def accept(self, counter: int) -> bool:
        with self._lock:
            if counter <= self._floor or counter in self._seen:
                return False
            self._seen.add(counter)
            if len(self._seen) > 2 * self.SPAN:
                self._floor = sorted(self._seen)[-self.SPAN]
                self._seen = {c for c in self._seen if c > self._floor}
            return True


def _rpc_mac(key: bytes, sender: int, target: int, counter: int, method: str, req: Any) -> str:
    fields = (
        f"{sender}>{target}|{counter}|{method}|{req.key}|{req.offset}|{req.length}|{req.value}|{req.channel}|{req.seq}"
    )
    return hmac.new(key, fields.encode(), hashlib.sha256).hexdigest()


class _Mailbox:
    """Messages this rank's channels sent, held until their receivers pull them (RecvTensor)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[tuple[str, int], Any] = {}  # (channel, seq) -> message
        self._pulled: dict[str, int] = {}  # channel -> messages its receiver took
        self._failed = False

    def put(self, channel: str, seq: int, msg: Any) -> None:
        with self._cond:
            self._messages[(channel, seq)] = msg
            self._cond.notify_all()

    def fail(self) -> None:
        """A failure is known: every pull waiting now, or later, gives up."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def take(self, channel: str, seq: int, deadline: float, still_wanted: Any) -> Any:
        """The message, or None once the deadline passed, the caller went away or a failure is known."""
        with self._cond:
            while (channel, seq) not in self._messages:
                left = deadline - time.monotonic()
                if left <= 0 or not still_wanted() or self._failed:
                    return None
                self._cond.wait(min(left, 0.5))
            self._pulled[channel] = seq + 1
            self._cond.notify_all()
            return self._messages.pop((channel, seq))

    def pulled(self, channel: str) -> int:
        with self._cond:
            return self._pulled.get(channel, 0)


class GrpcBackend(BaselineBackend):
    """The baseline over gRPC: region access as Write/Read/Flag RPCs, channels as receiver-pull RPCs."""

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        self.mailbox = _Mailbox()
        self.failures = FailureRecord(self.rank, self.world_size, self._tell, self.mailbox.fail)
        self._key = b""
        self._counter = itertools.count(1)
        self._windows = [_ReplayWindow() for _ in range(self.world_size)]
        self._stubs: dict[int, dict[str, Any]] = {}
        self._grpc_channels: list[grpc.Channel] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(self, f"_rpc_{name.lower()}"),
                request_deserializer=TensorMessage.FromString,
                response_serializer=TensorMessage.SerializeToString,
            )
            for name in _METHODS
        }
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_SERVICE, handlers)])
        self._port = self._server.add_insecure_port(f"{config.bind_host}:0")
        if not self._port:
            raise EngineError(f"grpc: cannot listen on {config.bind_host}")
        self._server.start()
        self.descriptor = f"grpc;host={config.advertise_host};port={self._port}"

    def connect(
        self, descriptors: Sequence[str], key: bytes, watch: Callable[[], None] | None = None, timeout: float = 0.0
    ) -> None:
        self._key = bytes(key)  # channels open lazily: nothing here waits, so `watch` is not needed
        for r, desc in enumerate(descriptors):
            if r == self.rank:
                continue
            fields = dict(kv.split("=", 1) for kv in desc.split(";")[1:])
            ch = grpc.insecure_channel(f"{fields['host']}:{fields['port']}", options=_OPTIONS)
            self._grpc_channels.append(ch)
            self._stubs[r] = {
                name: ch.unary_unary(
                    f"/{_SERVICE}/{name}",
                    request_serializer=TensorMessage.SerializeToString,
                    response_deserializer=TensorMessage.FromString,
                )
                for name in _METHODS
            }

    def close(self) -> None:
        self._server.stop(grace=None)
        for ch in self._grpc_channels:
            ch.close()

    # -- failures: the root-cause record, passed on with Abort RPCs -------------------------

    @property
    def failure(self) -> tuple[int, int, str] | None:
        return self.failures.failure

    def report_failure(self, rank: int, why: str) -> None:
        self.failures.report(rank, why)

    def _tell(self, peer: int, failed: int, reporter: int, why: str) -> None:
        if peer in self._stubs:
            try:
                self._call(peer, "Abort", TensorMessage(key=failed, value=reporter, channel=why[:200]), 1.0)
            except (grpc.RpcError, ValueError):
                pass  # unreachable as well (or closed); the others still hear

    # -- client side ---------------------------------------------------------------------

    def _call(self, peer: int, name: str, msg: Any, timeout: float) -> Any:
        counter = next(self._counter)
        auth = f"{self.rank}:{counter}:{_rpc_mac(self._key, self.rank, peer, counter, name, msg)}"
        return self._stubs[peer][name](msg, timeout=timeout, metadata=(("rdkeras-auth", auth),))

    def rpc(self, peer: int, name: str, msg: Any, timeout: float | None = None) -> Any:
        """One RPC to `peer`, its failures mapped to the engine's errors (a dead peer: the root cause)."""
        if peer not in self._stubs:
            raise EngineError(f"grpc: no connection to rank {peer}")
        self.failures.check()
        try:
            return self._call(peer, name, msg, timeout or self.timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.ABORTED and e.details().startswith("rdkeras-abort:"):
                failed, reporter, why = e.details().split(":", 3)[1:]
                self.failures.latch(int(failed), int(reporter), why)
                raise self.failures.described(lost=peer) from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise RemoteAccessError(e.details()) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(
                    f"grpc: timed out after {timeout or self.timeout:g} s waiting for rank {peer} ({name})"
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                why = f"rank {peer} is unreachable over grpc (process exited?): {e.details()}"
                raise self.failures.root_cause(peer, why) from None
            raise EngineError(f"grpc {name} to rank {peer} failed: {code.name} {e.details()}") from None

    def remote_write(self, peer: int, data: np.ndarray, key: int, offset: int) -> None:
        self.rpc(peer, "Write", TensorMessage(key=key, offset=offset, tensor_content=data.tobytes()))

    def remote_read(self, peer: int, into: np.ndarray, key: int, offset: int) -> None:
        reply = self.rpc(peer, "Read", TensorMessage(key=key, offset=offset, length=into.nbytes))
        into[:] = np.frombuffer(reply.tensor_content, dtype=np.uint8)

    def remote_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        self.rpc(peer, "Flag", TensorMessage(key=key, offset=offset, value=value))

    def check_peer(self, peer: int) -> None:
        self.rpc(peer, "Ping", TensorMessage(), timeout=min(self.timeout, 5.0))

    def wait_flag(self, buffer: Buffer, offset: int, value: int, peer: int) -> None:
        flag = np.frombuffer(memoryview(buffer).cast("B")[offset : offset + 8], dtype=np.uint64)
        self.wait_until(lambda: int(flag[0]) >= value, peer, "flag")

    def wait_until(self, ready: Callable[[], bool], peer: int, what: str) -> None:
        """Polls `ready()` until true, pinging `peer` twice a second; bounded by the timeout."""
        start = time.monotonic()
        deadline, next_ping = start + self.timeout, start + 0.5
        try:
            while not ready():
                self.failures.check()
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"timed out after {self.timeout:g} s waiting for rank {peer} ({what})")
                if now >= next_ping:
                    self.check_peer(peer)
                    next_ping = now + 0.5
                time.sleep(0.0002)
        finally:
            self.count_wait(time.monotonic() - start)

    def link(self, sender: bool, peer: int, message_bytes: int | None) -> _GrpcLink:
        return _GrpcLink(self, peer)  # a mailbox holds any number of messages

    # -- server side -------------------------------------------------------------------

    def _authorize(self, method: str, req: Any, context: Any) -> None:
        """Aborts the RPC unless its metadata proves a rank of this job sent it, and sent it once."""
        try:
            rank_text, counter_text, mac = str(dict(context.invocation_metadata()).get("rdkeras-auth", "")).split(":")
            rank, counter = int(rank_text), int(counter_text)
            ok = 0 <= rank < self.world_size and rank != self.rank
            ok = ok and hmac.compare_digest(mac, _rpc_mac(self._key, rank, self.rank, counter, method, req))
            ok = ok and self._windows[rank].accept(counter)
        except ValueError:
            ok = False
        if not ok:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not an RPC of this job (or a replayed one)")

    def _access(self, method: str, req: Any, context: Any, op: Callable[[], Any]) -> Any:
        """`op()` (a region access) for an authorized request; a bad key, bound or alignment aborts the RPC."""
        self._authorize(method, req, context)
        try:
            return op()
        except RemoteAccessError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise AssertionError("unreachable") from None  # abort() raises

    def _rpc_write(self, req: Any, context: Any) -> Any:
        n = len(req.tensor_content)
        region = self._access("Write", req, context, lambda: self.regions.find("write", req.key, req.offset, n))
        region[:] = np.frombuffer(req.tensor_content, np.uint8)
        return TensorMessage()

    def _rpc_read(self, req: Any, context: Any) -> Any:
        region = self._access("Read", req, context, lambda: self.regions.find("read", req.key, req.offset, req.length))
        return TensorMessage(tensor_content=region.tobytes())

    def _rpc_flag(self, req: Any, context: Any) -> Any:
        self._access("Flag", req, context, lambda: self.regions.store_flag(req.key, req.offset, req.value))
        return TensorMessage()

    def _rpc_ping(self, req: Any, context: Any) -> Any:
        self._authorize("Ping", req, context)
        return TensorMessage()

    def _rpc_abort(self, req: Any, context: Any) -> Any:
        self._authorize("Abort", req, context)
        if 0 <= req.key < self.world_size and 0 <= req.value < self.world_size:
            self.failures.latch(int(req.key), int(req.value), req.channel or "it exited or lost its connections")
        return TensorMessage()

    def _rpc_recvtensor(self, req: Any, context: Any) -> Any:
        self._authorize("RecvTensor", req, context)
        msg = self.mailbox.take(req.channel, req.seq, time.monotonic() + self.timeout, context.is_active)
        if msg is None and self.failures.failure is not None:  # a failure elsewhere: the puller learns its cause
            failed, reporter, why = self.failures.failure
            context.abort(grpc.StatusCode.ABORTED, f"rdkeras-abort:{failed}:{reporter}:{why}")
        if msg is None:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"rank {self.rank} never sent {req.channel}#{req.seq}")
        return msg


class _GrpcLink:
    """One direction of a channel over gRPC: the sender serializes each message into its mailbox, as
    TensorFlow does when a tensor is sent, and the receiver pulls it with RecvTensor."""

    _ids = itertools.count()

    def __init__(self, backend: GrpcBackend, peer: int):
        self.backend, self.peer = backend, peer
        self.name = f"{backend.rank}:{next(self._ids)}"
        self.descriptor = f"name={self.name}"
        self._remote_name = ""  # the sender's mailbox name, which the receiver pulls from

    def connect(self, remote_descriptor: str) -> None:
        self._remote_name = remote_descriptor.split("name=", 1)[1]

    def send(self, seq: int, dtype: str, shape: Sequence[int], content: np.ndarray) -> None:
        # Serialize now: the caller may reuse its buffer.
        msg = TensorMessage(
            dtype=dtype, shape=list(shape), tensor_content=content.tobytes(), channel=self.name, seq=seq
        )
        self.wait_acked(seq - 1)  # at most two messages outstanding, like the native channels
        self.backend.mailbox.put(self.name, seq, msg)

    def recv(self, seq: int, land: Callable[[Any, int], np.ndarray]) -> tuple[Any, np.ndarray]:
        start = time.monotonic()
        msg = self.backend.rpc(self.peer, "RecvTensor", TensorMessage(channel=self._remote_name, seq=seq))
        self.backend.count_wait(time.monotonic() - start)
        content = land(msg, len(msg.tensor_content))
        content[:] = np.frombuffer(msg.tensor_content, dtype=np.uint8)
        return msg, content

    @property
    def acked(self) -> int:
        return self.backend.mailbox.pulled(self.name)

    def wait_acked(self, count: int) -> None:
        self.backend.wait_until(lambda: self.acked >= count, self.peer, "receiver to pull")
