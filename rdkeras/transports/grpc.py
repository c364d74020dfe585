"""grpc: the RPC baseline the paper beats, behind the engine's API.

Tensors travel as TensorProto-style protobuf messages (dtype, shape,
tensor_content) through grpcio, the way TensorFlow's gRPC runtime moves them:
serialized on the sender, copied through RPC-managed buffers, deserialized on
the receiver. Channels are receiver-pull like TF's RecvTensor. One-sided
region access becomes Write/Read/Flag RPCs so the conformance tests apply.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from rdkeras import _engine
from rdkeras.errors import EngineError, PeerError, RemoteAccessError, TimeoutError  # noqa: A004

_SERVICE = "rdkeras.Baseline"
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


class _Counters:
    """Counters in the shape of the native tracker's (grpc registers nothing)."""

    def __init__(self, registrations: int, bytes_registered: int):
        self.registrations, self.bytes_registered = registrations, bytes_registered

    def as_dict(self) -> dict[str, int]:
        return {"registrations": self.registrations, "bytes_registered": self.bytes_registered, "cache_hits": 0}


class GrpcEngine:
    """Same surface as rdkeras._engine.Engine, over gRPC."""

    def __init__(self, rank: int, world_size: int, timeout: float, advertise_host: str = "127.0.0.1"):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._regions: dict[int, np.ndarray] = {}
        self._next_key = itertools.count(1)
        self._registrations = 0
        self._bytes_registered = 0
        self._traffic = {"bytes_written": 0, "bytes_read": 0, "writes": 0, "reads": 0, "flags": 0}
        self._traffic.update(bytes_received=0, wait_seconds=0.0)
        self._outbox: dict[tuple[str, int], Any] = {}  # (channel, seq) -> message
        self._pulled: dict[str, int] = {}  # channel -> messages the receiver took
        self._cond = threading.Condition()
        self._secret = ""
        self._stubs: dict[int, dict[str, Any]] = {}
        self._grpc_channels: list[grpc.Channel] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=_OPTIONS)
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(self, f"_rpc_{name.lower()}"),
                request_deserializer=TensorMessage.FromString,
                response_serializer=TensorMessage.SerializeToString,
            )
            for name in ("Write", "Read", "Flag", "RecvTensor", "Ping")
        }
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_SERVICE, handlers)])
        self._port = self._server.add_insecure_port(f"{advertise_host}:0")
        self._server.start()
        self.descriptor = f"grpc;host={advertise_host};port={self._port}"

    # Expose the classes the Engine face instantiates for channels.
    @staticmethod
    def StaticChannel(engine: GrpcEngine, role: Any, peer: int, nbytes: int) -> _GrpcChannel:  # noqa: N802
        return _GrpcChannel(engine, role, peer, nbytes)

    @staticmethod
    def DynamicChannel(engine: GrpcEngine, role: Any, peer: int) -> _GrpcChannel:  # noqa: N802
        return _GrpcChannel(engine, role, peer, None)

    def connect(self, descriptors: list[str], secret: str) -> None:
        self._secret = secret
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
                for name in ("Write", "Read", "Flag", "RecvTensor", "Ping")
            }

    # -- client side -----------------------------------------------------------

    def _call(self, peer: int, name: str, msg: Any, timeout: float | None = None) -> Any:
        if peer not in self._stubs:
            raise EngineError(f"grpc: no connection to rank {peer}")
        try:
            return self._stubs[peer][name](
                msg, timeout=timeout or self.timeout, metadata=(("rdkeras-secret", self._secret),)
            )
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise RemoteAccessError(e.details()) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(
                    f"grpc: timed out after {timeout or self.timeout:g} s waiting for rank {peer} ({name})"
                ) from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise PeerError(f"rank {peer} is unreachable over grpc (process exited?): {e.details()}") from None
            raise EngineError(f"grpc {name} to rank {peer} failed: {code.name} {e.details()}") from None

    def traffic(self) -> dict[str, float]:
        return dict(self._traffic)

    def count_received(self, nbytes: int) -> None:
        self._traffic["bytes_received"] += nbytes

    def count(self, kind: str, nbytes: int = 0) -> None:
        self._traffic[f"bytes_{'written' if kind == 'writes' else 'read'}"] += nbytes
        self._traffic[kind] += 1

    def write(self, peer: int, src: Any, key: int, offset: int = 0) -> None:
        data = memoryview(src).tobytes()
        self._call(peer, "Write", TensorMessage(key=key, offset=offset, tensor_content=data))
        self.count("writes", len(data))

    def read(self, peer: int, dst: Any, key: int, offset: int = 0) -> None:
        view = memoryview(dst).cast("B")
        reply = self._call(peer, "Read", TensorMessage(key=key, offset=offset, length=view.nbytes))
        view[:] = reply.tensor_content
        self.count("reads", view.nbytes)

    def write_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        self._call(peer, "Flag", TensorMessage(key=key, offset=offset, value=value))
        self._traffic["flags"] += 1

    def flush(self, peer: int) -> None:
        self.check_peer(peer)  # every call above is synchronous

    def check_peer(self, peer: int) -> None:
        self._call(peer, "Ping", TensorMessage(), timeout=min(self.timeout, 5.0))

    def wait_flag(self, buffer: Any, offset: int, value: int, peer: int) -> None:
        flag = np.frombuffer(memoryview(buffer).cast("B")[offset : offset + 8], dtype=np.uint64)
        self._poll(lambda: int(flag[0]) >= value, peer, "flag")

    def _poll(self, ready: Any, peer: int, what: str) -> None:
        start = time.monotonic()
        deadline = start + self.timeout
        next_ping = start + 0.5
        try:
            self._wait_until(ready, peer, what, deadline, next_ping)
        finally:
            self._traffic["wait_seconds"] += time.monotonic() - start

    def _wait_until(self, ready: Any, peer: int, what: str, deadline: float, next_ping: float) -> None:
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"timed out after {self.timeout:g} s waiting for rank {peer} ({what})")
            if now >= next_ping:
                self.check_peer(peer)
                next_ping = now + 0.5
            time.sleep(0.0002)

    # -- regions -----------------------------------------------------------------

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def register(self, array: Any) -> int:
        view = np.frombuffer(memoryview(array).cast("B"), dtype=np.uint8)
        key = next(self._next_key) << 32 | 1
        self._regions[key] = view
        self._registrations += 1
        self._bytes_registered += view.nbytes
        return key

    def deregister(self, key: int) -> None:
        if self._regions.pop(key, None) is None:
            raise EngineError(f"deregister: no region with key {key:#x}")

    def counters(self) -> _Counters:
        return _Counters(self._registrations, self._bytes_registered)

    def close(self) -> None:
        self._server.stop(grace=None)
        for ch in self._grpc_channels:
            ch.close()

    # -- server side -------------------------------------------------------------

    def _authorized(self, context: Any) -> bool:
        if dict(context.invocation_metadata()).get("rdkeras-secret") != self._secret:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong job secret")
        return True

    def _region(self, op: str, req: Any, length: int, context: Any) -> np.ndarray:
        self._authorized(context)
        region = self._regions.get(req.key)
        if region is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"{op}: rank {self.rank} has no region with key {req.key:#x} (stale: deregistered, "
                "or never registered)",
            )
        if req.offset > region.nbytes or length > region.nbytes - req.offset:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{op} of {length} bytes at offset {req.offset} is out of bounds of rank {self.rank}'s "
                f"region {req.key:#x} ({region.nbytes} bytes)",
            )
        return region

    def _rpc_write(self, req: Any, context: Any) -> Any:
        region = self._region("write", req, len(req.tensor_content), context)
        region[req.offset : req.offset + len(req.tensor_content)] = np.frombuffer(req.tensor_content, np.uint8)
        return TensorMessage()

    def _rpc_read(self, req: Any, context: Any) -> Any:
        region = self._region("read", req, req.length, context)
        return TensorMessage(tensor_content=region[req.offset : req.offset + req.length].tobytes())

    def _rpc_flag(self, req: Any, context: Any) -> Any:
        if req.offset % 8:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"flag offset {req.offset} is not 8-byte aligned")
        region = self._region("writeFlag", req, 8, context)
        region[req.offset : req.offset + 8].view(np.uint64)[0] = req.value
        return TensorMessage()

    def _rpc_ping(self, req: Any, context: Any) -> Any:
        self._authorized(context)
        return TensorMessage()

    def _rpc_recvtensor(self, req: Any, context: Any) -> Any:
        self._authorized(context)
        key = (req.channel, req.seq)
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._outbox:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"rank {self.rank} never sent {key}")
                self._cond.wait(min(left, 0.5))
            msg = self._outbox.pop(key)
            self._pulled[req.channel] = req.seq + 1
            self._cond.notify_all()
        return msg


