"""The Python baselines' channel ends and ring allreduce, over a baseline's links.

What ``csrc/engine/channel.cc`` and ``ring.cc`` are to a native transport: the native
channel ends' checks and errors, and one ring (reduce-scatter, then allgather), built on a
:class:`Link` -- whole messages, in order -- which each baseline implements its own way
(``rdkeras.transports.baseline.BaselineBackend.link``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rdkeras import _engine
from rdkeras.errors import EngineError
from rdkeras.transports.base import Buffer

if TYPE_CHECKING:
    from rdkeras.transports.baseline import BaselineBackend


def as_bytes(data: Any) -> np.ndarray:
    """A uint8 view of a message's bytes (numpy of any dtype, bytes, memoryview; C order)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """One copy, as a baseline makes it: large ones by glibc's memcpy with the GIL released."""
    if src.nbytes >= 1 << 16:
        _engine.memcpy(dst, src, False)  # type: ignore[arg-type]  # numpy's stubs lack __buffer__
    elif src.nbytes:
        dst[...] = src


def fields(descriptor: str) -> dict[str, str]:
    """ "kind;a=1;b=2" -> {"a": "1", "b": "2"}."""
    return dict(kv.split("=", 1) for kv in descriptor.split(";")[1:])


class Link(Protocol):
    """One direction of one channel as a baseline carries it: whole messages, in order (what a baseline
    implements for channels, as a C++ Transport implements ``write`` and ``writeFlag``)."""

    @property
    def descriptor(self) -> str:
        """What the other end's link connects to (no ';' or '|' in it)."""

    def connect(self, remote_descriptor: str) -> None: ...
    def send(self, seq: int, dtype: str, shape: Sequence[int], content: np.ndarray) -> None:
        """Sender: message `seq` (`content` is uint8; the link has copied it when this returns)."""

    def recv(self, seq: int, land: Callable[[Any, int], np.ndarray]) -> tuple[Any, np.ndarray]:
        """Receiver: message `seq` as (header, content): the header has the ``dtype`` and ``shape`` sent
        (a TensorMessage, parsed), the content is copied into ``land(header, nbytes)``."""

    @property
    def acked(self) -> int:
        """Sender: messages the receiver no longer needs from this side."""

    def wait_acked(self, count: int) -> None: ...


class _End:
    """One end of a channel over a baseline's link, with the native ends' checks and errors."""

    def __init__(self, backend: BaselineBackend, sender: bool, peer: int, message_bytes: int | None):
        if not 0 <= peer < backend.world_size or peer == backend.rank:
            raise EngineError(
                f"channel peer {peer} is not another rank of this world (size {backend.world_size}, "
                f"this rank {backend.rank})"
            )
        self.backend, self.sender, self.peer = backend, sender, peer
        self.sequence = 0
        self._link = backend.link(sender, peer, message_bytes)
        self._connected = False
        self.descriptor = (
            f"channel;role={'send' if sender else 'recv'};rank={backend.rank};link={self._link.descriptor}"
        )

    def connect(self, remote_descriptor: str) -> None:
        want, remote = ("recv" if self.sender else "send"), fields(remote_descriptor)
        if remote.get("role") != want or remote.get("rank") != str(self.peer):
            raise EngineError(
                f"channel descriptor mismatch: expected the {want} end on rank {self.peer}, got {remote_descriptor}"
            )
        self._link.connect(remote["link"])
        self._connected = True

    def _require(self, sender: bool, op: str) -> None:
        if self.sender != sender:
            raise EngineError(f"{op}() called on the {'sending' if self.sender else 'receiving'} end of a channel")
        if not self._connected:
            raise EngineError(f"{op}() before connect()")

    def _send(self, content: np.ndarray, dtype: str, shape: Sequence[int]) -> int:
        self._link.send(self.sequence, dtype, shape, content)
        self.backend.count("writes", content.nbytes)
        self.sequence += 1
        return self.sequence - 1

    def _recv(self, land: Callable[[Any, int], np.ndarray]) -> tuple[Any, np.ndarray]:
        header, content = self._link.recv(self.sequence, land)
        self.backend.count("reads", content.nbytes)
        self.backend.count_received(content.nbytes)
        self.sequence += 1
        return header, content


class StaticChannel(_End):
    """Fixed-size messages; a received one stays valid until the next recv()."""

    def __init__(self, backend: BaselineBackend, sender: bool, peer: int, nbytes: int):
        super().__init__(backend, sender, peer, nbytes)
        self.nbytes = nbytes
        self._landing = (
            [backend.alloc(max(nbytes, 1)) for _ in range(2)] if backend.reuses_landing and not sender else []
        )

    def send(self, data: Buffer) -> None:
        self._require(True, "send")
        content = as_bytes(data)
        if content.nbytes != self.nbytes:
            raise EngineError(
                f"static channel carries {self.nbytes} bytes per message, got {content.nbytes} "
                "(use a dynamic channel for changing shapes)"
            )
        self._send(content, "|u1", [content.nbytes])

    def recv(self) -> np.ndarray:
        self._require(False, "recv")

        def land(header: Any, n: int) -> np.ndarray:
            if n != self.nbytes:
                raise EngineError(f"static channel carries {self.nbytes} bytes per message, rank {self.peer} sent {n}")
            return self._landing[self.sequence % 2][:n] if self._landing else self.backend.alloc(n)

        return self._recv(land)[1]


