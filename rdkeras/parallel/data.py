"""Data parallelism: every worker holds the whole model and a shard of the data.

Attaching to a compiled model changes three things and nothing else:
- the optimizer's class gains an ``apply`` that averages gradients across
  workers before the update (ring allreduce in the engine, or a parameter
  server) -- so custom ``train_step`` overrides keep working;
- the model's class gains ``fit``/``evaluate``/``predict`` that shard the data,
  broadcast the chief's initial weights, keep checkpoints, TensorBoard and the
  progress bar on the chief, and average epoch/evaluation metrics over workers
  (so EarlyStopping and ReduceLROnPlateau decide the same on every worker);
- ``jit_compile`` is turned off: the allreduce is a ``tf.numpy_function``.

Global batch = the ``batch_size`` passed to ``fit`` (per worker) x workers.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import numpy as np

from rdkeras._log import logger
from rdkeras.engine import Engine

_CHIEF_ONLY_CALLBACKS = ("ModelCheckpoint", "TensorBoard", "CSVLogger", "BackupAndRestore")
_FLOAT_KINDS = ("float32", "float64")


class Collectives:
    """Allreduce helpers over the engine, created lazily and identically on every worker."""

    def __init__(self, engine: Engine, bucket_bytes: int, members: list[int] | None = None, name: str = ""):
        self.engine, self.bucket_bytes, self.name = engine, bucket_bytes, name
        self.members = list(range(engine.world_size)) if members is None else list(members)
        self._rings: dict[tuple[str, str], tuple[Any, int]] = {}
        self._serial = itertools.count()

    def _ring(self, purpose: str, dtype: str, nbytes: int) -> Any:
        ring, capacity = self._rings.get((purpose, dtype), (None, 0))
        needed = nbytes + 64 * 1024  # 64-byte padding per tensor, generously
        if ring is None or needed > capacity:
            capacity = max(needed, 2 * capacity, 1 << 20)
            ring = self.engine.ring(
                f"{self.name}{purpose}/{dtype}/{next(self._serial)}", capacity, self.bucket_bytes, self.members
            )
            self._rings[(purpose, dtype)] = (ring, capacity)
        return ring

    def allreduce(self, arrays: list[np.ndarray], average: bool, purpose: str = "grads") -> list[np.ndarray]:
        """Sums (averages) same-shaped lists of float arrays across workers; one ring call per dtype."""
        out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.name, []).append(i)
        for dtype, idx in sorted(groups.items()):
            if dtype not in _FLOAT_KINDS:
                raise TypeError(f"cannot allreduce {dtype} tensors (float32/float64 only)")
            group = [np.ascontiguousarray(arrays[i]) for i in idx]
            ring = self._ring(purpose, dtype, sum(a.nbytes + 64 for a in group))
            for i, r in zip(idx, ring(group, average), strict=True):
                out[i] = r
        return out

    def broadcast(self, arrays: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """Every worker gets `root`'s arrays (a sum where the others contribute zeros: exact)."""
        mine = arrays if self.engine.rank == root else [np.zeros_like(a) for a in arrays]
        return [r.copy() for r in self.allreduce(mine, average=False, purpose="sync")]

    def mean(self, values: list[float]) -> list[float]:
        if len(self.members) == 1 or not values:
            return list(values)
        (out,) = self.allreduce([np.asarray(values, np.float64)], average=True, purpose="sync")
        return [float(v) for v in out]


