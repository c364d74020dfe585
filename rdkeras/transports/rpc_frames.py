"""The RPC baseline's framing: messages serialized as TensorMessages and split into frames written into the
receiver's ring of frame slots over a native transport (``rdkeras.transports.rpc`` says why)."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras.errors import EngineError
from rdkeras.transports.baseline_channels import copy_bytes
from rdkeras.transports.grpc import TensorMessage

if TYPE_CHECKING:
    from rdkeras.transports.rpc import RpcBackend

FRAME_BYTES = 1 << 20  # the largest frame: messages are split into frames this size
SERVICE_FRAMES = 8  # frame slots of a request/reply stream or a dynamic channel (8 MiB of buffer)
_HEADER = 64  # per frame slot: the flag word, alone in its cache line
_SLOT = _HEADER + FRAME_BYTES
_PREFIX = struct.Struct("<IIQ")  # header length, length of the content field's tag+varint, content bytes
_META_MAX = 4096  # a message's prefix + header + field prefix stays below this (in its first frame)
_CONTENT_TAG = b"\x1a"  # TensorMessage field 3 (tensor_content), wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _frames_for(nbytes: int) -> int:
    return max(1, math.ceil((nbytes + _META_MAX) / FRAME_BYTES))


def _fields(descriptor: str) -> dict[str, str]:
    """ "a=1 b=2" -> {"a": "1", "b": "2"}."""
    return dict(kv.split("=", 1) for kv in descriptor.split())


class _SendStream:
    """The sending half of one RPC connection: serializes messages and writes their frames into the
    receiver's frame slots (``_RecvStream``), waiting for a slot only when all are unread."""

    def __init__(self, backend: RpcBackend, peer: int, initial_bytes: int = 0):
        self.backend, self.peer = backend, peer
        inner = backend.inner
        self.ack = inner.alloc(64).view(np.uint64)  # frames the receiver has released
        self.ack[:] = 0
        self.ack_key = inner.register(self.ack)
        self.key = 0  # the receiver's slots, and how many
        self.slots = 0
        self.sent = 0
        self._buffer = inner.alloc(initial_bytes + _META_MAX) if initial_bytes else None
        if self._buffer is not None:
            self._buffer[:] = 0  # fault the pages in now, not on the first message

    def connect(self, key: int, slots: int) -> None:
        self.key, self.slots = key, slots

    def _staging(self, nbytes: int) -> np.ndarray:
        if self._buffer is None or self._buffer.nbytes < nbytes:
            self._buffer = self.backend.inner.alloc(
                max(nbytes, 2 * (0 if self._buffer is None else self._buffer.nbytes))
            )
        return self._buffer

    def send(self, header: Any, content: np.ndarray | None = None) -> None:
        """Serializes `header` (a TensorMessage without tensor_content) and `content` (uint8) and sends them."""
        if not self.key:
            raise EngineError(f"rpc: the stream to rank {self.peer} is not connected")
        head = header.SerializeToString()
        n = 0 if content is None else content.nbytes
        field = _CONTENT_TAG + _varint(n) if n else b""
        meta = _PREFIX.pack(len(head), len(field), n) + head + field
        if len(meta) > _META_MAX:
            raise EngineError(f"rpc: a message header of {len(meta)} bytes exceeds {_META_MAX}")
        total = len(meta) + n
        buf = self._staging(total)
        t0 = time.perf_counter()
        buf[: len(meta)] = np.frombuffer(meta, np.uint8)
        if content is not None:
            copy_bytes(buf[len(meta) : total], content)  # serialization: the tensor into the RPC buffer
        t1 = time.perf_counter()
        for start in range(0, total, FRAME_BYTES):
            self._frame(buf[start : min(total, start + FRAME_BYTES)])
        self.backend.count_time(copy=t1 - t0, wire=time.perf_counter() - t1)

    def _frame(self, piece: np.ndarray) -> None:
        inner, n = self.backend.inner, self.sent
        if n >= self.slots:  # every slot holds an unread frame: wait for the oldest to be released
            inner.wait_flag(self.ack, 0, n - self.slots + 1, self.peer)
        at = (n % self.slots) * _SLOT
        inner.write(self.peer, piece, self.key, at + _HEADER)
        inner.write_flag(self.peer, self.key, at, (n + 1) << 32 | piece.nbytes)  # ordered after the data
        self.sent += 1


class _RecvStream:
    """The receiving half: frame slots in registered memory the sender writes into, parsed on arrival."""

    def __init__(self, backend: RpcBackend, peer: int, slots: int):
        self.backend, self.peer, self.slots = backend, peer, slots
        inner = backend.inner
        self.block = inner.alloc(slots * _SLOT)
        self.flags = self.block.view(np.uint64)
        for s in range(slots):
            self.flags[s * _SLOT // 8] = 0
        self.key = inner.register(self.block)
        self.ack_key = 0  # the sender's ack word
        self.received = 0
        self.last_copy_seconds = 0.0

    def connect(self, ack_key: int) -> None:
        self.ack_key = ack_key

    def poke(self) -> None:
        """Wakes whoever waits for the next frame (closing: it finds no frame and gives up)."""
        self.flags[(self.received % self.slots) * _SLOT // 8] = np.uint64(1 << 63)

    def _next_frame(self) -> np.ndarray:
        n = self.received
        at = (n % self.slots) * _SLOT
        self.backend.inner.wait_flag(self.block, at, (n + 1) << 32, self.peer)
        flag = int(self.flags[at // 8])
        if flag >> 32 != n + 1:
            raise EngineError(f"rpc: the stream from rank {self.peer} was closed")
        return self.block[at + _HEADER : at + _HEADER + (flag & 0xFFFFFFFF)]

    def _release(self) -> None:
        self.received += 1
        self.backend.inner.write_flag(self.peer, self.ack_key, 0, self.received)

    def recv(self, destination: Callable[[Any, int], np.ndarray | None]) -> tuple[Any, np.ndarray | None]:
        """The next message: its header (parsed) and its content, deserialized into
        ``destination(header, nbytes)`` (a uint8 array; None: drop the content)."""
        frame = self._next_frame()
        head_len, field_len, n = _PREFIX.unpack_from(frame.data, 0)
        at = _PREFIX.size
        header = TensorMessage.FromString(frame[at : at + head_len].tobytes())
        at += head_len + field_len
        dest = destination(header, n)
        filled, copying = 0, 0.0
        while True:
            take = min(frame.nbytes - at, n - filled)
            if take and dest is not None:
                t0 = time.perf_counter()
                copy_bytes(dest[filled : filled + take], frame[at : at + take])  # merge + deserialize
                copying += time.perf_counter() - t0
            filled += take
            self._release()
            if filled >= n:
                self.backend.count_time(copy=copying)
                self.last_copy_seconds = copying  # callers count the rest of the receive as waiting
                return header, dest
            frame, at = self._next_frame(), 0
