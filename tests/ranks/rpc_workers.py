"""Worker functions for tests/multiproc/test_rpc_transport.py (run on every rank by run_ranks)."""

from __future__ import annotations

import numpy as np

import rdkeras
from rdkeras.transports.grpc import TensorMessage


def rpc_wire_format() -> dict:
    """Rank 0 sends one 3 MiB float32 tensor over a dynamic channel; both report what the inner wire saw."""
    x = np.arange(3 * 262144, dtype=np.float32).reshape(3, 262144)
    with rdkeras.Engine() as eng:
        ch = eng.dynamic_channel("t", 0, 1)
        inner = eng.backend.inner
        before = inner.traffic()
        if eng.rank == 0:
            ch.send(x)
            after = inner.traffic()
            # The serialized bytes in the send buffer (after the 16-byte length prefix) are a TensorMessage.
            staged = ch.channel._link._tx._buffer
            total = 16 + int(np.frombuffer(staged[:4], np.uint32)[0]) + int(np.frombuffer(staged[4:8], np.uint32)[0])
            total += x.nbytes
            msg = TensorMessage.FromString(staged[16:total].tobytes())
            same = msg == TensorMessage(dtype="<f4", shape=[3, 262144], seq=0, tensor_content=x.tobytes())
            eng.barrier("sent")
            return {
                "inner_writes": after["writes"] - before["writes"],
                "inner_flags": after["flags"] - before["flags"],
                "serialized_is_tensor_message": bool(same),
            }
        y = ch.recv()
        after = inner.traffic()
        eng.barrier("sent")
        return {
            "parsed": {"dtype": y.dtype.str, "shape": list(y.shape), "equal": bool(np.array_equal(x, y))},
            "acks": after["flags"] - before["flags"],
        }
