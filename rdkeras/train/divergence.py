"""A run whose loss turns NaN ends at once, on every worker at the same step, with an error and nothing that looks
finished.

Keras's ``TerminateOnNaN`` stops ``fit`` as if it were done: the epoch still ends, ModelCheckpoint saves the NaN
weights, and the app would write results.json with a NaN loss and exit 0. :func:`stop_on_divergence` raises
:class:`DivergedError` instead: ``fit`` ends in that exception, so the epoch never ends (no checkpoint of it, no
backup) and no results.json is written. It is the first of the run's callbacks, ahead of every one that saves.

Every worker must stop at the same step, or the others would wait for it in the next step's exchange. A batch's
``loss`` is the worker's own (its rows), so one worker's can be NaN while another's is not; what every worker
holds alike is decided without a collective of its own:

- after every step, the trainable weights: a NaN loss makes NaN gradients, which the gradient exchange averages
  into every worker's update, so every replica's weights turn non-finite at the same step (the replicas hold
  identical weights; a pipeline's stages all receive the non-finite gradients). A loss-scale optimizer's skipped
  step leaves them finite, as it should;
- at every epoch end, the loss of the epoch's logs, which rdkeras merges over the workers (identical everywhere):
  a loss that is not finite while the weights are.
"""

from __future__ import annotations

import functools
import math
from typing import Any


class DivergedError(RuntimeError):
    """Training diverged: the weights or the epoch's loss are not finite (the message says where)."""


def stop_on_divergence(hint: str = "") -> Any:
    """The callback (a ``keras.callbacks.Callback``); `hint` ends its error (what to change)."""
    return _callback_class()(hint)


@functools.cache
def _callback_class() -> type:
    import keras

    class StopOnDivergence(keras.callbacks.Callback):
        def __init__(self, hint: str):
            super().__init__()
            self.hint, self.epoch = hint, 0
            self._finite: Any = None  # the check, traced for this fit's variables at its first step

        def on_train_begin(self, logs: Any = None) -> None:
            self._finite = None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self._finite is None:
                self._finite = _all_finite([v.value for v in self.model.trainable_variables])
            if not self._finite():
                self._stop(
                    f"at epoch {self.epoch + 1}, step {batch + 1}: the weights are no longer finite (nan or inf)"
                )

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                self._stop(f"in epoch {epoch + 1}: its loss is {float(loss)}")

        def _stop(self, where: str) -> None:
            self.model.stop_training = True
            hint = f"; {self.hint}" if self.hint else ""
            raise DivergedError(
                f"training diverged {where}{hint}. The run stopped there on every worker: no checkpoint of this "
                "epoch, no results.json"
            )

    return StopOnDivergence


def _all_finite(variables: list[Any]) -> Any:
    """A function: whether every float variable of `variables` holds finite values only. The sum of their sums is
    finite unless one is not (or the sum overflows, when the exact check decides): one pass over the weights."""
    import tensorflow as tf

    floats = [v for v in variables if v.dtype.is_floating]
    if not floats:
        return lambda: True

    def summed() -> Any:
        return tf.math.is_finite(tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in floats]))

    def exact() -> Any:
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in floats]))

    fast, slow = tf.function(summed, autograph=False), tf.function(exact, autograph=False)
    return lambda: bool(fast()) or bool(slow())
