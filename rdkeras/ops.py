"""RDMASend / RDMARecv: the engine's channels as TensorFlow ops inside compiled train steps.

They are ``tf.numpy_function`` ops (stateful, so TensorFlow never prunes or
reorders them): the send reads TensorFlow's buffer in place and makes one remote
write; the receive hands TensorFlow the registered slot (64-byte aligned, so
TensorFlow aliases it instead of copying). ``after`` chains them in program
order, which every worker derives from the same plan -- the reason a pipeline
of blocking receives cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rdkeras.channels import DynamicChannel, StaticChannel


def rdma_send(sender: StaticChannel | DynamicChannel, tensor: Any, name: str, after: Sequence[Any] = ()) -> Any:
    """Sends `tensor` over `sender` (the sending end of a channel); returns a token to order on."""
    return rdma_send_all([sender], [tensor], name, after)


def rdma_recv(
    receiver: StaticChannel | DynamicChannel,
    shape: Sequence[int | None],
    dtype: Any,
    name: str,
    after: Sequence[Any] = (),
) -> Any:
    """The next tensor from `receiver` (the receiving end of a channel)."""
    return rdma_recv_all([receiver], [(shape, dtype)], name, after)[0]


def rdma_send_all(
    senders: Sequence[StaticChannel | DynamicChannel], tensors: Sequence[Any], name: str, after: Sequence[Any] = ()
) -> Any:
    """Sends each of `tensors` over its sender, in order, in one hop into Python (one op: what a hop costs is
    paid once, not per tensor); returns a token to order on."""
    import tensorflow as tf

    def send(*arrays: np.ndarray) -> np.ndarray:
        for sender, array in zip(senders, arrays, strict=True):
            sender.send(array)
        return np.zeros((), np.int32)

    with tf.control_dependencies(list(after)):
        return tf.numpy_function(send, list(tensors), Tout=tf.int32, stateful=True, name=_op_name("RDMASend", name))


def rdma_recv_all(
    receivers: Sequence[StaticChannel | DynamicChannel],
    specs: Sequence[tuple[Sequence[int | None], Any]],
    name: str,
    after: Sequence[Any] = (),
) -> list[Any]:
    """The next tensor from each of `receivers` ((shape, dtype) each in `specs`), in order, in one hop."""
    import tensorflow as tf

    def recv() -> tuple[np.ndarray, ...]:
        return tuple(r.recv() for r in receivers)

    with tf.control_dependencies(list(after)):
        outs = tf.numpy_function(
            recv, [], Tout=[tf.as_dtype(d) for _, d in specs], stateful=True, name=_op_name("RDMARecv", name)
        )
    for out, (shape, _) in zip(outs, specs, strict=True):
        out.set_shape(shape)
    return list(outs)


def _op_name(kind: str, name: str) -> str:
    return kind + "_" + "".join(c if c.isalnum() else "_" for c in name)
