"""rdkeras's own Keras policy: what a distributed model does in fit, evaluate, predict, save and backups.

Policy only: every private Keras name it needs comes from the seam,
:mod:`rdkeras.keras_internals`. The parallelism that decides how data and state are
split is a :class:`rdkeras.parallel.base.Parallelism`.
"""

from rdkeras.fitting.global_batch import GlobalBatch, merge_results
from rdkeras.fitting.model import (
    distribute_model,
    optimizers_of,
    parallel_of,
    remember_own_optimizer,
    reset_compiled_functions,
    route,
    undistribute,
    undistributed_own_optimizers,
)
from rdkeras.fitting.optimizer import agree_on_finite_gradients, distribute_optimizer
from rdkeras.fitting.saving import export

__all__ = [
    "GlobalBatch",
    "agree_on_finite_gradients",
    "distribute_model",
    "distribute_optimizer",
    "export",
    "merge_results",
    "optimizers_of",
    "parallel_of",
    "remember_own_optimizer",
    "reset_compiled_functions",
    "route",
    "undistribute",
    "undistributed_own_optimizers",
]
