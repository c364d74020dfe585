"""Data parallelism: every worker holds the whole model and trains on its part of each global batch.

Attaching to a compiled model (through :mod:`rdkeras.fitting`, on the objects
themselves, never their classes):
- the optimizer's ``apply`` first averages the gradients across workers (ring
  allreduce in the engine), or runs the parameter-server step
  (:mod:`rdkeras.parallel.parameter_server`) -- custom ``train_step`` overrides
  keep working;
- ``fit``/``evaluate``/``predict`` split each global batch over the workers
  (:mod:`rdkeras.parallel.sharding`); at the start of every ``fit`` the chief's
  weights and optimizer state (a restored backup included) are copied to
  everyone; epoch and evaluation metrics are averaged (so EarlyStopping and
  ReduceLROnPlateau decide alike); ``predict`` gathers every worker's rows, so
  each returns the whole, ordered predictions.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras import fitting, keras_internals
from rdkeras._log import logger
from rdkeras.engine import Engine
from rdkeras.fitting import global_batch
from rdkeras.parallel import collectives, replicas
from rdkeras.parallel.base import Parallelism
from rdkeras.parallel.batch_norm import SynchronizedMoments
from rdkeras.parallel.collectives import Collectives, GradientAllreduce, share_variables
from rdkeras.parallel.exchange_plan import ExchangePlan
from rdkeras.parallel.replica_steps import ReplicaSteps
from rdkeras.parallel.sharded_optimizer import ShardedUpdate
from rdkeras.parallel.sharded_parameters import ShardedParameters
from rdkeras.parallel.sharded_state import ShardedState
from rdkeras.parallel.sharding import Sharding, shard_fit_arguments
from rdkeras.parallel.step_sum import StepSum

if TYPE_CHECKING:
    from rdkeras.elastic.membership import Membership


class DataParallel(ReplicaSteps, ShardedState, Parallelism):
    """Attaches data-parallel training to compiled Keras models.

    Args:
        engine: The job's engine.
        mode: "allreduce" (ring allreduce of the gradients) or "ps" (parameter servers sharded over
            the workers).
        bucket_bytes: Bytes the ring moves per pass.
        global_batch: Whether ``batch_size`` is the global batch (default) or per worker.
        overlap_bytes: Gradient bucket size with which the exchange overlaps backprop, for models attached
            from now on (0: one exchange after the backward pass; None: the transport's default,
            :func:`rdkeras.parallel.collectives.overlap_bytes`).
        algorithm: The allreduce: "auto" (hierarchical across hosts of equal worker counts, else the ring; small
            tensors by recursive doubling), "ring", "hierarchical" or "doubling"
            (:class:`rdkeras.parallel.collectives.Collectives`).
        compression: None, "fp16" or "bf16": the type float32 gradients cross hosts as.
        compress_within_hosts: Compress inside each host too.
        sparse_as_dense: Exchange sparse gradients (an Embedding's) as dense tensors by allreduce, as Horovod's
            switch of that name does; by default they travel as their rows and indices (an allgather), and the
            optimizer gets the IndexedSlices one process would.
    """

    def __init__(
        self,
        engine: Engine,
        mode: str = "allreduce",
        bucket_bytes: int = 64 << 20,
        global_batch: bool = True,
        overlap_bytes: int | None = None,
        algorithm: str = "auto",
        compression: str | None = None,
        compress_within_hosts: bool = False,
        membership: Membership | None = None,
        sparse_as_dense: bool = False,
        shard: str = "none",
    ):
        self.engine, self.mode, self.overlap_bytes = engine, mode, overlap_bytes
        self.sparse_as_dense, self.shard = sparse_as_dense, shard
        if compression and mode == "ps":
            raise ValueError(f"compression={compression!r} compresses the allreduce: use mode='allreduce'")
        if membership is not None:
            membership.check(mode, global_batch, shard)
        self.membership = membership
        self._averages: list[GradientAllreduce] = []  # their bucket pipelines are reset when the group re-forms
        self._shard: Any = None  # elastic: tf.Variable [rank, world] the step splits its global batch by
        self.collectives = Collectives(
            engine,
            bucket_bytes,
            algorithm=algorithm,
            compression=compression,
            compress_within_hosts=compress_within_hosts,
        )
        self.sharding = Sharding(engine.world_size, engine.rank, global_batch, warn=engine.rank == 0)
        self.step_sum = StepSum(self.collectives)
        self.batch_norm = SynchronizedMoments(self.step_sum)
        # Whether the steps split each batch they get into the replicas' rows: global batches (the default) as
        # Keras iterates them from the user's data, so their order, shuffle included, is one process's. Not for
        # per-replica batches (global_batch=False, distribute_datasets_from_function), dealt out beforehand.
        self._split_in_step = global_batch
        self._models: list[Any] = []
        self._overlap = 0  # the last attached model's gradient bucket bytes (0: one exchange after backprop)
        self._servers: dict[int, Any] = {}  # id(model) -> its ParameterServer
        self._sharded: dict[int, ShardedUpdate] = {}  # id(model) -> its sharded update (shard != "none")
        self._parameters: dict[int, ShardedParameters] = {}  # id(model) -> its sharded weights (shard="parameters")
        self._saving: dict[int, list[Any]] = {}  # id(model) -> what a file holds of its sharded optimizer now
        self._told_saved_in_part = False
        self._gathered_at: dict[int, int] = {}  # id(model) -> the steps_run it was last gathered and checked at
        self._plans = itertools.count()  # parameter-server plans made (each has rings of its own)

    @property
    def replicas(self) -> int:
        return self.engine.world_size

    @property
    def reporter_rank(self) -> int:
        return 0

    @property
    def models(self) -> list[Any]:
        return list(self._models)

    # -- attaching -------------------------------------------------------------------

    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train data-parallel. Idempotent; a model compiled again (its trainable
        weights changed, or a new optimizer) gets its new optimizer's exchange planned."""
        if fitting.parallel_of(model) is self:
            self._replan(model)
            return model
        if not self._check_attachable(model):
            return model
        if model.jit_compile:
            self.sharding.warn_once("jit", "jit_compile turned off: the gradient exchange runs as a tf.numpy_function")
        if self.num_workers > 1 and self.mode == "allreduce":
            described = self.collectives.describe()  # collective (every worker attaches); the plan reads it later
            if self.engine.rank == 0 and (self.collectives.requested != "ring" or self.collectives.compression):
                logger.info(f"allreduce: {described}")
        self._distribute_optimizer(model)
        self.batch_norm.attach(model)
        fitting.distribute_model(model, self)
        self._models.append(model)
        return model

    def _distribute_optimizer(self, model: Any) -> None:
        """The compiled optimizer's ``apply`` exchanges the gradients first (for the trainable weights of the
        moment: a recompile after a change of ``trainable`` plans anew)."""
        optimizer = model.optimizer
        hierarchical = False
        if self.num_workers > 1 and self.mode == "allreduce":
            hierarchical = self.collectives.algorithm[0] == "hierarchical"
        overlap = self.overlap_bytes
        if overlap is None:
            overlap = collectives.overlap_bytes(self.engine.capabilities, hierarchical)
        self._overlap = overlap  # the plan says it
        if self.mode == "ps":
            from rdkeras.parallel.parameter_server import ParameterServer

            previous = self._servers.get(id(model))
            if previous is not None:
                previous.stop()
            ps = ParameterServer(self.engine, f"opt{next(self._plans)}", overlap_bytes=overlap)
            self._servers[id(model)] = ps
            fitting.distribute_optimizer(keras_internals.inner_optimizer(optimizer), ps.apply)
            # Owners update different variables: all must agree whether a mixed-precision step is skipped.
            fitting.agree_on_finite_gradients(optimizer, self._all_finite)
        elif self.shard == "parameters":
            self._shard_parameters(model)
        elif self.shard != "none":
            self._shard_optimizer(model, overlap)
        else:
            average = GradientAllreduce(self.collectives, overlap_bytes=overlap, sparse_as_dense=self.sparse_as_dense)
            self._averages.append(average)
            _average_gradients(optimizer, average)

    def _replan(self, model: Any) -> None:
        """A model compiled again, in the scope or out of it: its new optimizer exchanges its gradients too."""
        optimizer = model.optimizer
        if optimizer is None or any(
            keras_internals.overridden(o) for o in (optimizer, keras_internals.inner_optimizer(optimizer))
        ):
            return
        self._distribute_optimizer(model)
        fitting.reset_compiled_functions(model)

    def prepare_fit(self, model: Any) -> None:
        """Distributes the optimizers a custom ``compile`` keeps in the model's attributes (a GAN's two): their
        ``apply`` averages the gradients too, so the replicas train as one (allreduce mode only). An elastic
        job's replacement first waits here to be taken into the group."""
        if self.membership is not None and self.membership.joining:
            self.membership.join_fit(self, model)
        self._replan(model)  # compiled again outside the scope
        extra = fitting.undistributed_own_optimizers(model)
        if not extra:
            return
        if self.mode == "ps":
            names = ", ".join(repr(o.name) for o in extra)
            raise ValueError(
                f"model {model.name!r} also applies gradients with its own optimizer(s) {names}; mode='ps' serves "
                "the compiled optimizer only: use mode='allreduce'"
            )
        average = GradientAllreduce(self.collectives)
        self._averages.append(average)
        for optimizer in extra:
            _average_gradients(optimizer, average)
            fitting.remember_own_optimizer(model, optimizer)
        fitting.reset_compiled_functions(model)  # a step traced before applied them undistributed

    def _forget_models(self) -> None:
        for model in self._models:
            self.batch_norm.detach(model)
        self._models.clear()
        for exchange in [*self._averages, *self._servers.values()]:
            exchange.stop()  # their threads would idle until the process ends
        self._averages.clear()
        self._servers.clear()
        self._sharded.clear()
        self._unshard_parameters()

    def _all_finite(self, local: Any) -> Any:
        import tensorflow as tf

        def verdict(ok: np.ndarray) -> np.ndarray:
            (bad,) = self.collectives.allreduce([np.asarray([0.0 if ok else 1.0])], average=False, purpose="finite")
            return np.asarray(bad[0] == 0.0)

        out = tf.numpy_function(verdict, [local], Tout=tf.bool, stateful=True, name="rdkeras_all_finite")
        out.set_shape(())
        return out

    # -- the hooks rdkeras.fitting calls ---------------------------------------------------

    def shard_fit(self, a: dict) -> None:
        self.global_batch_size = self.sharding.global_batch_of(a["x"], a["batch_size"])
        if self.membership is not None:
            return self.membership.keep_global_batches(self, a)
        if self._splits(a["x"]):
            return None  # Keras batches (and shuffles) the data as one process does; each step takes its rows
        shard_fit_arguments(a, self.sharding)

    def shard_evaluate(self, a: dict) -> None:
        if self.membership is not None or self._splits(a["x"]):
            return None  # whole global batches: the step takes its rows
        a["x"], a["y"], a["sample_weight"], a["batch_size"] = self.sharding.shard(
            a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=False
        )

    def shard_predict(self, a: dict) -> int | None:
        # Each worker predicts its part of every batch; predict_step gathers the rows back.
        if self.membership is not None or self._splits(a["x"]):
            return None
        a["x"], rows = self.sharding.pad_for_predict(a["x"], a["batch_size"])
        a["x"], _, _, a["batch_size"] = self.sharding.shard(a["x"], None, None, a["batch_size"])
        return rows

    def rebind(self, engine: Engine) -> None:
        """Runs on `engine` (an elastic group's next) from now on: nothing of the old engine's is kept."""
        self.engine = engine
        self.collectives.rebind(engine)
        self.sharding = Sharding(engine.world_size, engine.rank, True, warn=engine.rank == 0)
        self._shard_variable().assign([engine.rank, engine.world_size])
        for average in self._averages:
            average.reset()

    @property
    def _partial_state_between_epochs(self) -> str:
        # Each parameter server holds its own variables' optimizer state only.
        return "mode='ps'" if self.mode == "ps" else ""

    def sync_state(self, model: Any, restored: bool) -> None:
        """Gives every worker the chief's weights and optimizer state (and, after a restore, its epoch)."""
        # (a replacement taken in gets the state of the group's source, as it is now)
        welcomed = self.membership is not None and self.membership.take_welcome(self, model)
        if not welcomed and self.num_workers > 1:
            restored = self._share_restore(model, restored, root=0)
            variables = self._whole_variables(model, keras_internals.state_variables(model))
            share_variables(self.collectives, variables, [0] * len(variables))
            if restored:
                self._restore_optimizer_shards(model)
        self._lay_out_parameters(model)
        self.synced = True

    def gather_state(self, model: Any) -> None:
        """PS mode: each optimizer slot from the worker that owns its variable; then the replicas made to
        agree and checked (:meth:`check_replicas`). Collective; nothing to do where no step ran since."""
        ps = self._servers.get(id(model))
        if self._gathered_at.get(id(model)) == self.steps_run:  # (counted here: a recompile restarts iterations)
            return
        self._gathered_at[id(model)] = self.steps_run
        if ps is not None and ps.owner:
            optimizer = keras_internals.inner_optimizer(model.optimizer)
            slots = [(v, ps.owner[i]) for v, i in keras_internals.optimizer_slot_references(
                optimizer, model.trainable_variables) if i is not None]  # fmt: skip
            share_variables(self.collectives, [v for v, _ in slots], [o for _, o in slots])
        self.check_replicas(model, when=f"after {self.steps_run} steps")

    def check_replicas(self, model: Any, when: str = "") -> None:
        """Averages the model's non-trainable float state over the replicas where it differs (BatchNormalization's
        statistics), and fails on every worker naming the first other variable that differs (collective)."""
        variables = self._whole_variables(model, keras_internals.state_variables(model))
        averaged = replicas.averaged_on_disagreement(variables, model.non_trainable_variables)
        replicas.agree(self.collectives, variables, averaged, when or "at this check")

    def epoch_logs(self, model: Any, logs: Any) -> Any:
        """The metrics' results from their state merged over the replicas: one process's AUC or recall over the
        whole data, not the mean of each worker's. A custom step's logs that name one of the model's metrics get
        its merged result too; its other scalar logs are averaged."""
        import keras

        with global_batch.reduced_metric_state(model.metrics, self.collectives):
            results = keras_internals.original(model, keras_internals.EPOCH_LOGS_HOOK)(logs)
            if results is not logs:  # Keras's metrics' results
                return keras.tree.map_structure(np.array, results)
            if not isinstance(logs, dict):
                return logs
            metrics = {m.name: m for m in model.metrics}
            merged = {k: keras.tree.map_structure(np.array, metrics[k].result()) for k in logs if k in metrics}
        rest = self.share_logs({k: v for k, v in logs.items() if k not in merged})
        return {k: merged[k] if k in merged else rest[k] for k in logs}

    def share_logs(self, logs: dict) -> dict:
        """The scalar logs averaged over the workers (a custom step's own numbers)."""
        keys = [k for k, v in logs.items() if _scalar(v)]
        means = self.collectives.mean([float(logs[k]) for k in keys])
        return {**logs, **dict(zip(keys, means, strict=True))}

    # -- the plan ---------------------------------------------------------------------------

    @property
    def plan(self) -> ExchangePlan | None:
        """What each step of the last attached model sends (None before a model is attached)."""
        if not self._models:
            return None
        model = self._models[-1]
        variables = [
            (v.path, tuple(v.shape), str(v.dtype), int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize)
            for v in model.trainable_variables
        ]
        algorithm = ("ring", "one worker")
        if self.num_workers > 1:
            gradients = sum(v[3] + 64 for v in variables)
            algorithm = (self.collectives.algorithm_for(gradients), self.collectives.describe())
        return ExchangePlan(
            self.mode, self.num_workers, self.engine.transport, self.global_batch_size, variables,
            self.collectives.bucket_bytes, algorithm, self._overlap,
        )  # fmt: skip


def _scalar(value: Any) -> bool:
    """Whether a log is a number (a Python or NumPy one, or a 0-d tensor or array): not a dict of results."""
    return isinstance(value, (int, float, np.number)) or (hasattr(value, "dtype") and np.ndim(value) == 0)


def _average_gradients(optimizer: Any, average: GradientAllreduce) -> None:
    """`optimizer.apply` averages the gradients over the replicas first (allreduce mode)."""
    fitting.distribute_optimizer(optimizer, lambda _opt, base, grads, variables: base(average(grads), variables))
