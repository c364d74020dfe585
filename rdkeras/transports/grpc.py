"""grpc: the RPC baseline the paper beats, behind the engine's API.

Tensors travel as TensorProto-style protobuf messages (dtype, shape,
tensor_content) through grpcio, the way TensorFlow's gRPC runtime moves them:
serialized on the sender, copied through RPC-managed buffers, deserialized on
the receiver. Channels are receiver-pull like TF's RecvTensor. One-sided
region access becomes Write/Read/Flag RPCs so the conformance tests apply.
Every RPC carries ``rank:counter:HMAC(key, ranks | counter | method | header
fields)`` in its metadata: the key never travels, and a recorded RPC cannot be
replayed (each counter is accepted once). Payloads are not covered, as on every
rdkeras transport (see docs/security.md). ``GrpcBackend`` implements
``rdkeras.transports.base.Backend``, like the native engine, so the face and
every benchmark treat it as one more transport.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from rdkeras.errors import EngineError, PeerError, RemoteAccessError, TimeoutError  # noqa: A004
from rdkeras.transports.base import BackendConfig

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


_COUNTER_NAMES = (
    "registrations",
    "deregistrations",
    "bytes_registered",
    "cache_hits",
    "pool_allocations",
    "pool_reuses",
    "pool_bytes_reserved",
    "pool_bytes_in_use",
)


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


class GrpcBackend:
    """The Backend interface over gRPC: region access as RPCs, channels as receiver-pull RPCs."""

    def __init__(self, config: BackendConfig):
        self.rank, self.world_size, self.timeout = config.rank, config.world_size, config.timeout
        self._regions: dict[int, np.ndarray] = {}
        self._next_key = itertools.count(1)
        self._counters = dict.fromkeys(_COUNTER_NAMES, 0)
        self._traffic: dict[str, float] = {"bytes_written": 0, "bytes_read": 0, "writes": 0, "reads": 0, "flags": 0}
        self._traffic.update(bytes_received=0, wait_seconds=0.0)
        self.mailbox = _Mailbox()
        self._key = b""
        self._counter = itertools.count(1)
        self._windows = [_ReplayWindow() for _ in range(self.world_size)]
        self._failure: tuple[int, int, str] | None = None  # (failed rank, reporter, what), latched
        self._failure_lock = threading.Lock()
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

    def connect(self, descriptors: Sequence[str], key: bytes, watch: Any = None) -> None:
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

    # -- client side -----------------------------------------------------------

    # -- failures: the same root-cause protocol as the native engine (csrc/engine/engine.h) ----

    @property
    def failure(self) -> tuple[int, int, str] | None:
        """(failed rank, rank that saw it, what it saw) once any rank reported a failure, else None."""
        return self._failure

    def _latch(self, failed: int, reporter: int, why: str) -> bool:
        with self._failure_lock:
            if self._failure is not None:
                return False
            self._failure = (failed, reporter, why)
        self.mailbox.fail()
        if reporter != self.rank:  # pass a peer's record on: whoever sees this rank leave has heard it first
            threading.Thread(target=self._tell_others, args=(failed, reporter, why), daemon=True).start()
        return True

    def _tell_others(self, failed: int, reporter: int, why: str) -> None:
        for r in self._stubs:
            if r not in (failed, reporter):
                try:
                    self._call(r, "Abort", TensorMessage(key=failed, value=reporter, channel=why[:200]), 1.0)
                except (grpc.RpcError, ValueError):
                    pass  # unreachable as well (or closed); the others still hear

    def _described(self, lost: int | None = None) -> PeerError:
        assert self._failure is not None
        failed, reporter, why = self._failure
        if reporter == self.rank:
            err = PeerError(why)
        else:
            then = f"; this rank then lost rank {lost}" if lost is not None and lost != failed else ""
            err = PeerError(f"rank {failed} failed: {why} (seen by rank {reporter}){then}")
        err.rank = failed
        return err

    def _root_cause(self, peer: int, message: str) -> PeerError:
        """`peer` failed as seen here: the failure known first, else this one, told to every other rank."""
        if self._failure is None and self._latch(peer, self.rank, message):
            self._tell_others(peer, self.rank, message)  # before raising: they hear it before we leave
        return self._described(lost=peer)

    def report_failure(self, rank: int, why: str) -> None:
        if self._failure is None and 0 <= rank < self.world_size and rank != self.rank:
            self._root_cause(rank, why)

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise self._described()

    def _call(self, peer: int, name: str, msg: Any, timeout: float) -> Any:
        counter = next(self._counter)
        auth = f"{self.rank}:{counter}:{_rpc_mac(self._key, self.rank, peer, counter, name, msg)}"
        return self._stubs[peer][name](msg, timeout=timeout, metadata=(("rdkeras-auth", auth),))

    def rpc(self, peer: int, name: str, msg: Any, timeout: float | None = None) -> Any:
        """One RPC to `peer`, its failures mapped to the engine's errors (a dead peer: the root cause)."""
        if peer not in self._stubs:
            raise EngineError(f"grpc: no connection to rank {peer}")
        self._check_failure()
        try:
            return self._call(peer, name, msg, timeout or self.timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.ABORTED and e.details().startswith("rdkeras-abort:"):
                failed, reporter, why = e.details().split(":", 3)[1:]
                self._latch(int(failed), int(reporter), why)
                raise self._described(lost=peer) from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise RemoteAccessError(e.details()) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(
                    f"grpc: timed out after {timeout or self.timeout:g} s waiting for rank {peer} ({name})"
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                why = f"rank {peer} is unreachable over grpc (process exited?): {e.details()}"
                raise self._root_cause(peer, why) from None
            raise EngineError(f"grpc {name} to rank {peer} failed: {code.name} {e.details()}") from None

    def traffic(self) -> dict[str, float]:
        return dict(self._traffic)

    def count_received(self, nbytes: int) -> None:
        self._traffic["bytes_received"] += nbytes

    def count(self, kind: str, nbytes: int = 0) -> None:
        """Adds one operation of `kind` ("writes" or "reads") moving `nbytes`."""
        self._traffic[f"bytes_{'written' if kind == 'writes' else 'read'}"] += nbytes
        self._traffic[kind] += 1

    def count_wait(self, seconds: float) -> None:
        self._traffic["wait_seconds"] += seconds

    def write(self, peer: int, src: Any, key: int, offset: int = 0) -> None:
        data = memoryview(src).tobytes()
        self.rpc(peer, "Write", TensorMessage(key=key, offset=offset, tensor_content=data))
        self.count("writes", len(data))

    def read(self, peer: int, dst: Any, key: int, offset: int = 0) -> None:
        view = memoryview(dst).cast("B")
        reply = self.rpc(peer, "Read", TensorMessage(key=key, offset=offset, length=view.nbytes))
        view[:] = reply.tensor_content
        self.count("reads", view.nbytes)

    def write_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        self.rpc(peer, "Flag", TensorMessage(key=key, offset=offset, value=value))
        self._traffic["flags"] += 1

    def flush(self, peer: int) -> None:
        self.check_peer(peer)  # every call above is synchronous

    def check_peer(self, peer: int) -> None:
        self.rpc(peer, "Ping", TensorMessage(), timeout=min(self.timeout, 5.0))

    def wait_flag(self, buffer: Any, offset: int, value: int, peer: int) -> None:
        flag = np.frombuffer(memoryview(buffer).cast("B")[offset : offset + 8], dtype=np.uint64)
        self.wait_until(lambda: int(flag[0]) >= value, peer, "flag")

    def wait_until(self, ready: Any, peer: int, what: str) -> None:
        """Polls `ready()` until true, pinging `peer` twice a second; bounded by the timeout."""
        start = time.monotonic()
        deadline, next_ping = start + self.timeout, start + 0.5
        try:
            while not ready():
                self._check_failure()
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"timed out after {self.timeout:g} s waiting for rank {peer} ({what})")
                if now >= next_ping:
                    self.check_peer(peer)
                    next_ping = now + 0.5
                time.sleep(0.0002)
        finally:
            self.count_wait(time.monotonic() - start)

    # -- regions -----------------------------------------------------------------

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def register(self, buffer: Any) -> int:
        view = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)  # holds the buffer alive
        key = next(self._next_key) << 32 | 1
        self._regions[key] = view
        self._counters["registrations"] += 1
        self._counters["bytes_registered"] += view.nbytes
        return key

    def deregister(self, key: int) -> None:
        if self._regions.pop(key, None) is None:
            raise EngineError(f"deregister: no region with key {key:#x}")
        self._counters["deregistrations"] += 1

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    # -- channels and rings --------------------------------------------------------

    def static_channel(self, sender: bool, peer: int, nbytes: int) -> GrpcStaticChannel:
        return GrpcStaticChannel(self, sender, peer, nbytes)

    def dynamic_channel(self, sender: bool, peer: int) -> GrpcDynamicChannel:
        return GrpcDynamicChannel(self, sender, peer)

    def ring(self, capacity_bytes: int, bucket_bytes: int, members: Sequence[int]) -> GrpcRing:
        return GrpcRing(self, capacity_bytes, list(members))

    # -- server side -------------------------------------------------------------

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

    def _region(self, op: str, method: str, req: Any, length: int, context: Any) -> np.ndarray:
        self._authorize(method, req, context)
        region = self._regions.get(req.key)
        if region is None:
            context.abort(  # raises
                grpc.StatusCode.NOT_FOUND,
                f"{op}: rank {self.rank} has no region with key {req.key:#x} (stale: deregistered, "
                "or never registered)",
            )
            raise AssertionError("unreachable")
        if req.offset > region.nbytes or length > region.nbytes - req.offset:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{op} of {length} bytes at offset {req.offset} is out of bounds of rank {self.rank}'s "
                f"region {req.key:#x} ({region.nbytes} bytes)",
            )
        return region

    def _rpc_write(self, req: Any, context: Any) -> Any:
        region = self._region("write", "Write", req, len(req.tensor_content), context)
        region[req.offset : req.offset + len(req.tensor_content)] = np.frombuffer(req.tensor_content, np.uint8)
        return TensorMessage()

    def _rpc_read(self, req: Any, context: Any) -> Any:
        region = self._region("read", "Read", req, req.length, context)
        return TensorMessage(tensor_content=region[req.offset : req.offset + req.length].tobytes())

    def _rpc_flag(self, req: Any, context: Any) -> Any:
        if req.offset % 8:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"flag offset {req.offset} is not 8-byte aligned")
        region = self._region("writeFlag", "Flag", req, 8, context)
        region[req.offset : req.offset + 8].view(np.uint64)[0] = req.value
        return TensorMessage()

    def _rpc_ping(self, req: Any, context: Any) -> Any:
        self._authorize("Ping", req, context)
        return TensorMessage()

    def _rpc_abort(self, req: Any, context: Any) -> Any:
        self._authorize("Abort", req, context)
        if 0 <= req.key < self.world_size and 0 <= req.value < self.world_size:
            self._latch(int(req.key), int(req.value), req.channel or "it exited or lost its connections")
        return TensorMessage()

    def _rpc_recvtensor(self, req: Any, context: Any) -> Any:
        self._authorize("RecvTensor", req, context)
        msg = self.mailbox.take(req.channel, req.seq, time.monotonic() + self.timeout, context.is_active)
        if msg is None and self._failure is not None:  # a failure elsewhere: the puller learns its cause
            failed, reporter, why = self._failure
            context.abort(grpc.StatusCode.ABORTED, f"rdkeras-abort:{failed}:{reporter}:{why}")
        if msg is None:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"rank {self.rank} never sent {req.channel}#{req.seq}")
        return msg


