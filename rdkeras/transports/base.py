"""The backend interface: what every transport implements, declared once.

A backend is one process's endpoint in a fixed world of ranks: registered
memory, one-sided access to peers' memory as (key, offset, length), channels
and a ring allreduce. The native engine (``rdkeras._engine.Engine``: shm, tcp,
shm+tcp, verbs, in ``csrc/``) implements it in C++; the Python baselines (grpc,
rpc+*) on their common base, ``rdkeras.transports.baseline``. ``rdkeras.Engine``
(the face) talks to nothing else, so a new backend -- another baseline, another
fabric -- is one more implementation of these protocols plus one line in
``rdkeras.transports`` (the registry).

Lifecycle: created (listening), ``descriptor`` all-gathered through the
rendezvous store, ``connect(descriptors, key)``, used, ``close()``. Every
blocking call is bounded by the backend's timeout and raises
``rdkeras.errors.TimeoutError`` / ``PeerError`` naming the peer. Channels and
rings are created by the face on both ends, swap descriptors through the store
once, and are used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

Buffer = Any  # a buffer-protocol object (numpy array, memoryview, bytes)


@dataclass(frozen=True)
class TransportOptions:
    """Transport settings, passed down to the backend (transports never read the environment;
    :mod:`rdkeras.options` reads ``RDKERAS_IB_DEVICE``, ``RDKERAS_IB_PORT``, ``RDKERAS_IB_GID_INDEX`` and
    ``RDKERAS_NT_THRESHOLD`` into them)."""

    ib_device: str = ""  # verbs: device name; "" = the first with an active port
    ib_port: int = 0  # verbs: port; 0 = the first active one
    ib_gid_index: int = 0  # verbs: GID table index
    nt_threshold: int = 8 << 20  # shm copies and ring sums stream their stores from this size; 0 = never


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do for the collectives: the engine holds its transport's once
    (``Engine.capabilities``), and everything that depends on it asks there rather than branching on a name."""

    transport: str
    # Its rings run in the engine, which composes them: recursive doubling, the hierarchical allreduce across
    # hosts and 16-bit compression (the baselines' rings are flat, in Python, as TensorFlow's gRPC collective is).
    composes_rings: bool = True
    # The exchange's bytes are copied by this process's own cores (shm: a memcpy into the peer's memory), so
    # overlapping it with compute on the same cores only takes turns (rdkeras.parallel.collectives.buckets).
    copies_on_own_cores: bool = False
    # What a sum costs on it: seconds per message, per byte moved and per byte added (the engine's, on one core),
    # from which "auto" picks recursive doubling for small tensors (rdkeras.parallel.collectives.algorithms).
    # Fitted to ``python -m rdkeras.bench algorithms`` on a 2-core x86 VM (the sum: ~5 GB/s on one core).
    costs: tuple[float, float, float] = (50e-6, 0.7e-9, 0.2e-9)

    def runs(self, algorithm: str) -> bool:
        """Whether an allreduce `algorithm` ("ring", "hierarchical", "doubling") or a compression runs on it."""
        return algorithm == "ring" or self.composes_rings


@dataclass(frozen=True)
class BackendConfig:
    """What the face hands a backend factory."""

    rank: int
    world_size: int
    timeout: float
    arena_bytes: int
    advertise_host: str = "127.0.0.1"  # the address peers reach this rank at
    bind_host: str = "127.0.0.1"  # the address listeners bind (never 0.0.0.0 unless asked)
    options: TransportOptions = field(default_factory=TransportOptions)
    heartbeat_timeout: float = 30.0  # a neighbour silent this long is stalled (native transports; 0: none)
    progress_timeout: float = -1.0  # a collective's wait this long names a hung member (0: never; < 0: default)


