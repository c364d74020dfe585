"""RDMAStrategy's methods for a model's state: what a worker holds of it, files written whole, and sharded
checkpoints (rdkeras.parallel.sharded_checkpoint)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdkeras import fitting

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism


class ModelState:
    """RDMAStrategy's model-state methods (the strategy provides what is declared here)."""

    if TYPE_CHECKING:
        _parallel: Parallelism

        @property
        def is_chief(self) -> bool: ...

    def state_bytes(self, model: Any) -> dict[str, int]:
        """What training `model` keeps on this worker, in bytes: ``parameters`` (its weights) and ``optimizer``
        (its optimizer's state; with ``shard``, this worker's shard of it), counted from the variables."""
        return self._parallel.state_bytes(model)

    def export(self, model: Any, filepath: Any, **kwargs: Any) -> None:
        """Collective (every worker calls it): the chief writes ``model.save(filepath, **kwargs)``, a plain Keras
        file, with the optimizer's state whole (gathered from the workers' shards where ``shard`` splits it)."""
        fitting.export(model, self._parallel, self.is_chief, filepath, **kwargs)

    def save_checkpoint(self, model: Any, directory: Any) -> None:
        """Collective: writes `model`'s weights and optimizer state into the folder `directory`, each worker its
        own shard of the optimizer state where ``shard`` splits it (and of the weights, ``shard="parameters"``); a
        worker killed during the save leaves the previous checkpoint there whole. :meth:`load_checkpoint` resumes
        from it at any worker count."""
        self._parallel.save_checkpoint(model, directory)

    def load_checkpoint(self, model: Any, directory: Any) -> None:
        """Collective: sets `model`'s weights and optimizer state (compiled in :meth:`scope`) from a checkpoint of
        :meth:`save_checkpoint`, whatever worker count and ``shard`` wrote it. In one process without a strategy:
        ``rdkeras.parallel.sharded_checkpoint.load(directory, model)``."""
        self._parallel.load_checkpoint(model, directory)
