"""Sums over the replicas inside a traced step: synchronized BatchNormalization's moments, the global batch's loss
counts.

Each sum is one allreduce in a ``tf.numpy_function``. The sums of one traced step are chained by control
dependencies in the order they are traced -- the same program on every worker -- so sums in parallel branches
(Inception's batch norms, a multi-output model's losses) cannot run in different orders on different workers.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from rdkeras.parallel.collectives import Collectives


class StepSum:
    """``sum(vector)``: a float vector tensor summed over every member of `collectives`, differentiable (the
    gradient of a sum over replicas is the sum of the replicas' gradients)."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # traced graph -> its last allreduce

    def sum(self, vector: Any) -> Any:
        import tensorflow as tf

        @tf.custom_gradient
        def summed(v: Any) -> Any:
            def grad(upstream: Any) -> Any:
                return self._allreduce(upstream)

            return self._allreduce(v), grad

        return summed(vector)

    def _allreduce(self, vector: Any) -> Any:
        import tensorflow as tf

        def reduce(array: np.ndarray) -> np.ndarray:
            (out,) = self.collectives.allreduce([array], average=False, purpose="in-step")
            return np.array(out, copy=True)  # the ring's memory is reused two calls later; TF keeps this longer

        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        previous = [] if graph is None else [op for op in [self._last.get(graph)] if op is not None]
        with tf.control_dependencies(previous):
            out = tf.numpy_function(reduce, [vector], Tout=vector.dtype, stateful=True, name="rdkeras_step_sum")
        out.set_shape(vector.shape)
        if graph is not None:
            self._last[graph] = out.op
        return out
