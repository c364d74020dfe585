"""Elastic data-parallel training: a worker lost in the middle of ``fit`` and the job goes on.

``python -m rdkeras.launch -n N --min-workers M script.py``: the launcher hosts the job's
store (its agent: :mod:`rdkeras.launch_agent`, beside the launcher; the keys both speak:
:mod:`rdkeras.elastic.protocol`); when a worker dies, the survivors -- at least M --
leave the old group, the launcher publishes the next one, and they start an engine for it
(:mod:`rdkeras.elastic.group`); inside the same ``fit`` they take the state of the survivor
that applied the most steps, split the same global batch over the new world and repeat the
step in flight (:mod:`rdkeras.fitting.elastic`). A custom loop uses :class:`State` and
:func:`run` (:mod:`rdkeras.elastic.loop`, Horovod's ``hvd.elastic.run``). The parallelism carries
all of it as one collaborator, its :class:`~rdkeras.elastic.membership.Membership` (imported from its
module: it uses the parallelisms' collectives, and the launcher imports this package).
"""

from rdkeras.elastic.group import ElasticError, ElasticGroup, NewGroup

__all__ = ["ElasticError", "ElasticGroup", "NewGroup", "State", "run"]


def __getattr__(name: str):
    # Lazily: the launcher imports this package, and the loop's API sits above the strategy.
    if name in ("State", "run"):
        import importlib

        return getattr(importlib.import_module("rdkeras.elastic.loop"), name)
    raise AttributeError(f"module 'rdkeras.elastic' has no attribute {name!r}")