class _GrpcChannel:
    """A static or dynamic channel over gRPC (the baseline has no difference)."""

    _ids = itertools.count()

    def __init__(self, engine: GrpcEngine, role: Any, peer: int, nbytes: int | None):
        self.engine, self.role, self.peer, self.nbytes = engine, role, peer, nbytes
        self.name = f"{engine.rank}:{next(self._ids)}"
        self.sequence = 0
        self._remote_name = ""
        self.descriptor = f"channel;name={self.name}"

    def connect(self, remote: str) -> None:
        self._remote_name = remote.split("name=", 1)[1]

    @property
    def acked(self) -> int:
        with self.engine._cond:
            return self.engine._pulled.get(self.name, 0)

    def wait_acked(self, count: int) -> None:
        self.engine._poll(lambda: self.acked >= count, self.peer, "receiver to pull")

    def send(self, data: Any, dtype: str = "|u1", shape: Any = None) -> int:
        if self.role != _engine.Role.SENDER:
            raise EngineError("send() called on the receiving end of a channel")
        a = np.asarray(data)
        if self.nbytes is not None and a.nbytes != self.nbytes:
            raise EngineError(f"static channel carries {self.nbytes} bytes per message, got {a.nbytes}")
        # Serialize now, as TF does when the tensor is sent: the caller may reuse its buffer.
        msg = TensorMessage(
            dtype=dtype,
            shape=list(a.shape if shape is None else shape),
            tensor_content=a.tobytes(),
            channel=self.name,
            seq=self.sequence,
        )
        self.wait_acked(self.sequence - 1)  # at most two messages outstanding, like the native channels
        with self.engine._cond:
            self.engine._outbox[(self.name, self.sequence)] = msg
            self.engine._cond.notify_all()
        self.engine.count("writes", a.nbytes)
        self.sequence += 1
        return self.sequence - 1

    def recv(self) -> Any:
        if self.role != _engine.Role.RECEIVER:
            raise EngineError("recv() called on the sending end of a channel")
        start = time.monotonic()
        msg = self.engine._call(self.peer, "RecvTensor", TensorMessage(channel=self._remote_name, seq=self.sequence))
        self.engine._traffic["wait_seconds"] += time.monotonic() - start
        self.engine.count("reads", len(msg.tensor_content))
        self.engine.count_received(len(msg.tensor_content))
        self.sequence += 1
        buf = np.frombuffer(msg.tensor_content, dtype=np.uint8).copy()  # a writable tensor, as TF allocates
        if self.nbytes is not None:
            return buf
        return buf, msg.dtype, tuple(msg.shape)