class _GrpcChannel:
    """One end of a channel over gRPC: the sender serializes into its mailbox, the receiver
    pulls with RecvTensor (static and dynamic channels differ only in what they check)."""

    _ids = itertools.count()

    def __init__(self, backend: GrpcBackend, sender: bool, peer: int):
        self.backend, self.sender, self.peer = backend, sender, peer
        self.name = f"{backend.rank}:{next(self._ids)}"
        self.sequence = 0
        self._remote_name = ""
        self.descriptor = f"channel;name={self.name}"

    def connect(self, remote_descriptor: str) -> None:
        self._remote_name = remote_descriptor.split("name=", 1)[1]

    @property
    def acked(self) -> int:
        return self.backend.mailbox.pulled(self.name)

    def wait_acked(self, count: int) -> None:
        self.backend.wait_until(lambda: self.acked >= count, self.peer, "receiver to pull")

    def _send(self, a: np.ndarray, dtype: str, shape: Sequence[int]) -> int:
        if not self.sender:
            raise EngineError("send() called on the receiving end of a channel")
        # Serialize now, as TF does when the tensor is sent: the caller may reuse its buffer.
        msg = TensorMessage(
            dtype=dtype, shape=list(shape), tensor_content=a.tobytes(), channel=self.name, seq=self.sequence
        )
        self.wait_acked(self.sequence - 1)  # at most two messages outstanding, like the native channels
        self.backend.mailbox.put(self.name, self.sequence, msg)
        self.backend.count("writes", a.nbytes)
        self.sequence += 1
        return self.sequence - 1

    def _recv(self) -> Any:
        if self.sender:
            raise EngineError("recv() called on the sending end of a channel")
        start = time.monotonic()
        msg = self.backend.rpc(self.peer, "RecvTensor", TensorMessage(channel=self._remote_name, seq=self.sequence))
        self.backend.count_wait(time.monotonic() - start)
        self.backend.count("reads", len(msg.tensor_content))
        self.backend.count_received(len(msg.tensor_content))
        self.sequence += 1
        return msg