class GradientAllreduce:
    """Averages a step's gradients across workers inside the compiled train function."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def __call__(self, grads: list[Any]) -> list[Any]:
        import tensorflow as tf

        idx = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]  # IndexedSlices (embeddings) -> dense
        wire = [g if g.dtype.name in _FLOAT_KINDS else tf.cast(g, tf.float32) for g in dense]
        reduced = tf.numpy_function(
            self._reduce, wire, Tout=[g.dtype for g in wire], stateful=True, name="rdkeras_allreduce"
        )
        out = list(grads)
        for i, g, r in zip(idx, dense, reduced, strict=True):
            r.set_shape(g.shape)
            out[i] = r if r.dtype == g.dtype else tf.cast(r, g.dtype)
        return out

    def _reduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        # The inputs are views of TensorFlow's buffers; the outputs are 64-byte
        # aligned views of registered memory, which TensorFlow aliases.
        return self.collectives.allreduce(list(arrays), average=True)


def _distributed_optimizer_class(base: type, reducer: Any) -> type:
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        return base.apply(self, reducer(list(grads)), trainable_variables)

    return type(base.__name__, (base,), {"apply": apply, "_rdkeras_base": base})


class _DistributedModel:
    """Mixed into the user's model class (ahead of it) by DataParallel.attach."""

    _rdkeras: DataParallel

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        a = _bind(self._rdkeras_base.fit, self, args, kwargs)
        dp = self._rdkeras
        shard_fit_arguments(a, dp.sharding)
        dp.batch_size = a["batch_size"]  # per worker, when known (for TrainingStats)
        a["callbacks"], a["verbose"] = dp.worker_callbacks(a["callbacks"], a["verbose"])
        return self._rdkeras_base.fit(self, **a)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: already sharded
            return self._rdkeras_base.evaluate(self, *args, **kwargs)
        a = _bind(self._rdkeras_base.evaluate, self, args, kwargs)
        dp = self._rdkeras
        a["x"], a["y"], a["sample_weight"], a["batch_size"] = dp.sharding.shard(
            a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=False
        )
        a["callbacks"], a["verbose"] = dp.worker_callbacks(a["callbacks"], a["verbose"])
        return self._rdkeras_base.evaluate(self, **a)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        # Every worker predicts all of its input (results in input order, as users expect).
        a = _bind(self._rdkeras_base.predict, self, args, kwargs)
        a["callbacks"], a["verbose"] = self._rdkeras.worker_callbacks(a["callbacks"], a["verbose"])
        return self._rdkeras_base.predict(self, **a)

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> None:
        # Keras builds lazily on the first traced step when no tf.distribute
        # strategy is set; build now, so the chief's weights can be broadcast
        # before any worker computes a gradient.
        if not self._rdkeras.synced:
            if iterator is not None and data_batch is None:
                for _, _, it in iterator:
                    data_batch = next(it)
                    break
            if data_batch is not None:
                self._symbolic_build(data_batch=data_batch)
            self._rdkeras.sync_weights(self)
        self._rdkeras_base._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)

    def _get_metrics_result_or_logs(self, logs: Any) -> Any:
        # Called once per epoch and once per evaluate, on every worker alike.
        result = self._rdkeras_base._get_metrics_result_or_logs(self, logs)
        keys = [k for k, v in result.items() if np.ndim(v) == 0]
        means = self._rdkeras.collectives.mean([float(result[k]) for k in keys])
        return {**result, **dict(zip(keys, means, strict=True))}


def reporting_callbacks(callbacks: Any, verbose: Any, reporter: bool) -> tuple[Any, Any]:
    """(callbacks, verbose) for a worker: the reporter keeps all; the others drop the chief-only
    callbacks (checkpoints, TensorBoard, CSV) and the progress bar."""
    if reporter:
        return callbacks, verbose
    return [c for c in (callbacks or []) if type(c).__name__ not in _CHIEF_ONLY_CALLBACKS], 0


def shard_fit_arguments(a: dict, sharding: Sharding) -> None:
    """Gives this worker its part of fit's training and validation data, in place in `a`
    (fit's bound arguments). ``validation_split`` is applied first, to the whole arrays."""
    if a["validation_split"] and a["validation_data"] is None and sharding.shardable_arrays(a["x"]):
        from keras.src.trainers.data_adapters import array_slicing

        (a["x"], a["y"], a["sample_weight"]), a["validation_data"] = array_slicing.train_validation_split(
            (a["x"], a["y"], a["sample_weight"]), validation_split=a["validation_split"]
        )
        a["validation_split"] = 0.0
    a["x"], a["y"], a["sample_weight"], a["batch_size"] = sharding.shard(
        a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=a["shuffle"]
    )
    if a["validation_data"] is not None:
        vx, vy, vw = _unpack(a["validation_data"])
        vx, vy, vw, a["validation_batch_size"] = sharding.shard(
            vx, vy, vw, a["validation_batch_size"] or a["batch_size"], shuffle=False
        )
        a["validation_data"] = vx if vy is None else (vx, vy) if vw is None else (vx, vy, vw)