class DynamicChannel(_End):
    """Messages that carry their dtype and shape; each lands in a fresh buffer the array owns."""

    def __init__(self, backend: BaselineBackend, sender: bool, peer: int):
        super().__init__(backend, sender, peer, None)

    def send(self, data: Buffer, dtype: str, shape: Sequence[int]) -> int:
        self._require(True, "send")
        return self._send(as_bytes(data), dtype, shape)

    def recv(self) -> tuple[np.ndarray, str, tuple[int, ...]]:
        self._require(False, "recv")
        header, content = self._recv(lambda header, n: self.backend.alloc(n))
        return content, header.dtype, tuple(header.shape)

    @property
    def acked(self) -> int:
        return self._link.acked

    def wait_acked(self, count: int) -> None:
        self._link.wait_acked(count)


class RingAllreduce:
    """Ring allreduce over a baseline's links, as TensorFlow's gRPC collective runs it: reduce-scatter, then
    allgather, every chunk a message (serialized, sent, deserialized on arrival), the sums in numpy."""

    def __init__(self, backend: BaselineBackend, capacity_bytes: int, members: list[int]):
        n, r = len(members), members.index(backend.rank)
        self.backend, self.n, self.position, self.capacity = backend, n, r, capacity_bytes
        self.descriptor = f"ring;rank={backend.rank};capacity={capacity_bytes}"
        if n > 1:
            chunk = math.ceil(capacity_bytes / n) + 64  # a chunk and its header: the links hold two
            self._tx = _End(backend, True, members[(r + 1) % n], chunk)
            self._rx = _End(backend, False, members[(r - 1) % n], chunk)
            self._scratch = backend.alloc(chunk)
            self._scratch[:] = 0  # fault the pages in now, not in the first call
            self.descriptor += f"|{self._tx.descriptor}|{self._rx.descriptor}"

    def connect(self, left: str, right: str) -> None:
        (left_head, left_tx, _), (right_head, _, right_rx) = left.split("|"), right.split("|")
        for head in (left_head, right_head):
            if int(fields(head)["capacity"]) != self.capacity:
                raise EngineError(
                    f"allreduce: rank {fields(head)['rank']} declared another capacity ({head}) than this rank "
                    f"({self.capacity} bytes)"
                )
        self._rx.connect(left_tx)  # each end checks it got the neighbour it expected
        self._tx.connect(right_rx)

    def _send(self, chunk: np.ndarray) -> None:
        self._tx._send(chunk.view(np.uint8), chunk.dtype.str, [chunk.size])

    def _recv_into(self, out: np.ndarray) -> None:
        def land(header: Any, n: int) -> np.ndarray:
            if n != out.nbytes:
                raise EngineError(f"allreduce: rank {self._rx.peer} sent a chunk of {n} bytes, expected {out.nbytes}")
            return out.view(np.uint8)

        self._rx._recv(land)

    def allreduce(self, arrays: Sequence[np.ndarray], average: bool = False) -> list[np.ndarray]:
        arrays = [np.asarray(a) for a in arrays]
        if not arrays:
            return []
        dtype = arrays[0].dtype
        if dtype.kind != "f" or dtype.itemsize not in (4, 8) or any(a.dtype != dtype for a in arrays):
            raise TypeError("allreduce supports float32 and float64 tensors, all of one dtype")
        # Each tensor starts on a 64-byte boundary, so TensorFlow can alias the outputs (the padding sums zeros).
        pad = 64 // dtype.itemsize
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-a.size // pad) * pad
        if total * dtype.itemsize > self.capacity:
            raise EngineError(
                f"allreduce of {total * dtype.itemsize} bytes exceeds this ring's capacity of {self.capacity} bytes"
            )
        flat = self.backend.alloc(max(total * dtype.itemsize, 1)).view(dtype)[:total]
        for a, at in zip(arrays, starts, strict=True):
            copy_bytes(flat[at : at + a.size].view(np.uint8), as_bytes(a))
            flat[at + a.size : at + -(-a.size // pad) * pad] = 0
        n, r = self.n, self.position
        if n > 1:
            bounds = [total * i // n for i in range(n + 1)]
            chunk = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
            for s in range(n - 1):  # reduce-scatter
                self._send(chunk[(r - s) % n])
                k = (r - s - 1) % n
                incoming = self._scratch[: chunk[k].nbytes].view(dtype)
                self._recv_into(incoming)
                np.add(chunk[k], incoming, out=chunk[k])
            for s in range(n - 1):  # allgather: straight into the output
                self._send(chunk[(r + 1 - s) % n])
                self._recv_into(chunk[(r - s) % n])
        if average:
            np.divide(flat, n, out=flat)
        return [flat[at : at + a.size].reshape(a.shape) for a, at in zip(arrays, starts, strict=True)]
