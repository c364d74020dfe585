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
from rdkeras.fitting.saving import variables_bytes
from rdkeras.parallel import sharded_checkpoint
from rdkeras.parallel.collectives import Collectives, GradientAllreduce
from rdkeras.parallel.piece_gradients import plain_optimizer, slots_by_variable
from rdkeras.parallel.sharded_optimizer import ShardedUpdate
from rdkeras.parallel.sharded_parameters import ShardedParameters

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
        _parameters: dict[int, ShardedParameters]
        _saving: dict[int, list[Any]]
        _told_saved_in_part: bool
        _averages: list[GradientAllreduce]

        @property
        def num_workers(self) -> int: ...
        def _all_finite(self, local: Any) -> Any: ...
        def sync_state(self, model: Any, restored: bool) -> None: ...

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

    # -- shard="parameters" ----------------------------------------------------------------------

    def _shard_parameters(self, model: Any) -> None:
        """The compiled optimizer updates this worker's pieces of the weights, laid out when fit starts."""
        parameters = ShardedParameters(self.collectives, model)
        previous = self._parameters.get(id(model))
        if previous is not None:  # compiled again (a layer unfrozen): laid out anew when fit starts
            previous.unshard()
        self._parameters[id(model)] = parameters
        keras_internals.saves_own_variables(model.optimizer, lambda: self._saved_variables(model))
        fitting.distribute_optimizer(parameters.optimizer, parameters.apply)
        if parameters.optimizer is not model.optimizer:  # (each worker checks its pieces: all take one branch)
            fitting.agree_on_finite_gradients(model.optimizer, self._all_finite)

    def _lay_out_parameters(self, model: Any) -> None:
        """Once every worker holds the chief's weights (as the first fit starts, its step not traced yet): each
        keeps only its pieces; an evaluate or predict traced before read whole variables, so it is traced again."""
        parameters = self._parameters.get(id(model))
        if parameters is not None and not parameters.units:
            parameters.shard()
            model.test_function = model.predict_function = None

    def _whole_variables(self, model: Any, variables: list[Any]) -> list[Any]:
        """`variables` less those stored sharded (alike on every worker by construction, and not whole here)."""
        parameters = self._parameters.get(id(model))
        return variables if parameters is None else parameters.variables_in(variables)

    def _unshard_parameters(self) -> None:
        """Every sharded model back to whole variables and plain layer calls (collective: at close)."""
        for parameters in self._parameters.values():
            try:
                parameters.unshard()
            except Exception as e:  # (a peer gone: the model is lost with the job)
                logger.warning(f"shard='parameters': the weights stay sharded, as they could not be gathered: {e}")
        self._parameters.clear()

    def _parameter_overrides(self) -> dict[str, Any]:
        """Model methods that read or write whole weights, for sharded ones (collective, like a step)."""
        if self.shard != "parameters":
            return {}

        def sharded(model: Any) -> ShardedParameters | None:
            parameters = self._parameters.get(id(model))
            return parameters if parameters is not None and parameters.sharded else None

        def get_weights(model: Any) -> list[Any]:
            parameters = sharded(model)
            if parameters is None:
                return keras_internals.original(model, "get_weights")()
            values = parameters.whole_values()
            return [values[id(v)] if id(v) in values else v.numpy() for v in model.weights]

        def set_weights(model: Any, weights: Any) -> None:
            parameters = sharded(model)
            if parameters is None:
                return keras_internals.original(model, "set_weights")(weights)
            for v, value in zip(model.weights, weights, strict=True):
                parameters.set_whole(v, value) if parameters.is_sharded(v) else v.assign(value)
            return None

        def refuse(name: str) -> Any:
            def save(model: Any, *args: Any, **kwargs: Any) -> Any:
                if sharded(model) is None:
                    return keras_internals.original(model, name)(*args, **kwargs)
                raise NotImplementedError(
                    f"model.{name} with shard='parameters': each worker holds 1/N of the weights; call "
                    "strategy.export(model, path) on every worker, which gathers them and writes the file on the chief"
                )

            return save

        return {"get_weights": get_weights, "set_weights": set_weights, "save": refuse("save"),
                "save_weights": refuse("save_weights")}  # fmt: skip

    @contextlib.contextmanager
    def whole_weights(self, model: Any) -> Iterator[None]:
        parameters = self._parameters.get(id(model))
        if parameters is None or not parameters.sharded:
            yield
            return
        with parameters.whole():
            yield

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
        parameters, update = self._parameters.get(id(model)), self._sharded.get(id(model))
        if parameters is not None and parameters.units:
            full = parameters.consolidated()  # collective
        elif update is not None:
            full = consolidated(update)  # collective
        else:
            return None
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
        update, parameters = self._sharded.get(id(model)), self._parameters.get(id(model))
        if parameters is not None and not parameters.units:  # (before fit: laid out on the chief's weights)
            self.sync_state(model, False)
        sharded_checkpoint.save(directory, model, update, self.engine.rank, self.num_workers, barrier, parameters)

    def load_checkpoint(self, model: Any, directory: Any) -> None:
        parameters = self._parameters.get(id(model))
        if parameters is not None:  # (laid out now, whatever each worker holds: each piece is then read back)
            self._lay_out_parameters(model)
        sharded_checkpoint.load(directory, model, self._sharded.get(id(model)), parameters=parameters)

    def state_bytes(self, model: Any) -> dict[str, int]:
        counted = super().state_bytes(model)  # type: ignore[misc]
        parameters = self._parameters.get(id(model))
        if parameters is not None and parameters.sharded:
            mine = parameters.state_bytes()
            return {"parameters": variables_bytes(parameters.variables_in(model.weights)) + mine["parameters"],
                    "optimizer": counted["optimizer"] + mine["optimizer"]}  # fmt: skip
        update = self._sharded.get(id(model))
        return {**counted, "optimizer": counted["optimizer"] + (update.state_bytes() if update is not None else 0)}


def consolidated(update: ShardedUpdate) -> Any:
    """Collective: a plain optimizer of the compiled one's class and config, built on the variables `update`
    updates, holding the whole state the workers' shards hold between them -- what one process's optimizer would
    hold. For a file written whole (``RDMAStrategy.export``); every worker gets it."""
    optimizer, variables, collectives = update.optimizer, update.variables, update.collectives
    full = plain_optimizer(optimizer, variables)
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
