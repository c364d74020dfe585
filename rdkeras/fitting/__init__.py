"""rdkeras's own Keras policy: what a distributed model does in fit, evaluate, predict, save and backups.

Policy only: every private Keras name it needs comes from the seam,
:mod:`rdkeras.keras_internals`. The parallelism that decides how data and state are
split is a :class:`rdkeras.parallel.base.Parallelism`.
"""

from rdkeras.fitting.model import distribute_model, parallel_of, undistribute
from rdkeras.fitting.optimizer import agree_on_finite_gradients, distribute_optimizer

__all__ = ["agree_on_finite_gradients", "distribute_model", "distribute_optimizer", "parallel_of", "undistribute"]
