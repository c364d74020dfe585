"""Optimizers under the strategy: the parallelism's gradient exchange runs inside ``apply``.

Keras's ``train_step`` (or a user's own) computes the gradients and calls
``optimizer.apply``; rdkeras overrides ``apply`` on that optimizer *object* so the
gradients are averaged (or pushed to parameter servers) first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdkeras import keras_internals


def distribute_optimizer(optimizer: Any, apply: Callable[..., Any]) -> None:
    """``optimizer.apply(grads, variables)`` becomes ``apply(optimizer, original_apply, grads, variables)``."""

    def hooked(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        return apply(self, keras_internals.original(self, "apply"), list(grads), trainable_variables)

    keras_internals.override(optimizer, "apply", hooked)


def agree_on_finite_gradients(optimizer: Any, all_finite: Callable[[Any], Any]) -> None:
    """For a LossScaleOptimizer whose workers update different variables (parameter servers): every
    worker skips a step (and lowers the loss scale) when any worker's gradients are not finite.
    ``all_finite(local_finite)`` returns the job-wide verdict as a boolean tensor."""
    import keras
    import tensorflow as tf

    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return

    def apply(self: Any, base: Any, grads: list, variables: Any) -> Any:
        present = [g for g in grads if g is not None]
        if not present:
            return base(grads, variables)
        verdict = all_finite(self.check_finite(present))
        # A NaN in one gradient makes this worker's own check fail too; + 0 changes nothing otherwise.
        i = next(i for i, g in enumerate(grads) if g is not None)
        poison = tf.where(verdict, tf.constant(0.0, grads[i].dtype), tf.constant(float("nan"), grads[i].dtype))
        grads = [*grads[:i], grads[i] + poison, *grads[i + 1 :]]
        return base(grads, variables)

    distribute_optimizer(optimizer, apply)
