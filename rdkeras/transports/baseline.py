"""The Python baselines' common base: what a C++ ``Transport`` gets from ``csrc/engine`` for free.

A native transport (``csrc/transport/``) implements a few one-sided operations and gets
channels, rings and failure handling from the engine. The Python baselines (``grpc``,
``rpc+shm/tcp/verbs``) are built the same way: :class:`BaselineBackend` holds the region
table (keys, stale keys, bounds), the traffic counters, both channel ends (the native ones'
checks and errors, ``csrc/engine/channel.cc``) and one ring allreduce, and a baseline adds
only what makes it what it is:

- ``remote_write`` / ``remote_read`` / ``remote_flag``: region access, as its RPCs;
- ``link(sender, peer, message_bytes)``: one direction of one channel carrying whole
  messages in order (:class:`Link`): gRPC's receiver-pull RecvTensor, rpc's frames;
- ``connect``, ``close``, ``check_peer``, ``wait_flag``, its failure record
  (:class:`FailureRecord`, or the native engine's underneath) and a ``descriptor``.

Everything here is Python and numpy, as the baselines are: a received message is copied
where it lands, and the ring sums in numpy.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from rdkeras.errors import EngineError, PeerError, RemoteAccessError
from rdkeras.transports.base import BackendConfig, Buffer
from rdkeras.transports.baseline_channels import DynamicChannel, Link, RingAllreduce, StaticChannel, as_bytes

COUNTER_NAMES = (
    "registrations",
    "deregistrations",
    "bytes_registered",
    "cache_hits",
    "pool_allocations",
    "pool_reuses",
    "pool_bytes_reserved",
    "pool_bytes_in_use",
    "pool_bytes_discarded",
)
TRAFFIC_NAMES = ("bytes_written", "bytes_read", "writes", "reads", "flags", "bytes_received", "wait_seconds")


class RegionTable:
    """This rank's registered regions as requests from peers find them (servers look them up from their
    own threads). Keys are ``(slot + 1) << 32 | generation`` like the native table's, and a slot is never
    reused, so a deregistered key is stale for good."""

    def __init__(self, rank: int):
        self.rank = rank
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._regions: dict[int, np.ndarray] = {}
        self._slots = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, buffer: Buffer) -> int:
        view = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)  # holds the buffer alive
        if not view.flags.writeable:
            raise EngineError("register: the buffer is read-only (peers write into registered memory)")
        with self._lock:
            key = next(self._slots) << 32 | 1
            self._regions[key] = view
            self.counters["registrations"] += 1
            self.counters["bytes_registered"] += view.nbytes
        return key

    def remove(self, key: int) -> None:
        with self._lock:
            if self._regions.pop(key, None) is None:
                raise EngineError(f"deregister: no region with key {key:#x}")
            self.counters["deregistrations"] += 1

    def find(self, op: str, key: int, offset: int, length: int) -> np.ndarray:
        """The `length` bytes at `offset` of region `key`, or a RemoteAccessError saying what is wrong."""
        with self._lock:
            region = self._regions.get(key)
        if region is None:
            raise RemoteAccessError(
                f"{op}: rank {self.rank} has no region with key {key:#x} (stale: deregistered, or never registered)"
            )
        if offset > region.nbytes or length > region.nbytes - offset:
            raise RemoteAccessError(
                f"{op} of {length} bytes at offset {offset} is out of bounds of rank {self.rank}'s region "
                f"{key:#x} ({region.nbytes} bytes)"
            )
        return region[offset : offset + length]

    def store_flag(self, key: int, offset: int, value: int) -> None:
        if offset % 8:
            raise RemoteAccessError(f"flag offset {offset} is not 8-byte aligned")
        self.find("writeFlag", key, offset, 8).view(np.uint64)[0] = value


class FailureRecord:
    """The native engine's root-cause protocol (csrc/engine/engine.h), for a baseline that carries it
    itself: the first failure known here is latched and passed on to every other rank, and every error
    after it names the rank that failed, not a neighbour that left because of it."""

    def __init__(
        self, rank: int, world_size: int, tell: Callable[[int, int, int, str], None], on_latch: Callable[[], None]
    ):
        """`tell(peer, failed, reporter, why)` passes a record on (best effort); `on_latch` wakes waiters."""
        self.rank, self.world_size = rank, world_size
        self.failure: tuple[int, int, str] | None = None  # (failed rank, reporter, what), latched
        self._tell, self._on_latch = tell, on_latch
        self._lock = threading.Lock()

    def latch(self, failed: int, reporter: int, why: str) -> bool:
        """Records the first failure known (False: one was known already)."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = (failed, reporter, why)
        self._on_latch()
        if reporter != self.rank:  # pass a peer's record on: whoever sees this rank leave has heard it first
            threading.Thread(target=self.tell_others, args=(failed, reporter, why), daemon=True).start()
        return True

    def tell_others(self, failed: int, reporter: int, why: str) -> None:
        for r in range(self.world_size):
            if r not in (self.rank, failed, reporter):
                self._tell(r, failed, reporter, why)

    def described(self, lost: int | None = None) -> PeerError:
        assert self.failure is not None
        failed, reporter, why = self.failure
        if reporter == self.rank:
            err = PeerError(why)
        else:
            then = f"; this rank then lost rank {lost}" if lost is not None and lost != failed else ""
            err = PeerError(f"rank {failed} failed: {why} (seen by rank {reporter}){then}")
        err.rank = failed
        return err

    def root_cause(self, peer: int, message: str) -> PeerError:
        """`peer` failed as seen here: the failure known first, else this one, told to every other rank."""
        if self.failure is None and self.latch(peer, self.rank, message):
            self.tell_others(peer, self.rank, message)  # before raising: they hear it before we leave
        return self.described(lost=peer)

    def report(self, rank: int, why: str) -> None:
        if self.failure is None and rank == self.rank and self.latch(rank, rank, why):
            self.tell_others(rank, rank, why)  # an error of this rank's own: nobody waits for it any longer
        elif self.failure is None and 0 <= rank < self.world_size:
            self.root_cause(rank, why)

    def check(self) -> None:
        if self.failure is not None:
            raise self.described()


