"""The gradient exchange inside a compiled training step: dense gradients allreduced (in one exchange, or in
buckets overlapped with backprop), sparse ones gathered as rows."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras.engine import Engine
from rdkeras.parallel.collectives.buckets import EXCHANGE_LANES, BucketPipeline, reverse_buckets
from rdkeras.parallel.collectives.core import _FLOAT_KINDS, Collectives


def timed_exchange(fn: Callable[..., Any], engine_of: Callable[[], Engine]) -> Callable[..., Any]:
    """`fn` (the body of an exchange op a training step runs: an allreduce, a bucket's wait, a push, a pull),
    adding its seconds, work and waits, to the engine of the moment's ``traffic()["exchange_seconds"]``: what a
    step spends beyond them and its compute is the hops into and out of TensorFlow, the assignments and Keras.
    `engine_of` is asked at each call, never kept: a traced step outlives an elastic group's engine, which must
    be freed once the group re-forms."""

    def timed(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            engine_of().count_exchange(time.perf_counter() - began)

    return timed


class GradientAllreduce:
    """Averages (or sums) a list of tensors across members inside a compiled function.

    ``None`` entries pass through; tensors of other dtypes travel as float32 and come back in their own dtype.
    IndexedSlices (an Embedding's gradient) travel as their rows and indices, gathered from every member in rank
    order -- the IndexedSlices one process computes for the global batch, duplicates and all, which the optimizer
    then applies as it would there -- unless `sparse_as_dense` (Horovod's switch) makes them dense first.

    With `overlap_bytes` > 0 (inside a compiled function) the gradients go in buckets of that many
    bytes, last layer first: each bucket's allreduce starts as soon as backprop has produced its
    gradients (a start op hands it to a communication thread) and a wait op per bucket, in bucket order,
    collects it, so the update of one bucket's variables need not wait for the later buckets. Each element
    is still reduced by exactly one ring (bucket boundaries fall between tensors), so workers stay
    bit-identical. (Sparse gradients go in one exchange after backprop, with the dense ones.)
    """

    def __init__(
        self, collectives: Collectives, average: bool = True, overlap_bytes: int = 0, sparse_as_dense: bool = False
    ):
        self.collectives, self.average, self.overlap_bytes = collectives, average, overlap_bytes
        self.sparse_as_dense = sparse_as_dense
        self._exchanges = itertools.count()
        self._pipeline: BucketPipeline | None = None

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        import tensorflow as tf

        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx or self.collectives.size == 1:
            return list(grads)
        sparse = [] if self.sparse_as_dense else [i for i in idx if isinstance(grads[i], tf.IndexedSlices)]
        idx = [i for i in idx if i not in sparse]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]
        wire = [g if g.dtype.name in _FLOAT_KINDS else tf.cast(g, tf.float32) for g in dense]
        out = list(grads)
        if sparse:
            reduced, gathered = self._with_sparse(wire, [grads[i] for i in sparse])
            for i, g in zip(sparse, gathered, strict=True):
                out[i] = g
        elif self.overlap_bytes > 0 and not tf.executing_eagerly() and all(g.shape.is_fully_defined() for g in wire):
            reduced = self._overlapped(wire)
        else:
            reduced = self._in_one(wire)
        for i, g, r in zip(idx, dense, reduced, strict=True):
            r.set_shape(g.shape)
            out[i] = r if r.dtype == g.dtype else tf.cast(r, g.dtype)
        return out

    def _in_one(self, wire: list[Any]) -> list[Any]:
        import tensorflow as tf

        reduced = tf.numpy_function(
            timed_exchange(self._reduce, lambda: self.collectives.engine),
            wire,
            Tout=[g.dtype for g in wire],
            stateful=True,
            name="rdkeras_allreduce",
        )
        return [reduced] if not isinstance(reduced, (list, tuple)) else list(reduced)  # (eagerly, one comes bare)

    def _with_sparse(self, wire: list[Any], slices: list[Any]) -> tuple[list[Any], list[Any]]:
        """The dense gradients reduced and the sparse ones gathered, in one exchange (one op: the members' rings
        are used in the same order everywhere)."""
        import tensorflow as tf

        parts = [t for s in slices for t in (s.values, tf.cast(s.indices, tf.int64))]

        def exchange(*arrays: np.ndarray) -> list[np.ndarray]:
            reduced = self._reduce(*arrays[: len(wire)]) if wire else []
            rest = arrays[len(wire) :]
            for values, indices in zip(rest[::2], rest[1::2], strict=True):
                values, indices = self.collectives.gather_rows_many([values, indices])
                reduced += [values / values.dtype.type(self.collectives.size) if self.average else values, indices]
            return reduced

        outs = tf.numpy_function(
            timed_exchange(exchange, lambda: self.collectives.engine),
            [*wire, *parts],
            Tout=[t.dtype for t in [*wire, *parts]],
            stateful=True,
            name="rdkeras_allreduce_sparse",
        )
        outs = list(outs)
        gathered = []
        for k, s in enumerate(slices):
            values, indices = outs[len(wire) + 2 * k], outs[len(wire) + 2 * k + 1]
            values.set_shape([None, *s.values.shape[1:]])
            indices.set_shape([None])
            gathered.append(tf.IndexedSlices(values, tf.cast(indices, s.indices.dtype), s.dense_shape))
        return outs[: len(wire)], gathered

    def reset(self) -> None:
        """Drops the buckets in flight (an elastic job's group re-formed)."""
        if self._pipeline is not None:
            self._pipeline.reset()

    def stop(self) -> None:
        """Stops the bucket pipeline's threads (the strategy is closing)."""
        if self._pipeline is not None:
            self._pipeline.close()

    def _reduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        # The inputs are views of TensorFlow's buffers; the outputs are 64-byte
        # aligned views of registered memory, which TensorFlow aliases.
        reduced = self.collectives.allreduce(list(arrays), average=self.average, compress=True)
        return [r.reshape(a.shape) for r, a in zip(reduced, arrays, strict=True)]  # views (0-d stays 0-d)

    def _overlapped(self, wire: list[Any]) -> list[Any]:
        import tensorflow as tf

        if self._pipeline is None:
            self._pipeline = BucketPipeline(
                self._reduce_bucket,
                "allreduce-buckets",
                self.collectives.engine.timeout,
                prepare=lambda _exchange, bucket, arrays: self.collectives.prepare(arrays, f"grads{bucket}", True),
                lanes=EXCHANGE_LANES,
            )
        pipeline, exchange = self._pipeline, next(self._exchanges)  # one exchange per trace
        buckets = reverse_buckets([g.shape.num_elements() * g.dtype.size for g in wire], self.overlap_bytes)
        tickets = pipeline.start_ops(exchange, buckets, wire, "rdkeras_allreduce_start")
        # One wait op per bucket, in bucket order: what follows a bucket (the copy back to a GPU, the optimizer's
        # update of its variables) may run while later buckets are still on the wire.
        out: list[Any] = [None] * len(wire)
        for b, members in enumerate(buckets):

            def wait(*_inputs: np.ndarray, b: int = b) -> list[np.ndarray]:
                return list(pipeline.wait_bucket(exchange, b, len(buckets)))

            # The bucket's gradients are inputs too: TensorFlow keeps them alive until the bucket is done.
            reduced = tf.numpy_function(
                timed_exchange(wait, lambda: self.collectives.engine),
                [tickets[b]] + [wire[i] for i in members],
                Tout=[wire[i].dtype for i in members],
                stateful=True,
                name=f"rdkeras_allreduce_wait{b}",
            )
            for i, r in zip(members, reduced, strict=True):
                out[i] = r
        return out

    def _reduce_bucket(self, exchange: int, bucket: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        # A ring per bucket: its outputs stay valid until that bucket's next-but-one exchange.
        reduced = self.collectives.allreduce(arrays, average=self.average, purpose=f"grads{bucket}", compress=True)
        return [r.reshape(a.shape) for r, a in zip(reduced, arrays, strict=True)]
