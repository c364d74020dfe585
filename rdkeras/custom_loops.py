"""tf.distribute's custom-loop API and Horovod's tape on RDMAStrategy: datasets split over the replicas,
``run`` in a replica context, reductions and gathers, variables shared from a root.

A custom loop (TensorFlow's "custom training with tf.distribute" tutorials, Horovod's ``DistributedGradientTape``)
runs on RDMAStrategy with only the strategy line changed; :class:`CustomLoops` is the part of the strategy that
serves it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rdkeras import keras_internals

if TYPE_CHECKING:
    from rdkeras.engine import Engine
    from rdkeras.parallel.base import Parallelism
    from rdkeras.strategy import RDMAStrategy


class CustomLoops:
    """RDMAStrategy's custom-loop methods (the strategy provides what is declared here)."""

    if TYPE_CHECKING:
        parallelism: str
        _parallel: Parallelism
        _closed: bool

        @property
        def engine(self) -> Engine: ...
        @property
        def num_workers(self) -> int: ...
        def _collectives(self) -> Any: ...
        def _data_parallel(self, what: str) -> Any: ...

    # -- input ---------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """This worker's part of a dataset batched at the global batch size (tf.distribute's name):
        each global batch split over the replicas, as ``fit`` does. For custom training loops."""
        x, _, _, _ = self._data_sharding().shard(dataset, None, None, None)
        return x

    distribute_dataset = experimental_distribute_dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """``dataset_fn(tf.distribute.InputContext)`` builds this replica's dataset itself (batched at
        ``input_context.get_per_replica_batch_size(global_batch)``); fit uses it as it is."""
        import tensorflow as tf

        sharding = self._data_sharding()
        context = tf.distribute.InputContext(
            num_input_pipelines=sharding.num_shards,
            input_pipeline_id=sharding.index,
            num_replicas_in_sync=sharding.num_shards,
        )
        dataset = dataset_fn(context)
        dataset._rdkeras_per_replica = True  # sharding leaves it alone
        return dataset

    def _data_sharding(self) -> Any:
        return self._parallel.sharding

    # -- custom training loops ---------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Runs `fn` for this worker's replica (tf.distribute's ``strategy.run``; one replica per worker, so
        what it returns is this replica's value: :meth:`experimental_local_results`, :meth:`reduce` and
        :meth:`gather` take it). As in tf.distribute's replica context, ``optimizer.apply_gradients`` inside
        `fn` first sums the gradients over the replicas (scale the loss by the global batch, e.g. with
        ``tf.nn.compute_average_loss(..., global_batch_size=...)``) -- unless :class:`DistributedGradientTape`
        has averaged them in this call already. Works eagerly and inside ``tf.function``."""
        if self.parallelism != "data" or self.num_workers == 1:
            return fn(*args, **(kwargs or {}))
        context = _ReplicaContext(self)
        _replica_contexts.stack = [*_replica_stack(), context]
        try:
            with keras_internals.on_apply(context.sum_gradients):
                return fn(*args, **(kwargs or {}))
        finally:
            _replica_contexts.stack = _replica_stack()[:-1]

    def local_rows(self, batch: Any) -> Any:
        """This worker's rows of a global `batch` (a tensor, an array or a structure of them, split along the
        first axis as ``fit`` splits it), by the membership of the moment: an elastic loop that iterates whole
        global batches calls it each step (eagerly or inside ``tf.function``)."""
        import tensorflow as tf

        tensors = tf.nest.map_structure(lambda t: None if t is None else tf.convert_to_tensor(t), batch)
        return self._data_parallel("local_rows").rows_of(tensors)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This worker's replicas' values of what :meth:`run` returned: a tuple of one (one replica per worker)."""
        return (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """Every replica's `value` (a tensor or a structure of them) concatenated along `axis`, in replica
        order; their sizes along `axis` may differ (tf.distribute's ``strategy.gather``). Collective."""
        import tensorflow as tf

        collectives = self._collectives()

        def gather_one(t: Any) -> Any:
            t = tf.convert_to_tensor(t)
            if t.shape.rank == 0:
                raise ValueError("gather needs tensors of rank >= 1 (a scalar has no axis to concatenate along)")
            at = axis % t.shape.rank
            order = [at, *(i for i in range(t.shape.rank) if i != at)]
            moved = tf.transpose(t, order) if at else t
            rows = tf.numpy_function(
                collectives.gather_rows, [moved], Tout=t.dtype, stateful=True, name="rdkeras_gather"
            )
            rows.set_shape([None, *moved.shape[1:]])
            return tf.transpose(rows, [order.index(i) for i in range(len(order))]) if at else rows

        return tf.nest.map_structure(gather_one, value)

    def allreduce(self, values: Any, op: str = "mean") -> Any:
        """Averages (op="mean") or sums (op="sum") a structure of tensors over the data-parallel replicas;
        works eagerly and inside ``tf.function``. Collective: every worker calls it alike."""
        import keras

        from rdkeras.parallel.collectives import GradientAllreduce

        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        flat = keras.tree.flatten(values)
        reduced = GradientAllreduce(self._collectives(), average=op == "mean")(flat)
        return keras.tree.pack_sequence_as(values, reduced)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """tf.distribute's ``strategy.reduce``: `value` (this replica's) reduced over replicas ("SUM" or
        "MEAN"; with `axis`, also along that axis, the mean weighted by each replica's rows)."""
        import tensorflow as tf

        op = str(getattr(reduce_op, "value", reduce_op)).lower()
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce_op must be 'SUM' or 'MEAN', got {reduce_op!r}")
        value = tf.convert_to_tensor(value)
        if axis is None:
            return self.allreduce(value, op)
        total = self.allreduce(tf.reduce_sum(value, axis=axis), "sum")
        if op == "sum":
            return total
        rows = self.allreduce(tf.cast(tf.shape(value)[axis], total.dtype), "sum")
        return total / rows

    def broadcast_variables(self, variables: Sequence[Any], root: int = 0) -> None:
        """Gives every worker `root`'s values of these Keras/TF variables (eager; collective)."""
        from rdkeras.parallel.collectives import share_variables

        variables = list(variables)
        share_variables(self._collectives(), variables, [root] * len(variables))


class DistributedGradientTape:
    """Horovod's ``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` averages the
    gradients over the strategy's replicas.

        with tf.GradientTape() as tape:
            loss = ...
        grads = rdkeras.DistributedGradientTape(tape, strategy).gradient(loss, model.trainable_variables)
    """

    def __init__(self, tape: Any, strategy: RDMAStrategy, op: str = "mean"):
        self._tape, self._strategy, self._op = tape, strategy, op

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        for context in _replica_stack():
            if context.strategy is self._strategy:
                context.reduced_by_tape = True  # apply_gradients in this strategy.run must not sum them again
        return self._strategy.allreduce(grads, self._op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


_replica_contexts = threading.local()


def _replica_stack() -> list[_ReplicaContext]:
    return getattr(_replica_contexts, "stack", [])


class _ReplicaContext:
    """One call of :meth:`RDMAStrategy.run` on this thread: the gradients ``apply_gradients`` gets are summed
    over the replicas, as in tf.distribute's replica context."""

    def __init__(self, strategy: CustomLoops):
        self.strategy, self.reduced_by_tape = strategy, False

    def sum_gradients(self, optimizer: Any, grads: list) -> list:
        if self.reduced_by_tape:
            return grads
        return self.strategy.allreduce(grads, "sum")