class BaselineBackend(ABC):
    """The Backend interface (rdkeras.transports.base) in Python, less what a baseline adds (see above)."""

    descriptor: str
    # Where a static channel's messages land: two buffers in turn (RPC-managed memory, reused), or a
    # fresh one each (as TensorFlow's RecvTensor allocates a tensor per message).
    reuses_landing = False

    def __init__(self, config: BackendConfig):
        self.rank, self.world_size, self.timeout = config.rank, config.world_size, config.timeout
        self.regions = RegionTable(self.rank)
        self._traffic: dict[str, float] = dict.fromkeys(TRAFFIC_NAMES, 0)
        self._traffic["wait_seconds"] = 0.0

    # -- what a baseline implements ---------------------------------------------------

    @abstractmethod
    def connect(
        self, descriptors: Sequence[str], key: bytes, watch: Callable[[], None] | None = None, timeout: float = 0.0
    ) -> None: ...
    def begin_close(self) -> None:  # noqa: B027 (a baseline's waits end at close(), or at their timeout)
        """See rdkeras.transports.base.Backend.begin_close."""

    @abstractmethod
    def close(self) -> None: ...
    @abstractmethod
    def remote_write(self, peer: int, data: np.ndarray, key: int, offset: int) -> None: ...
    @abstractmethod
    def remote_read(self, peer: int, into: np.ndarray, key: int, offset: int) -> None: ...
    @abstractmethod
    def remote_flag(self, peer: int, key: int, offset: int, value: int) -> None: ...
    @abstractmethod
    def check_peer(self, peer: int) -> None: ...
    @abstractmethod
    def wait_flag(self, buffer: Buffer, offset: int, value: int, peer: int) -> None: ...
    @abstractmethod
    def link(self, sender: bool, peer: int, message_bytes: int | None) -> Link:
        """One end of a link to `peer` for messages of up to `message_bytes` (None: any size): the link
        holds two such messages, so its sender waits only when two are unread."""

    @property
    @abstractmethod
    def failure(self) -> tuple[int, int, str] | None: ...
    @abstractmethod
    def report_failure(self, rank: int, why: str) -> None: ...

    # -- registered memory --------------------------------------------------------------

    def alloc(self, nbytes: int) -> np.ndarray:
        """Uninitialized, as the native engine's (and as numpy allocates a tensor it is about to fill)."""
        raw = np.empty(nbytes + 64, dtype=np.uint8)
        at = -raw.ctypes.data % 64
        return raw[at : at + nbytes]

    def register(self, buffer: Buffer) -> int:
        return self.regions.add(buffer)

    def deregister(self, key: int) -> None:
        self.regions.remove(key)

    def counters(self) -> dict[str, int]:
        return dict(self.regions.counters)

    # -- one-sided access -------------------------------------------------------------------

    def write(self, peer: int, src: Buffer, key: int, offset: int = 0) -> None:
        data = as_bytes(src)
        self.remote_write(peer, data, key, offset)
        self.count("writes", data.nbytes)

    def read(self, peer: int, dst: Buffer, key: int, offset: int = 0) -> None:
        into = np.frombuffer(memoryview(dst).cast("B"), dtype=np.uint8)
        if not into.flags.writeable:
            raise EngineError("read: the destination is read-only")
        self.remote_read(peer, into, key, offset)
        self.count("reads", into.nbytes)

    def write_flag(self, peer: int, key: int, offset: int, value: int) -> None:
        self.remote_flag(peer, key, offset, value)
        self._traffic["flags"] += 1

    def flush(self, peer: int) -> None:
        self.check_peer(peer)  # every operation waited for its reply

    # -- what happened ------------------------------------------------------------------------

    def traffic(self) -> dict[str, float]:
        return dict(self._traffic)

    def count(self, kind: str, nbytes: int) -> None:
        """Adds one operation of `kind` ("writes" or "reads") moving `nbytes`."""
        self._traffic["bytes_written" if kind == "writes" else "bytes_read"] += nbytes
        self._traffic[kind] += 1

    def count_received(self, nbytes: int) -> None:
        self._traffic["bytes_received"] += nbytes

    def count_wait(self, seconds: float) -> None:
        self._traffic["wait_seconds"] += seconds

    # -- channels and rings ------------------------------------------------------------------

    def static_channel(self, sender: bool, peer: int, nbytes: int) -> StaticChannel:
        return StaticChannel(self, sender, peer, nbytes)

    def dynamic_channel(self, sender: bool, peer: int) -> DynamicChannel:
        return DynamicChannel(self, sender, peer)

    def ring(self, capacity_bytes: int, bucket_bytes: int, members: Sequence[int]) -> RingAllreduce:
        return RingAllreduce(self, capacity_bytes, list(members))
