"""Which rows of each batch a replica trains on.

The ``batch_size`` given to ``fit``/``evaluate``/``predict`` is the **global**
batch, as in tf.distribute and keras.distribution: every step, each of the N
replicas takes its share of the same global batch, so N replicas compute
exactly the step one process would. A global batch of B rows is split into N
contiguous parts; replica r takes rows ``[r*b, (r+1)*b)`` with ``b = B / N``
(B must divide by N). A last, partial batch of B' rows is split as evenly as
possible (parts differ by at most one row; with B' < N some replicas get an
empty part, whose loss and gradient are zero).

- NumPy arrays: each replica copies its rows of every global batch once, at
  the start of ``fit``; Keras's array adapter then batches them (and, with
  ``shuffle=True``, reshuffles the replica's part every epoch).
- ``tf.data.Dataset`` batched at the global size: every replica runs the same
  pipeline and keeps its part of each batch (MultiWorkerMirroredStrategy's
  data sharding plus rebatching). The dataset must produce the same batches on
  every worker: give ``shuffle`` a seed.
- ``keras.utils.PyDataset``: every replica loads each batch and keeps its part.

``RDMAStrategy(global_batch=False)`` keeps Horovod's convention instead
(``batch_size`` per replica; arrays and PyDatasets split into whole batches,
datasets sharded batch by batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rdkeras._log import logger


def split_rows(rows: int, num_shards: int, index: int) -> tuple[int, int]:
    """(start, size) of shard `index` when `rows` rows are split as evenly as possible."""
    base, extra = divmod(rows, num_shards)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


class Sharding:
    """Shard `index` of `num_shards`: every worker (data parallelism) or every pipeline replica (hybrid).

    Args:
        num_shards: Replicas the data is split over.
        index: This replica.
        global_batch: Whether batch sizes (and dataset batches) are global (default) or per replica.
        warn: Whether this process logs the warnings (one process per job should).
    """

    def __init__(self, num_shards: int, index: int, global_batch: bool = True, warn: bool = True):
        self.num_shards, self.index, self.global_batch, self.warn = num_shards, index, global_batch, warn
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self.warn:
            self._warned.add(key)
            logger.warning(message)

    def replica_batch(self, batch_size: int, what: str = "batch_size") -> int:
        """The rows each replica computes per step for a `batch_size` given to Keras."""
        n = self.num_shards
        if not self.global_batch or n == 1:
            return batch_size
        if batch_size % n:
            raise ValueError(
                f"{what}={batch_size} is the global batch, split over {n} replicas, and does not divide "
                f"by {n}: choose a multiple of {n} (e.g. {max(n, batch_size // n * n)} or {(batch_size // n + 1) * n})"
            )
        return batch_size // n

    def global_batch_of(self, x: Any, batch_size: int | None) -> int | None:
        """The global batch of `x` as Keras would batch it (None when only the data knows)."""
        import tensorflow as tf

        if isinstance(x, tf.data.Dataset):
            spec = tf.nest.flatten(x.element_spec)
            size = spec[0].shape[0] if spec and spec[0].shape.rank else None
        elif x is not None and self.shardable_arrays(x):
            size = batch_size or 32
        else:
            size = None
        return None if size is None else size if self.global_batch else size * self.num_shards

    def pad_for_predict(self, x: Any, batch_size: int | None) -> tuple[Any, int | None]:
        """Arrays whose last global batch has fewer rows than replicas get copies of their last row,
        so that every replica runs the same steps; returns (x, the rows to keep of the output)."""
        import keras

        if self.num_shards == 1 or x is None or not self.shardable_arrays(x):
            return x, None
        step = self.replica_batch(batch_size or 32) * self.num_shards
        samples = len(keras.tree.flatten(x)[0])
        rest = samples % step
        if rest == 0 or rest >= self.num_shards:
            return x, None
        extra = self.num_shards - rest
        padded = keras.tree.map_structure(
            lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[-1:], extra, axis=0)]), x
        )
        return padded, samples

    @staticmethod
    def shardable_arrays(x: Any) -> bool:
        import tensorflow as tf

        if isinstance(x, dict):
            return all(Sharding.shardable_arrays(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return all(Sharding.shardable_arrays(v) for v in x)
        return isinstance(x, (np.ndarray, tf.Tensor)) or hasattr(x, "__array__")

    def shard(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: Any = False) -> tuple:
        """This replica's part of the data, as (x, y, sample_weight, batch_size) for Keras."""
        import keras
        import tensorflow as tf

        if self.num_shards == 1 or x is None:
            return x, y, sample_weight, batch_size
        if getattr(x, "_rdkeras_per_replica", False):  # from distribute_datasets_from_function: already split
            return x, None, None, None
        if isinstance(x, tf.data.Dataset):
            return (self._split_dataset(x) if self.global_batch else self._deal_dataset(x)), None, None, None
        if isinstance(x, keras.utils.PyDataset):
            return _ShardedPyDataset(x, self), None, None, None
        if self.shardable_arrays(x):
            return self._split_arrays(x, y, sample_weight, batch_size or 32)
        raise TypeError(
            f"rdkeras cannot shard input of type {type(x).__name__}: pass NumPy arrays, "
            "a tf.data.Dataset or a keras.utils.PyDataset"
        )

    # -- arrays --------------------------------------------------------------------

    def _split_arrays(self, x: Any, y: Any, sample_weight: Any, batch_size: int) -> tuple:
        import keras

        n, r = self.num_shards, self.index
        per = self.replica_batch(batch_size)
        step = per * n  # rows per global step
        samples = len(keras.tree.flatten(x)[0])
        steps, rest = divmod(samples, step)
        mine = np.arange(steps * step).reshape(steps, n, per)[:, r, :].ravel()
        if rest:
            # The last, partial global batch, split as evenly as possible; with fewer rows than
            # replicas, some would have no batch at all (and run one step less): dropped.
            if rest >= n:
                start, size = split_rows(rest, n, r)
                mine = np.concatenate([mine, steps * step + start + np.arange(size)])
            else:
                self.warn_once(
                    "drop",
                    f"{samples} samples: the last {rest} do not make a row for each of the {n} replicas; "
                    f"each epoch uses {steps * step}",
                )
        if mine.size == 0:
            raise ValueError(f"{samples} samples cannot give each of {n} replicas a row (batch_size={batch_size})")

        def take(a: Any) -> Any:
            return None if a is None else keras.tree.map_structure(lambda v: np.asarray(v)[mine], a)

        return take(x), take(y), take(sample_weight), per

    # -- tf.data -----------------------------------------------------------------

    def _split_dataset(self, ds: Any) -> Any:
        """Each element is a global batch: keep this replica's rows of it."""
        import tensorflow as tf

        n, r = self.num_shards, self.index
        flat_spec = tf.nest.flatten(ds.element_spec)
        rows = flat_spec[0].shape[0] if flat_spec and flat_spec[0].shape.rank else None
        if flat_spec and not flat_spec[0].shape.rank:
            raise ValueError(
                "the dataset yields unbatched elements: batch it at the global batch size "
                f"(dataset.batch(global_batch)); each of the {n} replicas then takes its part of every batch"
            )
        per = self.replica_batch(rows, "the dataset's batch size") if rows is not None else None

        def part(*element: Any) -> Any:
            structure = element[0] if len(element) == 1 else element
            first = tf.nest.flatten(structure)[0]
            total = tf.shape(first, out_type=tf.int64)[0]
            base, extra = total // n, total % n
            start = r * base + tf.minimum(tf.constant(r, tf.int64), extra)
            size = base + tf.cast(r < extra, tf.int64)

            def cut(t: Any) -> Any:
                out = t[start : start + size]
                return tf.ensure_shape(out, [per, *t.shape[1:]]) if per is not None else out

            return tf.nest.map_structure(cut, structure)

        return ds.map(part)

    def _deal_dataset(self, ds: Any) -> Any:
        """Per-replica batches (global_batch=False): replica r takes batches r, r+n, ... (equal counts)."""
        n, r = self.num_shards, self.index
        sharded = ds.shard(n, r)
        cardinality = int(ds.cardinality())
        if cardinality >= 0:
            if cardinality % n:
                self.warn_once(
                    "uneven",
                    f"dropping {cardinality % n} of {cardinality} batches per epoch "
                    f"so that all {n} replicas run the same number of steps",
                )
            return sharded.take(cardinality // n)
        self.warn_once(
            "unknown",
            "dataset of unknown length: make sure every replica gets the same "
            "number of batches (pass steps_per_epoch), or training will stall",
        )
        return sharded


class _ShardedPyDataset:
    """A PyDataset's view for one replica: its part of every global batch (or, per replica, every n-th batch)."""

    def __new__(cls, base: Any, sharding: Sharding) -> Any:
        import keras

        n, r, split = sharding.num_shards, sharding.index, sharding.global_batch

        def part(batch: Any) -> Any:
            rows = len(keras.tree.flatten(batch)[0])
            start, size = split_rows(rows, n, r)
            return keras.tree.map_structure(lambda a: a[start : start + size], batch)

        class Sharded(keras.utils.PyDataset):
            def __init__(self) -> None:
                super().__init__(
                    workers=getattr(base, "workers", 1),
                    use_multiprocessing=getattr(base, "use_multiprocessing", False),
                    max_queue_size=getattr(base, "max_queue_size", 10),
                )

            def __len__(self) -> int:
                return len(base) if split else len(base) // n

            def __getitem__(self, i: int) -> Any:
                return part(base[i]) if split else base[i * n + r]

            def on_epoch_end(self) -> None:
                base.on_epoch_end()

        return Sharded()


def global_batches(
    x: Any, y: Any, sample_weight: Any, batch_size: int, shuffle: Any, seed: int, workers: int, epoch: int = 0
) -> Any:
    """Arrays as a PyDataset of whole global batches, the same on every worker (an elastic job splits each one
    inside the step, by the world of the moment): rows reshuffled every epoch by a permutation drawn from `seed`
    and the epoch (with ``shuffle``; `epoch`: the first), a last batch too small to give each of `workers` a row
    dropped."""
    import keras

    samples = len(keras.tree.flatten(x)[0])
    batches, rest = divmod(samples, batch_size)
    if rest >= workers:
        batches += 1
    elif rest:
        logger.warning(f"{samples} samples: the last {rest} do not make a row for each of the {workers} workers; "
                       f"each epoch uses {samples - rest}")  # fmt: skip
    if batches == 0:
        raise ValueError(f"{samples} samples cannot give each of {workers} workers a row (batch_size={batch_size})")

    class GlobalBatches(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = epoch  # (a replacement starts where the group is)
            self.order = self._order()

        def _order(self) -> np.ndarray:
            if not shuffle:
                return np.arange(samples)
            return np.random.default_rng([seed, self.epoch]).permutation(samples)

        def __len__(self) -> int:
            return batches

        def __getitem__(self, i: int) -> Any:
            rows = self.order[i * batch_size : (i + 1) * batch_size]
            parts = tuple(keras.tree.map_structure(lambda v: np.asarray(v)[rows], a)
                          for a in (x, y, sample_weight) if a is not None)  # fmt: skip
            return parts if len(parts) > 1 else parts[0]

        def on_epoch_end(self) -> None:
            self.epoch += 1
            self.order = self._order()

    if sample_weight is not None and y is None:
        raise ValueError("sample_weight needs y")
    return GlobalBatches()


def shard_fit_arguments(a: dict, sharding: Sharding) -> None:
    """Gives this replica its part of fit's training and validation data, in place in `a`
    (fit's bound arguments). ``validation_split`` is applied first, to the whole arrays."""
    from rdkeras import keras_internals

    if a["validation_split"] and a["validation_data"] is None and sharding.shardable_arrays(a["x"]):
        (a["x"], a["y"], a["sample_weight"]), a["validation_data"] = keras_internals.train_validation_split(
            (a["x"], a["y"], a["sample_weight"]), a["validation_split"]
        )
        a["validation_split"] = 0.0
    validation_batch = a["validation_batch_size"] or a["batch_size"]
    a["x"], a["y"], a["sample_weight"], a["batch_size"] = sharding.shard(
        a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=a["shuffle"]
    )
    if a["validation_data"] is not None:
        vx, vy, vw = unpack(a["validation_data"])
        vx, vy, vw, a["validation_batch_size"] = sharding.shard(vx, vy, vw, validation_batch, shuffle=False)
        a["validation_data"] = vx if vy is None else (vx, vy) if vw is None else (vx, vy, vw)


def unpack(data: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of a Keras data tuple."""
    if isinstance(data, tuple):
        return (*data, None, None)[:3]  # type: ignore[return-value]
    return data, None, None
