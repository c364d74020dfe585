"""``python -m rdkeras.train``: the Hydra training app.

    python -m rdkeras.train +recipe=fcn5                         # 2 local workers
    python -m rdkeras.train +recipe=vgg16 cluster.num_workers=3 transport=tcp
    python -m rdkeras.train --multirun +recipe=fcn5 trainer.batch_size=32,128

The config groups (``model``, ``data``, ``parallel``, ``transport``, ``cluster``,
``trainer``, ``logger``) live in the top-level ``conf/`` and the ``recipe``
presets in ``recipes/``; the wheel ships both inside the package. With
``cluster=local`` the app spawns the workers itself (``rdkeras.launch``);
under TF_CONFIG, SLURM or ``python -m rdkeras.launch`` it is one worker of
that job. Hydra's output folder receives the resolved config,
the workers' logs, TensorBoard events, checkpoints and ``results.json``.
"""

from rdkeras.train.app import main
from rdkeras.train.config import ConfigError, compose, recipes

__all__ = ["ConfigError", "compose", "main", "recipes"]