@runtime_checkable
class StaticChannelEnd(Protocol):
    """One end of a fixed-size channel (one cut edge, one direction)."""

    @property
    def descriptor(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def sequence(self) -> int:
        """Messages sent or received so far."""

    @property
    def peer(self) -> int: ...

    def connect(self, remote_descriptor: str) -> None: ...
    def send(self, data: Buffer) -> None:
        """Sender: the message (exactly `nbytes` bytes) goes into the receiver's slot."""

    def recv(self) -> np.ndarray:
        """Receiver: the next message as uint8, valid until the next recv()."""


@runtime_checkable
class DynamicChannelEnd(Protocol):
    """One end of a channel whose tensors' shape and dtype are known only at run time."""

    @property
    def descriptor(self) -> str: ...
    @property
    def sequence(self) -> int: ...
    @property
    def peer(self) -> int: ...
    @property
    def acked(self) -> int:
        """Sender: messages whose source the receiver has finished reading."""

    def connect(self, remote_descriptor: str) -> None: ...
    def send(self, data: Buffer, dtype: str, shape: Sequence[int]) -> int:
        """Sender: publishes `data`; it must stay unchanged until ``acked`` exceeds the returned number."""

    def wait_acked(self, count: int) -> None: ...
    def recv(self) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """Receiver: (uint8 buffer the array owns, numpy dtype string, shape)."""


@runtime_checkable
class Ring(Protocol):
    """A ring allreduce among some ranks (in ring order)."""

    @property
    def descriptor(self) -> str: ...
    @property
    def capacity(self) -> int: ...

    def connect(self, left: str, right: str) -> None:
        """Takes the descriptors of the left and right members (not called for a ring of one)."""

    def allreduce(self, arrays: Sequence[np.ndarray], average: bool = False) -> list[np.ndarray]:
        """Sums (or averages) float arrays over the members; every member passes the same sizes and dtype."""


class ShardingRing(Ring, Protocol):
    """An engine ring's two halves on their own, over one flat buffer of members x equal shards (each a whole
    number of 64-byte lines), member p owning shard p: the layout sharded optimizers keep."""

    def reduce_scatter(self, array: np.ndarray, average: bool = False) -> np.ndarray:
        """This member's shard of the sum (mean) of every member's `array` (float32/float64)."""

    def reduce_scatter_parts(self, parts: Sequence[np.ndarray], average: bool = False) -> np.ndarray:
        """:meth:`reduce_scatter` of the consecutive `parts` of one buffer, read where they lie."""

    def allgather(self, shard: np.ndarray) -> np.ndarray:
        """Every member's `shard` (any dtype, the same bytes everywhere), in member order."""


class HierarchicalRing(Ring, Protocol):
    """An engine ring (a backend whose spec says ``hierarchical``), which also runs the hierarchical allreduce
    (this ring inside the host, `across` over the members at this position on every host) and casts float32 to a
    16-bit `wire` type ("float16", "bfloat16") where asked: the whole way, or between hosts only."""

    def allreduce(
        self, arrays: Sequence[np.ndarray], average: bool = False, wire: str | None = None
    ) -> list[np.ndarray]: ...

    def allreduce_hierarchical(
        self,
        arrays: Sequence[np.ndarray],
        average: bool,
        across: HierarchicalRing,
        world: int,
        wire: str | None = None,
        within: bool = False,
    ) -> list[np.ndarray]: ...


class Doubling(Protocol):
    """An engine's recursive-doubling allreduce among some ranks (a backend whose spec says ``hierarchical``)."""

    name: str  # what a hung member's error calls its calls

    @property
    def descriptor(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def partners(self) -> list[int]:
        """The member positions whose descriptors this one needs."""

    def connect(self, descriptors: Sequence[str]) -> None:
        """Takes every member's descriptor, in the members' order."""

    def allreduce(
        self, arrays: Sequence[np.ndarray], average: bool = False, wire: str | None = None
    ) -> list[np.ndarray]: ...


@runtime_checkable
class Backend(Protocol):
    """One process's endpoint: memory, one-sided operations, channels, rings."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def descriptor(self) -> str:
        """What peers need to connect to this rank (all-gathered through the store)."""

    def connect(
        self, descriptors: Sequence[str], key: bytes, watch: Callable[[], None] | None = None, timeout: float = 0.0
    ) -> None:
        """Connects to every peer (``descriptors[r]`` is rank r's). Peers prove to each other that they
        hold `key`, the job's 32-byte transport key, without sending it (docs/security.md). `watch`
        runs about every 100 ms while waiting for peers and raises to give up (a peer failed). `timeout`:
        seconds for the whole of it (0: the backend's timeout)."""

    def begin_close(self) -> None:
        """Closing begins (the face's close barrier comes next): no operation may start or go on, and another
        thread's wait ends with an error saying the engine was closed. The baselines' waits end at close()."""

    def close(self) -> None: ...

    # Registered memory.
    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 array of registered memory, 64-byte aligned."""

    def register(self, buffer: Buffer) -> int:
        """Registers a writable buffer; returns the key peers address it by. Keeps the buffer alive."""

    def deregister(self, key: int) -> None: ...

    # One-sided access to a peer's registered memory.
    def write(self, peer: int, src: Buffer, key: int, offset: int = 0) -> None: ...
    def read(self, peer: int, dst: Buffer, key: int, offset: int = 0) -> None: ...
    def write_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        """An 8-byte store, ordered after every earlier write to `peer`."""

    def flush(self, peer: int) -> None:
        """Waits until earlier operations to `peer` completed there; raises what it reported."""

    def check_peer(self, peer: int) -> None: ...
    def wait_flag(self, buffer: Buffer, offset: int, value: int, peer: int) -> None:
        """Waits until the local 8-byte flag at `offset` is >= value, watching `peer`."""

    # Channels and collectives.
    def static_channel(self, sender: bool, peer: int, nbytes: int) -> StaticChannelEnd: ...
    def dynamic_channel(self, sender: bool, peer: int) -> DynamicChannelEnd: ...
    def ring(self, capacity_bytes: int, bucket_bytes: int, members: Sequence[int]) -> Ring: ...

    # Failures and what happened.
    @property
    def failure(self) -> tuple[int, int, str] | None:
        """(failed rank, rank that saw it, what it saw) once any rank reported a failure, else None.

        The first rank to see a peer fail tells every other rank before it raises, so every
        survivor's PeerError names the rank that failed (``PeerError.rank``), not a neighbour.
        """

    def report_failure(self, rank: int, why: str) -> None:
        """The face learned (from the store) that `rank` failed -- or, where `rank` is this rank, that this
        rank stops on an error of its own: latch it and tell every other rank."""

    def counters(self) -> dict[str, int]:
        """Registration and pool counters (``registrations``, ``bytes_registered``, ``cache_hits``, ...)."""

    def traffic(self) -> dict[str, float]:
        """bytes_written, bytes_read, writes, reads, flags, bytes_received, wait_seconds."""

    def count_received(self, nbytes: int) -> None: ...


class NativeBackend(Backend, Protocol):
    """The engine's own backend (a spec that says ``hierarchical``): its collectives beyond the ring."""

    def doubling(self, capacity_bytes: int, members: Sequence[int]) -> Doubling: ...
