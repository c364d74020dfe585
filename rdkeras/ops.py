"""RDMASend / RDMARecv: the engine's channels as TensorFlow ops inside compiled train steps.

Over the engine's static channels they are native kernels (:mod:`rdkeras.tf_ops`: ``RdkerasSend`` /
``RdkerasRecv``, no Python on the way); elsewhere (dynamic channels, the baselines' Python transports, a
transport that must register the sender's memory, or where the kernels cannot be built) they are
``tf.numpy_function`` ops. Both are stateful, so TensorFlow never prunes or reorders them: the send reads
TensorFlow's buffer in place and makes one remote write; the receive hands TensorFlow the registered slot
(64-byte aligned, so TensorFlow aliases it instead of copying). ``after`` chains them in program order,
which every worker derives from the same plan -- the reason a pipeline of blocking receives cannot deadlock.
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

    native = _native_ops(senders)
    if native is not None:
        lib, handles = native
        for sender, tensor in zip(senders, tensors, strict=True):
            _check_spec(sender, tensor.shape, tf.as_dtype(tensor.dtype))
        with tf.control_dependencies(list(after)):
            return lib.rdkeras_send(list(tensors), channels=handles, api=_api(), name=_op_name("RDMASend", name))

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

    native = _native_ops(receivers)
    if native is not None:
        lib, handles = native
        types = [tf.as_dtype(d) for _, d in specs]
        for receiver, (shape, _), dtype in zip(receivers, specs, types, strict=True):
            _check_spec(receiver, shape, dtype)
        with tf.control_dependencies(list(after)):
            outs = lib.rdkeras_recv(
                T=types, shapes=[list(shape) for shape, _ in specs], channels=handles, api=_api(),
                name=_op_name("RDMARecv", name),
            )  # fmt: skip
        return list(outs)

    def recv() -> tuple[np.ndarray, ...]:
        return tuple(r.recv() for r in receivers)

    with tf.control_dependencies(list(after)):
        outs = tf.numpy_function(
            recv, [], Tout=[tf.as_dtype(d) for _, d in specs], stateful=True, name=_op_name("RDMARecv", name)
        )
    for out, (shape, _) in zip(outs, specs, strict=True):
        out.set_shape(shape)
    return list(outs)


def _native_ops(channels: Sequence[Any]) -> tuple[Any, list[int]] | None:
    """The native ops library and each channel's op handle, where every channel is the engine's static
    channel the kernels can use (and the library could be built); else None (numpy_function hops)."""
    from rdkeras import tf_ops
    from rdkeras.channels import StaticChannel

    handles = []
    for channel in channels:
        handle = getattr(channel.channel, "op_handle", 0) if isinstance(channel, StaticChannel) else 0
        if not handle:
            return None
        handles.append(int(handle))
    lib = tf_ops.load()
    return None if lib is None else (lib, handles)


def _api() -> int:
    from rdkeras import tf_ops

    return tf_ops.api_address()


def _check_spec(channel: Any, shape: Any, dtype: Any) -> None:
    """A tensor must fit its static channel's shape (dimensions unknown when traced are checked by the kernel,
    which counts the bytes) and have its dtype."""
    import tensorflow as tf

    known = tf.TensorShape(shape)
    if not known.is_compatible_with(channel.shape) or dtype.as_numpy_dtype != channel.dtype:
        described = known.as_list() if known.rank is not None else "[unknown rank]"
        raise ValueError(
            f"static channel {channel.name!r} carries {channel.dtype}{list(channel.shape)}, the op has "
            f"{dtype.name}{described}"
        )


def _op_name(kind: str, name: str) -> str:
    return kind + "_" + "".join(c if c.isalnum() else "_" for c in name)
