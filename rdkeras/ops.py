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
    import tensorflow as tf

    def send(array: np.ndarray) -> np.ndarray:
        sender.send(array)
        return np.zeros((), np.int32)

    with tf.control_dependencies(list(after)):
        return tf.numpy_function(send, [tensor], Tout=tf.int32, stateful=True, name=_op_name("RDMASend", name))


def rdma_recv(
    receiver: StaticChannel | DynamicChannel,
    shape: Sequence[int | None],
    dtype: Any,
    name: str,
    after: Sequence[Any] = (),
) -> Any:
    """The next tensor from `receiver` (the receiving end of a channel)."""
    import tensorflow as tf

    with tf.control_dependencies(list(after)):
        out = tf.numpy_function(
            receiver.recv, [], Tout=tf.as_dtype(dtype), stateful=True, name=_op_name("RDMARecv", name)
        )
    out.set_shape(shape)
    return out


def _op_name(kind: str, name: str) -> str:
    return kind + "_" + "".join(c if c.isalnum() else "_" for c in name)
