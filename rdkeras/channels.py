"""This rank's ends of the engine's channels and rings, as :class:`rdkeras.Engine` hands them out.

Each wraps the backend's end (:mod:`rdkeras.transports.base`) with what the face adds: numpy
and DLPack in and out, shapes and dtypes, and a clear error for the other end's call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rdkeras.errors import EngineError
from rdkeras.transports.base import Doubling, DynamicChannelEnd, HierarchicalRing, NativeBackend, StaticChannelEnd
from rdkeras.transports.base import Ring as RingEnd

if TYPE_CHECKING:
    from rdkeras.transports.base import Backend, Capabilities


def as_buffer(x: Any) -> Any:
    """A zero-copy view of `x` the engine can read: numpy arrays and buffer-protocol
    objects as they are, DLPack producers (TensorFlow, PyTorch, JAX tensors on the
    CPU) through ``np.from_dlpack``."""
    if isinstance(x, (np.ndarray, bytes, bytearray, memoryview)):
        return x
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return x


def _wrong_end(kind: str, name: str, sending: bool, called: str) -> EngineError:
    role, use = ("sends", "send()") if sending else ("receives", "recv()")
    return EngineError(f"{kind} channel {name!r}: {called}() on the rank that {role} on it; call {use} here")


class StaticChannel:
    """This rank's end of a static channel: :meth:`send` on the sending rank (one remote write plus a
    flag), :meth:`recv` on the receiving rank. ``channel`` is the backend's end (benchmarks time it)."""

    def __init__(self, name: str, end: StaticChannelEnd, sending: bool, shape: tuple[int, ...], dtype: np.dtype):
        self.name, self.channel, self.sending, self.shape, self.dtype = name, end, sending, shape, dtype

    def send(self, array: Any) -> None:
        """Writes `array` (numpy, buffer or DLPack tensor) into the receiver's slot."""
        if not self.sending:
            raise _wrong_end("static", self.name, self.sending, "send")
        a = np.asarray(as_buffer(array))
        if a.shape != self.shape or a.dtype != self.dtype:
            raise ValueError(f"static channel carries {self.dtype}{list(self.shape)}, got {a.dtype}{list(a.shape)}")
        self.channel.send(np.asarray(a, order="C"))

    def recv(self) -> np.ndarray:
        """The next tensor, in place in the registered slot: valid until the next recv().

        The array exports DLPack, so ``tf.experimental.dlpack.from_dlpack(y.__dlpack__())``
        aliases it without a copy.
        """
        if self.sending:
            raise _wrong_end("static", self.name, self.sending, "recv")
        return self.channel.recv().view(self.dtype).reshape(self.shape)