class GrpcStaticChannel(_GrpcChannel):
    """A channel of fixed-size messages."""

    def __init__(self, backend: GrpcBackend, sender: bool, peer: int, nbytes: int):
        super().__init__(backend, sender, peer)
        self.nbytes = nbytes

    def send(self, data: Any) -> None:
        a = np.asarray(data)
        if a.nbytes != self.nbytes:
            raise EngineError(f"static channel carries {self.nbytes} bytes per message, got {a.nbytes}")
        self._send(a, "|u1", [a.nbytes])

    def recv(self) -> np.ndarray:
        return np.frombuffer(self._recv().tensor_content, dtype=np.uint8).copy()  # writable, as TF allocates


class GrpcDynamicChannel(_GrpcChannel):
    """A channel whose tensors carry their dtype and shape."""

    def send(self, data: Any, dtype: str, shape: Sequence[int]) -> int:
        return self._send(np.asarray(data), dtype, shape)

    def recv(self) -> tuple[np.ndarray, str, tuple[int, ...]]:
        msg = self._recv()
        return np.frombuffer(msg.tensor_content, dtype=np.uint8).copy(), msg.dtype, tuple(msg.shape)


def _field(descriptor: str, key: str) -> str:
    return dict(kv.split("=", 1) for kv in descriptor.split(";")[1:])[key]


