"""The global batch in every respect: each replica computes its rows of what one process computes for the batch.

A data-parallel step sees its replica's rows of the global batch. Three things would differ from one process if
each replica went its own way, and are made the global batch's here:

- **losses**: a ``keras.losses.Loss`` reduces as one process does over the whole batch. One process's loss is
  ``S / D``: the sum of the (weighted, masked) values over every row, divided by the global count of values,
  unmasked tokens or sample weights (by the reduction; ``"sum"``: no division). Each replica computes its own
  sum ``S_r``, and ``D`` is summed over the replicas (one small collective in the forward pass); the replica's loss
  is ``N * S_r / D``, so the mean over the N replicas -- what the gradient exchange averages -- is ``S / D``, one
  process's loss and gradient whatever the replicas' shares of masks and weights. Where every value counts
  (no mask, no division by the weights), ``D`` is the global batch's rows times each row's values, known to every
  replica without the collective. A loss's values keep the batch's rows as their first dimension (Keras's own
  losses all do).
- **the loss trackers** (the ``loss`` of the logs): Keras weighs each step's loss by the batch's rows; here by
  the global batch's rows over N, so the trackers' state summed over replicas is one process's. (A pipeline's
  micro-batches are parts of the batch alike, on one worker: their losses are shares that add up to the batch's.)
- **metric state**: at an epoch's end and evaluate's, every metric's variables are summed over the replicas (by
  their ``aggregation``) before ``result()``, in one collective, then given back their own values: AUC, Precision
  or Recall over the whole data, not the mean of each replica's.

Random draws inside the step (Dropout's masks, noise, augmentation) are the global batch's rows too: the Keras
seam's :func:`~rdkeras.keras_internals.global_batch_step` draws them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras import keras_internals

if TYPE_CHECKING:
    from rdkeras.parallel.collectives import Collectives

_MEANS = ("sum_over_batch_size", "mean")


@dataclass
class GlobalBatch:
    """This replica's rows of the global batch being traced, and how to sum over the replicas.

    Attributes:
        start: The replica's first row in the global batch (an int or a scalar tensor).
        rows: The replica's rows.
        total: The global batch's rows.
        replicas: N, the replicas the batch is split over; their losses are averaged (a pipeline's micro-batches:
            1, their losses are summed).
        sum_over_replicas: A float64 vector tensor summed over the replicas (a collective, inside the step); None
            where the parts are not computed together (a pipeline's micro-batches, in turn): a loss whose count
            needs the other parts is then this part's mean weighted by its rows.
        draws: None, or the draws a pipeline step's micro-batches share (see ``keras_internals.global_batch_step``).
        parts: The parts whose loss-tracker updates add up to the batch's: the replicas (default), or a pipeline
            step's micro-batches.
    """

    start: Any
    rows: Any
    total: Any
    replicas: Any
    sum_over_replicas: Callable[[Any], Any] | None
    draws: dict | None = None
    parts: Any = None

    def reduce_loss(
        self,
        keras_reduce: Callable[..., Any],
        values: Any,
        sample_weight: Any = None,
        mask: Any = None,
        reduction: Any = "sum_over_batch_size",
        dtype: Any = None,
    ) -> Any:
        """``reduce_weighted_values`` for the global batch: this replica's share of one process's loss (N times
        its part, so that the replicas' mean is one process's)."""
        from keras import ops

        values = raw = ops.convert_to_tensor(values, dtype=dtype)
        if reduction in (None, "none") or len(values.shape) == 0:
            return keras_reduce(values, sample_weight, mask, reduction, dtype)
        weights = None if sample_weight is None else ops.cast(sample_weight, values.dtype)
        if mask is not None:  # masked values count for nothing, in the sum and in the count
            float_mask = ops.cast(mask, values.dtype)
            if weights is not None:
                float_mask, weights = keras_internals.same_rank(float_mask, weights)
                weights = weights * float_mask
            else:
                weights = float_mask
        if weights is not None:
            values, weights = keras_internals.same_rank(values, weights)
            values = values * weights
        total = ops.sum(values)
        replicas = ops.cast(self.replicas, values.dtype)
        if reduction == "sum":
            return total * replicas
        import tensorflow as tf

        if reduction == "mean_with_sample_weight" and weights is not None:
            count = ops.sum(ops.cast(weights, "float64"))
        elif mask is not None and reduction in _MEANS:  # the unmasked values (Keras: sum / size * size / valid)
            count = ops.sum(ops.cast(float_mask, "float64")) * ops.divide_no_nan(
                ops.cast(ops.size(values), "float64"), ops.cast(ops.size(float_mask), "float64")
            )
        else:  # every value counts: the global batch's rows times each row's values, known here without a collective
            per_row = ops.divide_no_nan(ops.cast(ops.size(values), "float64"), ops.cast(self.rows, "float64"))
            count = per_row * ops.cast(self.total, "float64")  # (a replica without rows: 0, and so is its loss)
            return ops.divide_no_nan(total * replicas, ops.cast(count, values.dtype))
        if self.sum_over_replicas is None:  # Keras's mean of this part, weighted by its share of the rows
            share = ops.divide_no_nan(ops.cast(self.rows, values.dtype), ops.cast(self.total, values.dtype))
            return keras_reduce(raw, sample_weight, mask, reduction, dtype) * share * replicas
        (count,) = tf.unstack(tf.stop_gradient(self.sum_over_replicas(tf.reshape(count, [1]))))
        return ops.divide_no_nan(total * replicas, ops.cast(count, values.dtype))

    def tracked(self, value: Any) -> tuple[Any, Any]:
        """(value, weight) a loss tracker records for this part's loss: over the parts' updates, their weighted
        mean is the batch's loss, and their weights add up to its rows. A replica's loss is N times its share of
        the batch's, weighted by the batch's rows over N; a micro-batch's loss is its share, counted M times over
        the rows over M."""
        import tensorflow as tf

        parts = tf.cast(self.replicas if self.parts is None else self.parts, tf.float32)
        scale = parts / tf.cast(self.replicas, tf.float32)
        return value * tf.cast(scale, value.dtype), tf.cast(self.total, tf.float32) / parts


def weigh_loss_trackers(model: Any) -> None:
    """Makes the model's loss trackers weigh a step's loss by the global batch's rows over N inside a data-parallel
    step or a pipeline's micro-batch (:meth:`GlobalBatch.tracked`); idempotent, and done again for the trackers a
    recompile makes."""
    import tensorflow as tf

    for tracker in keras_internals.loss_trackers(model):
        if keras_internals.untracked(tracker, _WEIGHED):
            continue
        keras_internals.set_untracked(tracker, _WEIGHED, True)

        def update_state(self: Any, values: Any, sample_weight: Any = None) -> Any:
            batch = keras_internals.current_global_batch()
            if batch is not None and sample_weight is not None:
                values, sample_weight = batch.tracked(tf.convert_to_tensor(values))
            return keras_internals.original(self, "update_state")(values, sample_weight=sample_weight)

        keras_internals.override(tracker, "update_state", update_state)


_WEIGHED = "_rdkeras_weighed"

# -- metric state ------------------------------------------------------------------------------------------------

_reducing = threading.local()


def reducing_metric_state() -> bool:
    """Whether this thread is inside :func:`reduced_metric_state` (its metrics hold the replicas' merged state)."""
    return bool(getattr(_reducing, "depth", 0))


@contextlib.contextmanager
def reduced_metric_state(metrics: Sequence[Any], collectives: Collectives) -> Iterator[None]:
    """While active, the `metrics`' variables hold their state merged over the replicas (collective: every replica
    enters it alike): summed (aggregation "sum", Keras's default), averaged ("mean") or rank 0's
    ("only_first_replica"); "none" stays this replica's. Their own values come back afterwards."""
    if reducing_metric_state() or collectives.size == 1:
        yield
        return
    variables: list[Any] = []
    for metric in metrics:
        for v in metric.variables:
            if all(v is not w for w in variables):
                variables.append(v)
    local = [np.asarray(v.numpy()) for v in variables]
    n, first = collectives.size, collectives.position == 0
    factor = {"sum": 1.0, "mean": 1.0 / n, "only_first_replica": 1.0 if first else 0.0}
    merged = [str(getattr(v, "aggregation", "sum")) in factor for v in variables]
    wire = [a.astype(np.float64).ravel() * factor[str(getattr(v, "aggregation", "sum"))]
            for a, v, m in zip(local, variables, merged, strict=True) if m]  # fmt: skip
    if wire:
        (summed,) = collectives.allreduce([np.concatenate(wire)], average=False, purpose="metrics")
        offset = 0
        for v, a, m in zip(variables, local, merged, strict=True):
            if m:
                v.assign(summed[offset : offset + a.size].reshape(a.shape).astype(a.dtype))
                offset += a.size
    _reducing.depth = getattr(_reducing, "depth", 0) + 1
    try:
        yield
    finally:
        _reducing.depth -= 1
        for v, a, m in zip(variables, local, merged, strict=True):
            if m:
                v.assign(a)


def merge_results(metrics: Sequence[Any], collectives: Collectives) -> None:
    """Makes ``result()`` of these metrics (created in ``strategy.scope()`` for a custom loop) the replicas' merged
    result when called eagerly (collective then: every replica calls it alike); inside a ``tf.function``, and
    inside a step, it stays this replica's."""
    import tensorflow as tf

    for metric in metrics:
        if keras_internals.overridden(metric):
            continue

        def result(self: Any) -> Any:
            own = keras_internals.original(self, "result")
            if not tf.executing_eagerly() or reducing_metric_state():
                return own()
            with reduced_metric_state([self], collectives):
                return tf.nest.map_structure(tf.identity, own())

        keras_internals.override(metric, "result", result)