class DynamicChannel:
    """This rank's end of a dynamic channel: the sender publishes metadata, the receiver allocates and
    reads the data one-sidedly."""

    def __init__(self, name: str, end: DynamicChannelEnd, sending: bool):
        self.name, self.channel, self.sending = name, end, sending
        self._inflight: deque[tuple[int, np.ndarray]] = deque()

    def send(self, array: Any) -> None:
        """Publishes `array`; the engine keeps it alive until the receiver has read it."""
        if not self.sending:
            raise _wrong_end("dynamic", self.name, self.sending, "send")
        a = np.asarray(as_buffer(array), order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        seq = self.channel.send(a, a.dtype.str, list(a.shape))
        self._inflight.append((seq, a))
        acked = self.channel.acked
        while self._inflight and self._inflight[0][0] < acked:
            self._inflight.popleft()

    def flush(self) -> None:
        """Sender: waits until the receiver has read everything sent."""
        if not self.sending:
            raise _wrong_end("dynamic", self.name, self.sending, "flush")
        self.channel.wait_acked(self.channel.sequence)
        self._inflight.clear()

    def recv(self) -> np.ndarray:
        """The next tensor, in a registered buffer the returned array owns."""
        if self.sending:
            raise _wrong_end("dynamic", self.name, self.sending, "recv")
        buf, dtype, shape = self.channel.recv()
        return buf.view(np.dtype(dtype)).reshape(shape)


class Ring:
    """An allreduce among `members` -- a ring (in ring order), or the engine's recursive doubling -- set up once;
    call it once per exchange."""

    def __init__(self, name: str, end: RingEnd | Doubling, members: list[int]):
        self.name, self.end, self.members = name, end, members

    @property
    def capacity(self) -> int:
        """Bytes (all tensors of one call, padded) the group's registered block holds."""
        return self.end.capacity

    def __call__(
        self, arrays: Sequence[np.ndarray], average: bool = False, wire: str | None = None
    ) -> list[np.ndarray]:
        """Sums (or averages) float arrays over the members; every member passes the same sizes and dtype.
        The outputs are views of registered memory, valid until the next-but-one call. `wire` ("float16",
        "bfloat16"; engine groups only): float32 travels so, summed in float32 at every hop; the outputs are then
        fresh float32 arrays."""
        if wire is None:
            return self.end.allreduce(arrays, average)
        return cast(HierarchicalRing, self.end).allreduce(arrays, average, wire)

    def hierarchical(
        self,
        arrays: Sequence[np.ndarray],
        average: bool,
        across: Ring,
        world: int,
        wire: str | None = None,
        within: bool = False,
    ) -> list[np.ndarray]:
        """The sum over hosts (this ring: the members on this host; `across`: the members at this rank's
        position on every host), divided by `world` for the average; views as :meth:`__call__`'s. `wire`: the
        type float32 crosses hosts as (`within`: inside each host too; the outputs are then fresh arrays). Engine
        rings only (a backend whose spec says ``hierarchical``)."""
        inside, other = cast(HierarchicalRing, self.end), cast(HierarchicalRing, across.end)
        return inside.allreduce_hierarchical(arrays, average, other, world, wire, within)


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    """Bytes of an array of `shape` and `dtype`, in Python integers (no silent int64 overflow)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class ChannelMaker:
    """The engine's channels and rings, made collectively by name (:class:`rdkeras.Engine` provides what is
    declared here): each end's descriptor goes to its peers through ``exchange``."""

    if TYPE_CHECKING:
        rank: int
        world_size: int
        transport: str
        backend: Backend
        capabilities: Capabilities
        _names: set[str]

        def _check_open(self, what: str) -> None: ...
        def exchange(self, name: str, value: bytes | None, sources: Sequence[int] | None = None) -> list[bytes]: ...

    def _pair(self, kind: str, name: str, src: int, dst: int, make: Any, spec: str) -> Any:
        self._check_open(f"channel {name!r}")
        for end in (src, dst):
            if not 0 <= end < self.world_size:
                raise ValueError(f"channel {name!r}: rank {end} is not in a world of {self.world_size}")
        if self.rank not in (src, dst) or src == dst:
            raise ValueError(f"channel {name!r} connects ranks {src}->{dst}; this is rank {self.rank}")
        if name in self._names:
            raise ValueError(f"channel name {name!r} is already used on this engine")
        self._names.add(name)
        sending = self.rank == src
        peer = dst if sending else src
        channel = make(sending, peer)
        (remote,) = self.exchange(f"ch/{kind}/{name}", f"{spec}\n{channel.descriptor}".encode(), [peer])
        remote_spec, remote_desc = remote.decode().split("\n", 1)
        if remote_spec != spec:
            raise ValueError(f"channel {name!r}: this rank declares {spec}, rank {peer} declares {remote_spec}")
        channel.connect(remote_desc)
        return channel

    def static_channel(self, name: str, src: int, dst: int, shape: Sequence[int], dtype: Any) -> StaticChannel:
        """A channel for tensors of one fixed shape and dtype (a pre-registered destination).

        Both ranks call this with the same arguments; `src` sends on its end, `dst` receives.
        """
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        if any(s < 0 for s in shape):
            raise ValueError(f"static channel {name!r} needs a fully known shape, got {shape}")
        nbytes = _nbytes(shape, dtype)
        end = self._pair(
            "static",
            name,
            src,
            dst,
            lambda sender, peer: self.backend.static_channel(sender, peer, nbytes),
            f"{dtype.str}{list(shape)}",
        )
        return StaticChannel(name, end, self.rank == src, shape, dtype)

    def dynamic_channel(self, name: str, src: int, dst: int) -> DynamicChannel:
        """A channel for tensors whose shape/dtype is known only at run time; `src` sends, `dst` receives."""
        end = self._pair(
            "dynamic",
            name,
            src,
            dst,
            lambda sender, peer: self.backend.dynamic_channel(sender, peer),
            "dynamic",
        )
        return DynamicChannel(name, end, self.rank == src)

    def ring(
        self, name: str, capacity_bytes: int, bucket_bytes: int = 64 << 20, members: Sequence[int] | None = None
    ) -> Ring:
        """A ring allreduce over `members` (default: all ranks); collective: every member calls
        this with the same arguments.

        Call it: ``ring(arrays, average=False) -> list[np.ndarray]``; the outputs are views of
        registered memory, valid until the next-but-one call.
        """
        self._check_open(f"ring {name!r}")
        members = list(range(self.world_size)) if members is None else [int(m) for m in members]
        if capacity_bytes < 0 or bucket_bytes <= 0:
            raise ValueError(f"ring {name!r}: capacity_bytes must be >= 0 and bucket_bytes > 0")
        if self.rank not in members:
            raise ValueError(f"ring {name!r}: this rank ({self.rank}) is not among its members {members}")
        if name in self._names:
            raise ValueError(f"name {name!r} is already used on this engine")
        self._names.add(name)
        ring = self.backend.ring(capacity_bytes, bucket_bytes, members)
        if hasattr(ring, "name"):  # an engine ring: what a hung member's error calls its calls
            setattr(ring, "name", f"ring {name}")  # noqa: B010 (not part of the Ring protocol)
        n, at = len(members), members.index(self.rank)
        left, right = members[(at - 1) % n], members[(at + 1) % n]
        descs = self.exchange(f"ring/{name}", ring.descriptor.encode(), [left, right])
        if n > 1:
            ring.connect(descs[0].decode(), descs[1].decode())
        return Ring(name, ring, members)

    def doubling(self, name: str, capacity_bytes: int, members: Sequence[int] | None = None) -> Ring:
        """A recursive-doubling allreduce over `members` (default: all ranks): log2(N) messages of every byte,
        where a ring sends 2(N-1) of 1/N each -- faster for small tensors. Engine transports only (a spec that
        says ``hierarchical``); collective, as :meth:`ring`, and called the same way."""
        self._check_open(f"allreduce {name!r}")
        members = list(range(self.world_size)) if members is None else [int(m) for m in members]
        if not self.capabilities.runs("doubling"):
            raise ValueError(f"recursive doubling runs in the engine; transport {self.transport!r} has only its ring")
        if capacity_bytes < 0 or self.rank not in members:
            raise ValueError(f"allreduce {name!r}: capacity_bytes must be >= 0 and this rank among {members}")
        if name in self._names:
            raise ValueError(f"name {name!r} is already used on this engine")
        self._names.add(name)
        end = cast(NativeBackend, self.backend).doubling(capacity_bytes, members)
        end.name = f"doubling {name}"
        partners = [members[p] for p in end.partners]
        got = self.exchange(f"doubling/{name}", end.descriptor.encode(), partners)
        descriptors = [""] * len(members)
        for p, d in zip(end.partners, got, strict=True):
            descriptors[p] = d.decode()
        if len(members) > 1:
            end.connect(descriptors)
        return Ring(name, end, members)
