"""DataParallel's traced steps: each replica takes its rows of the global batch (by the rank and world of the
moment), and ``predict`` gathers every replica's rows back (rdkeras.parallel.data_parallel)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras import fitting, keras_internals
from rdkeras.fitting import global_batch
from rdkeras.parallel.sharding import split_rows

if TYPE_CHECKING:
    from rdkeras.elastic.membership import Membership
    from rdkeras.engine import Engine
    from rdkeras.parallel.collectives import Collectives
    from rdkeras.parallel.sharding import Sharding
    from rdkeras.parallel.step_sum import StepSum


class ReplicaSteps:
    """DataParallel's step overrides and the split of a global batch (DataParallel provides what is declared
    here)."""

    if TYPE_CHECKING:
        engine: Engine
        collectives: Collectives
        sharding: Sharding
        step_sum: StepSum
        membership: Membership | None
        _split_in_step: bool
        _shard: Any
        _models: list[Any]

        @property
        def num_workers(self) -> int: ...
        def _parameter_overrides(self) -> dict[str, Any]: ...

    def _splits(self, x: Any) -> bool:
        """Whether the steps of a fit/evaluate/predict of `x` split global batches (else `x` is dealt out first);
        the models' traced steps are traced anew when that changes."""
        splits = self.sharding.global_batch and not getattr(x, "_rdkeras_per_replica", False)
        if splits != self._split_in_step:
            self._split_in_step = splits
            for model in self._models:
                fitting.reset_compiled_functions(model)
        return splits

    def step_overrides(self) -> dict[str, Any]:
        if self.num_workers == 1 and self.membership is None:
            return self._parameter_overrides()
        collectives = self.collectives

        def predict_step(model: Any, data: Any) -> Any:
            import keras
            import tensorflow as tf

            if self._split_in_step:
                data = self._split_batch(data)[0]
            out = keras_internals.original(model, "predict_step")(data)
            flat = keras.tree.flatten(out)

            def gather(*parts: np.ndarray) -> list[np.ndarray]:
                return [collectives.gather_rows(p) for p in parts]

            full = tf.numpy_function(gather, flat, Tout=[t.dtype for t in flat], stateful=True, name="rdkeras_gather")
            for t, f in zip(flat, full, strict=True):
                f.set_shape([None, *t.shape[1:]])
            return keras.tree.pack_sequence_as(out, list(full))

        def step_of(name: str) -> Any:
            def step(model: Any, data: Any) -> Any:
                # This replica's rows of the global batch, whose random draws (dropout's masks, a GAN's noise) and
                # losses are those of one process computing the whole batch, whatever the number of workers.
                own = keras_internals.original(model, name)
                if not self._split_in_step:
                    return own(data)
                mine, batch = self._split_batch(data)
                with keras_internals.global_batch_step(batch):
                    return own(mine)

            return step

        steps = {"predict_step": predict_step, "train_step": step_of("train_step"), "test_step": step_of("test_step")}
        return {**steps, **self._parameter_overrides()}

    def _split_batch(self, data: Any) -> tuple[Any, global_batch.GlobalBatch]:
        """(this worker's rows of a global batch, where they sit in it): the split of
        :func:`~rdkeras.parallel.sharding.split_rows` by the rank and world of the moment -- static where the
        batch's rows are, tensors otherwise (an elastic job's world changes without a new trace)."""
        import tensorflow as tf

        first = next(t for t in tf.nest.flatten(data) if t is not None)
        rank: Any
        world: Any
        if self.membership is not None:
            shard = self._shard_variable()
            rank, world = shard[0], shard[1]
            total: Any = None
        else:
            rank, world, total = self.sharding.index, self.sharding.num_shards, first.shape[0]
        if total is not None:
            start, rows = split_rows(total, world, rank)
        else:
            total = tf.shape(first, out_type=tf.int64)[0]
            base, extra = total // world, total % world
            start = rank * base + tf.minimum(tf.cast(rank, tf.int64), extra)
            rows = base + tf.cast(rank < extra, tf.int64)
        mine = tf.nest.map_structure(lambda t: None if t is None else _rows(t, start, rows), data)
        return mine, global_batch.GlobalBatch(start, rows, total, world, self.step_sum.sum)

    def _shard_variable(self) -> Any:
        import tensorflow as tf

        if self._shard is None:
            with tf.init_scope():
                self._shard = tf.Variable([self.engine.rank, self.engine.world_size], dtype=tf.int64,
                                          trainable=False, name="rdkeras_shard")  # fmt: skip
        return self._shard

    def rows_of(self, batch: Any) -> Any:
        """This worker's rows of a global batch (a structure of tensors), by the rank and world of the moment."""
        return self._split_batch(batch)[0]


def _rows(t: Any, start: Any, rows: Any) -> Any:
    """Rows ``start:start + rows`` of a tensor, a ragged or a sparse one."""
    import tensorflow as tf

    if isinstance(t, tf.SparseTensor):
        size = tf.concat([[tf.cast(rows, tf.int64)], t.dense_shape[1:]], 0)
        begin = tf.concat([[tf.cast(start, tf.int64)], tf.zeros_like(t.dense_shape[1:])], 0)
        return tf.sparse.slice(t, begin, size)
    return t[start : start + rows]
