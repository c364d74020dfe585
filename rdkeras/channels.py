"""This rank's ends of the engine's channels and rings, as :class:`rdkeras.Engine` hands them out.

Each wraps the backend's end (:mod:`rdkeras.transports.base`) with what the face adds: numpy
and DLPack in and out, shapes and dtypes, and a clear error for the other end's call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from rdkeras.errors import EngineError
from rdkeras.transports.base import Doubling, DynamicChannelEnd, HierarchicalRing, StaticChannelEnd
from rdkeras.transports.base import Ring as RingEnd


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