def _bind(method: Any, self: Any, args: tuple, kwargs: dict) -> dict:
    bound = inspect.signature(method).bind(self, *args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.pop("self")
    a.update(a.pop("kwargs", {}))
    return a


def _unpack(data: Any) -> tuple[Any, Any, Any]:
    if isinstance(data, tuple):
        return (*data, None, None)[:3]  # type: ignore[return-value]
    return data, None, None


class DataParallel:
    """Attaches data-parallel training to compiled Keras models."""

    def __init__(self, engine: Engine, mode: str = "allreduce", bucket_bytes: int = 64 << 20, seed: int = 1234):
        if mode not in ("allreduce", "ps"):
            raise ValueError(f"data.mode must be 'allreduce' or 'ps', got {mode!r}")
        self.engine, self.mode, self.seed = engine, mode, seed
        self.collectives = Collectives(engine, bucket_bytes)
        self.synced = False
        self.sharding = Sharding(engine.world_size, engine.rank, warn=engine.rank == 0)
        self._attached: list[Any] = []
        self.batch_size: int | None = None

    @property
    def num_workers(self) -> int:
        return self.engine.world_size

    @property
    def rank(self) -> int:
        return self.engine.rank

    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train data-parallel. Idempotent."""
        if getattr(model, "_rdkeras", None) is not None:
            return model
        if model.optimizer is None:
            raise ValueError("compile the model (with an optimizer) before distributing it")
        if model.jit_compile:
            self._warn_once("jit", "jit_compile turned off: the allreduce runs as a tf.numpy_function")
        model.jit_compile = False
        opt = model.optimizer
        if self.mode == "ps":
            from rdkeras.parallel.ps import ParameterServer, ps_optimizer_class

            ps = ParameterServer(self.engine, f"opt{len(self._attached)}")
            opt.__class__ = ps_optimizer_class(opt.__class__, ps)
        else:
            opt.__class__ = _distributed_optimizer_class(opt.__class__, GradientAllreduce(self.collectives))
        self._attached.append(model)
        base = model.__class__
        model.__class__ = type(base.__name__, (_DistributedModel, base), {"_rdkeras_base": base})
        object.__setattr__(model, "_rdkeras", self)
        return model

    def sync_weights(self, model: Any) -> None:
        """Gives every worker the chief's weights (float variables; optimizer slots start equal)."""
        variables = [v for v in model.weights if np.dtype(v.dtype).name in _FLOAT_KINDS]
        if self.num_workers > 1 and variables:
            values = self.collectives.broadcast([np.asarray(v.numpy()) for v in variables])
            for v, value in zip(variables, values, strict=True):
                v.assign(value)
        self.synced = True

    def worker_callbacks(self, callbacks: Any, verbose: Any) -> tuple[Any, Any]:
        """The chief keeps every callback and the progress bar; other workers drop the chief-only ones."""
        return reporting_callbacks(callbacks, verbose, self.engine.rank == 0)

    def _warn_once(self, key: str, message: str) -> None:
        self.sharding.warn_once(key, message)


class Sharding:
    """Shard `index` of `num_shards` of each input: every worker (data parallelism) or every
    pipeline replica (hybrid) trains on its own part, all parts the same number of steps."""

    def __init__(self, num_shards: int, index: int, warn: bool = True):
        self.num_shards, self.index, self.warn = num_shards, index, warn
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self.warn:
            self._warned.add(key)
            logger.warning(message)

    @staticmethod
    def shardable_arrays(x: Any) -> bool:
        import tensorflow as tf

        if isinstance(x, dict):
            return all(Sharding.shardable_arrays(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return all(Sharding.shardable_arrays(v) for v in x)
        return isinstance(x, (np.ndarray, tf.Tensor)) or hasattr(x, "__array__")

    def shard(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: Any = False) -> tuple:
        """This worker's part of the data, as (x, y, sample_weight, batch_size) for Keras."""
        import keras
        import tensorflow as tf

        n, r = self.num_shards, self.index
        if n == 1 or x is None:
            return x, y, sample_weight, batch_size
        if isinstance(x, tf.data.Dataset):
            ds = x.shard(n, r)
            cardinality = int(x.cardinality())
            if cardinality >= 0:
                if cardinality % n:
                    self.warn_once(
                        "uneven",
                        f"dropping {cardinality % n} of {cardinality} batches per epoch "
                        f"so that all {n} workers run the same number of steps",
                    )
                ds = ds.take(cardinality // n)
            else:
                self.warn_once(
                    "unknown",
                    "dataset of unknown length: make sure every worker gets the same "
                    "number of batches (pass steps_per_epoch), or training will stall",
                )
            return ds, None, None, None
        if isinstance(x, keras.utils.PyDataset):
            return _ShardedPyDataset(x, n, r), None, None, None
        if self.shardable_arrays(x):
            # Worker r takes batches r, r+n, r+2n, ... of the arrays, copied once
            # here; Keras's own (fast) array adapter then batches them, and with
            # shuffle=True reshuffles the worker's part every epoch. Unshuffled,
            # step k's global batch is exactly samples [k*n*b, (k+1)*n*b).
            import keras

            batch_size = batch_size or 32
            samples = len(keras.tree.flatten(x)[0])
            steps = samples // (batch_size * n)
            if steps == 0:
                raise ValueError(f"{samples} samples cannot fill one batch of {batch_size} on each of {n} workers")
            if samples % (batch_size * n):
                self.warn_once(
                    "drop",
                    f"{samples} samples: each epoch uses {steps * n * batch_size} "
                    f"(whole batches of {batch_size} x {n} workers)",
                )
            mine = np.arange(steps * n * batch_size).reshape(steps, n, batch_size)[:, r, :].ravel()

            def take(a: Any) -> Any:
                return None if a is None else keras.tree.map_structure(lambda v: np.asarray(v)[mine], a)

            return take(x), take(y), take(sample_weight), batch_size
        raise TypeError(
            f"rdkeras cannot shard input of type {type(x).__name__}: pass NumPy arrays, "
            "a tf.data.Dataset or a keras.utils.PyDataset"
        )


class _ShardedPyDataset:
    """Worker r of n sees batches r, r+n, r+2n, ... of a PyDataset (the same count on every worker)."""

    def __new__(cls, base: Any, n: int, r: int) -> Any:
        import keras

        class Sharded(keras.utils.PyDataset):
            def __init__(self) -> None:
                super().__init__(
                    workers=getattr(base, "workers", 1),
                    use_multiprocessing=getattr(base, "use_multiprocessing", False),
                    max_queue_size=getattr(base, "max_queue_size", 10),
                )

            def __len__(self) -> int:
                return len(base) // n

            def __getitem__(self, i: int) -> Any:
                return base[i * n + r]

            def on_epoch_end(self) -> None:
                base.on_epoch_end()

        return Sharded()