class GrpcRing:
    """Ring allreduce over gRPC channels, as TensorFlow's gRPC collective does it:
    reduce-scatter then allgather, every chunk a serialized RPC message."""

    def __init__(self, backend: GrpcBackend, capacity_bytes: int, members: list[int]):
        n, r = len(members), members.index(backend.rank)
        self.n, self.position, self.capacity = n, r, capacity_bytes
        left, right = members[(r - 1) % n], members[(r + 1) % n]
        self._tx = backend.dynamic_channel(True, right) if n > 1 else None
        self._rx = backend.dynamic_channel(False, left) if n > 1 else None
        tx, rx = (self._tx.name, self._rx.name) if self._tx and self._rx else ("", "")
        self.descriptor = f"ring;rank={backend.rank};tx={tx};rx={rx};capacity={capacity_bytes}"

    def connect(self, left: str, right: str) -> None:
        for d in (left, right):
            if int(_field(d, "capacity")) != self.capacity:
                raise EngineError(f"allreduce: rank {_field(d, 'rank')} declared another capacity ({d})")
        assert self._tx is not None and self._rx is not None
        self._rx.connect(f"channel;name={_field(left, 'tx')}")  # we pull what the left member sends us
        self._tx.connect(f"channel;name={_field(right, 'rx')}")

    def allreduce(self, arrays: Sequence[np.ndarray], average: bool = False) -> list[np.ndarray]:
        flat = np.concatenate([np.asarray(a).ravel() for a in arrays]) if arrays else np.zeros(0, np.float32)
        if flat.nbytes > self.capacity:
            raise EngineError(f"allreduce of {flat.nbytes} bytes exceeds this ring's capacity of {self.capacity}")
        n, r = self.n, self.position
        if n > 1:
            assert self._tx is not None and self._rx is not None
            chunks = np.array_split(flat, n)
            for s in range(n - 1):
                c = chunks[(r - s) % n]
                self._tx.send(c, c.dtype.str, c.shape)
                k = (r - s - 1) % n
                chunks[k] = chunks[k] + self._rx.recv()[0].view(flat.dtype)
            for s in range(n - 1):
                c = chunks[(r + 1 - s) % n]
                self._tx.send(c, c.dtype.str, c.shape)
                chunks[(r - s) % n] = self._rx.recv()[0].view(flat.dtype)
            flat = np.concatenate(chunks)
        if average:
            flat = flat / n
        out, at = [], 0
        for a in arrays:
            out.append(flat[at : at + a.size].reshape(a.shape).astype(a.dtype, copy=False))
            at += a.size
        return out
