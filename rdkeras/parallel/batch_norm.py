"""``BatchNormalization(synchronized=True)`` across workers: batch statistics over the global batch.

Keras computes a synchronized layer's moments with tf.distribute's replica context, which rdkeras is
not; here the layer's ``_moments`` becomes one differentiable allreduce of its per-channel sum, sum of
squares and count (the gradient of a sum over replicas is the sum of the replicas' gradients), so every
replica normalises with the global batch's mean and variance and keeps the same moving statistics, as
one process with the whole batch would.

The allreduces of one traced step are chained in the order they are traced (:mod:`rdkeras.parallel.step_sum`).
"""

from __future__ import annotations

from typing import Any

from rdkeras import keras_internals
from rdkeras.parallel.step_sum import StepSum


class SynchronizedMoments:
    """The moments of synchronized BatchNormalization layers over every member of `step_sum`'s collectives."""

    def __init__(self, step_sum: StepSum):
        self.step_sum = step_sum

    def attach(self, model: Any) -> list[Any]:
        """Makes the model's synchronized BatchNormalization layers compute global moments; returns them."""
        layers = keras_internals.synchronized_batch_norms(model)
        if self.step_sum.collectives.size > 1:
            for layer in layers:
                keras_internals.override(layer, keras_internals.MOMENTS_HOOK, self._global_moments)
        return layers

    @staticmethod
    def detach(model: Any) -> None:
        for layer in keras_internals.synchronized_batch_norms(model):
            keras_internals.restore(layer)

    def _global_moments(self, layer: Any, inputs: Any, mask: Any) -> tuple[Any, Any]:
        import tensorflow as tf

        axes = keras_internals.reduction_axes(layer)
        x = inputs  # (BatchNormalization.call casts them to float32 at least)
        weight = tf.ones_like(x)
        if mask is not None:  # masked steps count for nothing, as in Keras's own masked moments
            weight = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
            x = x * weight
        parts = [tf.reduce_sum(t, axis=axes, keepdims=True) for t in (x, x * x, weight)]
        shape = tf.shape(parts[0])
        total = self.step_sum.sum(tf.concat([tf.reshape(p, [-1]) for p in parts], 0))
        local_sum, squares, count = (tf.reshape(t, shape) for t in tf.split(total, 3))
        mean = tf.math.divide_no_nan(local_sum, count)
        variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)