class ChannelRing:
    """Ring allreduce over the engine's channel API, as TensorFlow's gRPC collective does it:
    reduce-scatter then allgather, every chunk a serialized RPC message."""

    def __init__(self, engine: Any, name: str, capacity_bytes: int, members: list[int]):
        n, r = len(members), members.index(engine.rank)
        self.n, self.rank, self.capacity = n, r, capacity_bytes
        if n > 1:
            me, left, right = members[r], members[(r - 1) % n], members[(r + 1) % n]
            # Each creation waits for the peer's; alternate the order around the ring so no two wait on each other.
            if r % 2 == 0:
                self._tx = engine.dynamic_channel(f"{name}/{me}->{right}", me, right)
                self._rx = engine.dynamic_channel(f"{name}/{left}->{me}", left, me)
            else:
                self._rx = engine.dynamic_channel(f"{name}/{left}->{me}", left, me)
                self._tx = engine.dynamic_channel(f"{name}/{me}->{right}", me, right)

    def __call__(self, arrays: list[np.ndarray], average: bool = False) -> list[np.ndarray]:
        flat = np.concatenate([np.asarray(a).ravel() for a in arrays]) if arrays else np.zeros(0, np.float32)
        if flat.nbytes > self.capacity:
            raise EngineError(f"allreduce of {flat.nbytes} bytes exceeds this ring's capacity of {self.capacity}")
        n, r = self.n, self.rank
        if n > 1:
            chunks = np.array_split(flat, n)
            for s in range(n - 1):
                self._tx.send(chunks[(r - s) % n])
                k = (r - s - 1) % n
                chunks[k] = chunks[k] + self._rx.recv()
            for s in range(n - 1):
                self._tx.send(chunks[(r + 1 - s) % n])
                chunks[(r - s) % n] = self._rx.recv()
            flat = np.concatenate(chunks)
        if average:
            flat = flat / n
        out, at = [], 0
        for a in arrays:
            out.append(flat[at : at + a.size].reshape(a.shape).astype(a.dtype, copy=False))
            at += a.size
        return out
