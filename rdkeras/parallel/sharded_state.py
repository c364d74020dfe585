"""What data parallelism does for a sharded optimizer (``shard``): its update set up at attach, its state whole in
a file, in checkpoints and beside BackupAndRestore's backup, and counted (rdkeras.parallel.sharded_optimizer,
rdkeras.parallel.sharded_checkpoint)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras import fitting, keras_internals
from rdkeras._log import logger
from rdkeras.fitting.backup import OPTIMIZER_SHARDS
from rdkeras.parallel import sharded_checkpoint
from rdkeras.parallel.collectives import Collectives, GradientAllreduce
from rdkeras.parallel.piece_gradients import slots_by_variable
from rdkeras.parallel.sharded_optimizer import ShardedUpdate

if TYPE_CHECKING:
    from rdkeras.engine import Engine


class ShardedState:
    """DataParallel's sharded-optimizer methods (DataParallel provides what is declared here)."""

    if TYPE_CHECKING:
        engine: Engine
        collectives: Collectives
        shard: str
        sparse_as_dense: bool
        backup_folder: Any
        _sharded: dict[int, ShardedUpdate]
        _saving: dict[int, list[Any]]
        _told_saved_in_part: bool
        _averages: list[GradientAllreduce]

        @property
        def num_workers(self) -> int: ...
        def _all_finite(self, local: Any) -> Any: ...

    def _shard_optimizer(self, model: Any, overlap: int) -> None:
        """The optimizer that updates the variables applies a sharded update. Under a LossScaleOptimizer, the
        gradients are averaged whole before its finite check ("optimizer"), or every worker agrees on the check
        of its own before they are reduce-scattered ("gradients"): all take the same branch."""
        optimizer = model.optimizer
        inner = keras_internals.inner_optimizer(optimizer)
        average = None
        if self.shard == "optimizer":
            average = GradientAllreduce(self.collectives, overlap_bytes=overlap, sparse_as_dense=self.sparse_as_dense)
            self._averages.append(average)
        update = ShardedUpdate(
            self.collectives, inner, self.shard, average if inner is optimizer else None, self.sparse_as_dense
        )
        self._sharded[id(model)] = update
        keras_internals.saves_own_variables(optimizer, lambda: self._saved_variables(model))
        fitting.distribute_optimizer(inner, update.apply)
        if inner is not optimizer and average is not None:
            fitting.distribute_optimizer(optimizer, lambda _o, base, grads, variables: base(average(grads), variables))
        elif inner is not optimizer:
            fitting.agree_on_finite_gradients(optimizer, self._all_finite)

    def _saved_variables(self, model: Any) -> list[Any]:
        """What a file Keras writes holds of `model`'s sharded optimizer: what :meth:`optimizer_saved_as` says,
        else its own variables (iteration, learning rate), which a save on one worker is told once."""
        if id(model) in self._saving:
            return self._saving[id(model)]
        if not self._told_saved_in_part:
            self._told_saved_in_part = True
            logger.warning(
                f"shard={self.shard!r}: a file saved by Keras on one worker holds the optimizer's iteration and "
                "learning rate, not its sharded state; RDMAStrategy.export(model, path) on every worker writes it whole"
            )
        return list(model.optimizer.variables)

    @contextlib.contextmanager
    def optimizer_saved_as(self, model: Any, variables: Sequence[Any]) -> Iterator[None]:
        self._saving[id(model)] = list(variables)
        try:
            yield
        finally:
            del self._saving[id(model)]

    def whole_optimizer_state(self, model: Any) -> list[Any] | None:
        update = self._sharded.get(id(model))
        if update is None:
            return None
        full = consolidated(update)  # collective
        optimizer = model.optimizer
        if keras_internals.inner_optimizer(optimizer) is optimizer:
            return list(full.variables)
        inner = {id(v) for v in keras_internals.inner_optimizer(optimizer).variables}
        return [v for v in optimizer.variables if id(v) not in inner] + list(full.variables)  # (a LossScaleOptimizer's)

    def save_optimizer_shards(self, model: Any, folder: Any) -> Any:
        if id(model) not in self._sharded:
            return None
        path = Path(folder) / f"{OPTIMIZER_SHARDS}-{int(model.optimizer.iterations.numpy())}"
        self.save_checkpoint(model, path)
        return path

    def _restore_optimizer_shards(self, model: Any) -> None:
        """After a backup's weights are restored and shared: each worker's shard of the optimizer state, from the
        shards saved beside them at the same iteration."""
        update = self._sharded.get(id(model))
        if update is None or self.backup_folder is None:
            return
        iteration = int(model.optimizer.iterations.numpy())
        path = Path(self.backup_folder) / f"{OPTIMIZER_SHARDS}-{iteration}"
        if not path.exists():
            raise FileNotFoundError(
                f"the backup in {self.backup_folder} has no sharded optimizer state for iteration {iteration} "
                f"({path.name}): it was written without shard={self.shard!r}; resume with the shard setting it had"
            )
        sharded_checkpoint.load(path, model, update, weights=False)

    def save_checkpoint(self, model: Any, directory: Any) -> None:
        barrier = lambda: self.collectives.mean([0.0])  # noqa: E731 (an allreduce of nothing)
        update = self._sharded.get(id(model))
        sharded_checkpoint.save(directory, model, update, self.engine.rank, self.num_workers, barrier)

    def load_checkpoint(self, model: Any, directory: Any) -> None:
        sharded_checkpoint.load(directory, model, self._sharded.get(id(model)))

    def state_bytes(self, model: Any) -> dict[str, int]:
        counted = super().state_bytes(model)  # type: ignore[misc]
        update = self._sharded.get(id(model))
        return {**counted, "optimizer": counted["optimizer"] + (update.state_bytes() if update is not None else 0)}


def consolidated(update: ShardedUpdate) -> Any:
    """Collective: a plain optimizer of the compiled one's class and config, built on the variables `update`
    updates, holding the whole state the workers' shards hold between them -- what one process's optimizer would
    hold. For a file written whole (``RDMAStrategy.export``); every worker gets it."""
    optimizer, variables, collectives = update.optimizer, update.variables, update.collectives
    full = type(optimizer).from_config(optimizer.get_config())
    full.build(variables)
    keras_internals.iteration_counter(full).assign(keras_internals.iteration_counter(optimizer))
    if keras_internals.settable_learning_rate(optimizer):
        full.learning_rate = np.asarray(optimizer.learning_rate)
    if update.copy is None:
        return full  # (never stepped: the state is the initial one)
    slots = slots_by_variable(full, variables)
    for (g, name), shard in update.shard_slots().items():
        group = update.groups[g]
        whole = collectives.allgather(shard, purpose="export")
        for i, offset, size in zip(group.indices, group.offsets, group.sizes, strict=True):
            if (i, name) in slots:
                slots[(i, name)].assign(np.reshape(whole[offset : offset + size], variables[i].shape))
    collectives.release("export")  # (a one-off, as large as the model)
    return full
