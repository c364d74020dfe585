"""Model (pipeline) parallelism, and hybrid: R replicas of a K-stage pipeline.

Every worker builds the user's whole model (cheap) but trains only its stage:
the layers the placement gives it (:mod:`rdkeras.graph`); the schedule is
:mod:`rdkeras.parallel.pipeline`, the per-step data :mod:`rdkeras.parallel.feeds`.
The reader (stage 0 of each replica) uses the data and sends each other stage
the model inputs it consumes and the loss worker the labels, directly. Loss,
metrics and the progress bar live on the loss worker; epoch logs are shared
with every worker (so EarlyStopping decides the same everywhere), and every
epoch ends with each layer's weights and optimizer slots copied from their
owner to all workers, so any worker can save the whole trained model.
Hybrid: rank = replica x K + stage; replicas split each global batch the
data-parallel way and average each stage's gradients over its replicas.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras._log import logger
from rdkeras.engine import Engine
from rdkeras.graph import Plan, analyze, assign_layers, build_stage
from rdkeras.parallel import pipeline as schedule
from rdkeras.parallel.collectives import Collectives, GradientAllreduce, share_variables
from rdkeras.parallel.feeds import data_specs
from rdkeras.parallel.sharding import Sharding, shard_fit_arguments, unpack


class Pipeline:
    """One plan (batch size, micro-batches) made real on this worker: its stage and channels."""

    def __init__(self, mp: ModelParallel, model: Any, plan: Plan, serial: int):
        self.plan, self.stage, self.serial = plan, build_stage(model, plan, mp.stage), serial
        self.fwd: dict[tuple[str, int], Any] = {}
        self.bwd: dict[tuple[str, int], Any] = {}
        self.predict_out: dict[int, Any] = {}
        engine, rank_of = mp.engine, mp.rank_of
        me = engine.rank
        # Every worker creates its channels in plan order: each creation waits for the
        # peer's, and one global order cannot deadlock.
        for e in plan.edges:
            src, dst = rank_of(e.src), rank_of(e.dst)
            if me not in (src, dst):
                continue
            for m in range(plan.micro_batches):
                base = f"mp{serial}/replica{mp.replica}/{e.name}/{m}"
                self.fwd[(e.name, m)] = _channel(engine, f"{base}/fwd", src, dst, e.shape, e.dtype, e.static)
                if e.needs_grad:
                    self.bwd[(e.name, m)] = _channel(engine, f"{base}/bwd", dst, src, e.shape, e.dtype, e.static)

    def ensure_predict_channels(self, mp: ModelParallel) -> None:
        """Loss worker -> every other stage of its replica: predictions (every worker returns them)."""
        if self.predict_out or mp.num_stages == 1:
            return
        loss = self.plan.loss_stage
        for s in range(mp.num_stages):
            if s != loss and mp.stage in (s, loss):
                name = f"mp{self.serial}/replica{mp.replica}/predict->{s}"
                self.predict_out[s] = mp.engine.dynamic_channel(name, mp.rank_of(loss), mp.rank_of(s))


def _channel(engine: Engine, name: str, src: int, dst: int, shape: tuple, dtype: str, static: bool) -> Any:
    if static:
        return engine.static_channel(name, src, dst, shape, dtype)
    return engine.dynamic_channel(name, src, dst)


class ModelParallel:
    """Attaches pipeline (and hybrid) training to compiled Functional/Sequential Keras models.

    Args:
        engine: The job's engine.
        placement: layer-name glob -> stage index (0..num_stages-1).
        num_stages: workers per pipeline (K); the job runs world_size / K replicas.
        micro_batches: M; each batch is split into M equal micro-batches (GPipe schedule).
        bucket_bytes: Bytes the ring moves per pass.
        global_batch: Whether ``batch_size`` is the global batch (split over replicas; default) or
            per replica.
    """

    def __init__(
        self,
        engine: Engine,
        placement: dict[str, int],
        num_stages: int | None = None,
        micro_batches: int = 1,
        bucket_bytes: int = 64 << 20,
        global_batch: bool = True,
    ):
        n = engine.world_size
        k = num_stages or n
        if k < 1 or n % k:  # (RDMAStrategy checked the placement itself: rdkeras.parallel.check_settings)
            raise ValueError(f"{n} workers cannot run replicas of a {k}-stage pipeline: world size must be a multiple")
        self.engine, self.placement, self.num_stages = engine, dict(placement), k
        self.micro_batches = int(micro_batches)
        self.replicas, self.replica, self.stage = n // k, engine.rank // k, engine.rank % k
        self.collectives = Collectives(engine, bucket_bytes)  # all workers: weights and logs
        group = [r * k + self.stage for r in range(self.replicas)]
        # Hybrid: each stage's gradients are averaged over its replicas, as data parallelism does.
        self.average_over_replicas = GradientAllreduce(Collectives(engine, bucket_bytes, group, name="stage/"))
        # Replicas split each global batch the data-parallel way.
        self.sharding = Sharding(self.replicas, self.replica, global_batch, warn=engine.rank == 0)
        self.synced = self.restored = self.fitting = False
        self.global_batch_size: int | None = None
        self._pipelines: dict[tuple, Pipeline] = {}
        self._current: dict[str, Pipeline] = {}
        self._serial = 0
        self._printed = False
        self._model: Any = None
        self._layer_stage: dict[str, int] = {}
        self._gathered_at: int | None = None
        self.loss_stage = k - 1

    def rank_of(self, stage: int) -> int:
        """This replica's worker running `stage`."""
        return self.replica * self.num_stages + stage

    @property
    def num_workers(self) -> int:
        return self.engine.world_size

    @property
    def reporter_rank(self) -> int:
        """The worker with the loss, metrics, progress bar and chief-only callbacks: replica 0's loss stage."""
        return self.loss_stage  # replica 0's worker of that stage

    @property
    def is_reporter(self) -> bool:
        return self.engine.rank == self.reporter_rank

    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train as a pipeline. Validates the placement now, before any
        worker waits on another."""
        if keras_internals.parallel_of(model) is self:
            return model
        if keras_internals.parallel_of(model) is not None:
            raise ValueError(f"model {model.name!r} is already distributed by another RDMAStrategy")
        if self._model is not None:
            raise ValueError("a model-parallel RDMAStrategy distributes one model; create another strategy")
        if model.optimizer is None:
            raise ValueError("compile the model (with an optimizer) before distributing it")
        self._layer_stage = assign_layers(model, self.placement, self.num_stages)
        # Cycles and the like are found now, with no data yet.
        self.loss_stage = analyze(model, self.placement, self.num_stages).loss_stage
        self._model = model
        keras_internals.distribute_model(model, self)
        return model

    def detach_all(self) -> None:
        if self._model is not None:
            keras_internals.undistribute(self._model)

    @property
    def models(self) -> list[Any]:
        return [] if self._model is None else [self._model]

    # -- plans ---------------------------------------------------------------------

    def prepare(self, purpose: str, x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> None:
        """Makes the pipeline for this data current (creating its channels the first time)."""
        model = self._model
        rows, label_specs, weight_specs = data_specs(x, y, sample_weight, batch_size)
        if purpose == "predict":  # predictions need no labels (a dataset may still yield them)
            label_specs = weight_specs = None
        micro = self.micro_batches if purpose != "predict" else 1
        if rows is not None and rows % micro:
            raise ValueError(
                f"batch size {rows} does not split into {micro} equal micro-batches: "
                "choose a batch size divisible by micro_batches"
            )
        key = (rows, micro, str(label_specs), str(weight_specs))
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            plan = analyze(model, self.placement, self.num_stages, rows, micro, label_specs, weight_specs)
            plan.replicas = self.replicas
            self._serial += 1
            pipeline = Pipeline(self, model, plan, self._serial)
            self._pipelines[key] = pipeline
            if not self._printed and self.engine.rank == 0:
                self._printed = True
                logger.info("%s", plan.text())
        if purpose == "predict":
            pipeline.ensure_predict_channels(self)
        if self._current.get(purpose) is not pipeline:
            self._current[purpose] = pipeline
            # Keras caches its compiled step; a new pipeline needs a new trace.
            attr = {"train": "train_function", "eval": "test_function", "predict": "predict_function"}[purpose]
            setattr(model, attr, None)

    def current(self, purpose: str) -> Pipeline:
        return self._current[purpose]

    @property
    def plan(self) -> Plan | None:
        """The current training plan (else the latest evaluation/prediction plan; None before any)."""
        pipeline = self._current.get("train") or next(iter(self._current.values()), None)
        return pipeline.plan if pipeline is not None else None

    def plan_text(self) -> str:
        """The current plan as text (for TensorBoard), or '' before the first fit."""
        plan = self.plan
        return plan.text() if plan is not None else ""

    # -- weights and logs ----------------------------------------------------------

    # -- the hooks rdkeras.keras_internals calls ---------------------------------------

    def shard_fit(self, a: dict) -> None:
        self.global_batch_size = self.sharding.global_batch_of(a["x"], a["batch_size"])
        shard_fit_arguments(a, self.sharding)  # over replicas (a no-op for one pipeline)
        self.prepare("train", a["x"], a["y"], a["sample_weight"], a["batch_size"])
        if a["validation_data"] is not None:
            self.prepare("eval", *unpack(a["validation_data"]), a["validation_batch_size"])

    def shard_evaluate(self, a: dict) -> None:
        a["x"], a["y"], a["sample_weight"], a["batch_size"] = self.sharding.shard(
            a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=False
        )
        self.prepare("eval", a["x"], a["y"], a["sample_weight"], a["batch_size"])

    def shard_predict(self, a: dict) -> None:
        # Every replica predicts all of its input; every worker returns the predictions.
        self.prepare("predict", a["x"], None, None, a["batch_size"])

    def step_overrides(self) -> dict[str, Any]:
        return {
            "train_step": schedule.train_step,
            "test_step": schedule.test_step,
            "predict_step": schedule.predict_step,
        }

    def check_callbacks(self, callbacks: list) -> None:
        import keras

        for c in callbacks:
            if isinstance(c, keras.callbacks.ModelCheckpoint) and c.save_freq != "epoch" and self.num_workers > 1:
                raise ValueError(
                    f"ModelCheckpoint(save_freq={c.save_freq!r}) with model parallelism: between epoch ends each "
                    "worker holds its own stage's weights only, so a mid-epoch checkpoint would be incomplete; "
                    "use save_freq='epoch' (or BackupAndRestore(save_freq=N), which gathers the model first)"
                )

    def sync_state(self, model: Any, restored: bool) -> None:
        """After a restore, every worker takes the reporter's whole state; otherwise each layer's
        weights come from the worker that owns them."""
        if self.num_workers > 1:
            (flags,) = self.collectives.broadcast(
                [np.asarray([float(restored), keras_internals.initial_epoch(model)], np.float64)],
                root=self.reporter_rank,
            )
            if flags[0]:
                keras_internals.set_initial_epoch(model, int(flags[1]))
                variables = keras_internals.state_variables(model)
                share_variables(self.collectives, variables, [self.reporter_rank] * len(variables))
            else:
                self._share_owned(model, with_optimizer=False)
        self.synced = True

    def gather_state(self, model: Any) -> None:
        """Every worker gets each layer's weights and optimizer slots from their owner (collective)."""
        if self.num_workers == 1:
            return
        step = int(keras_internals.inner_optimizer(model.optimizer).iterations.numpy())
        if step == self._gathered_at:
            return
        self._gathered_at = step
        self._share_owned(model, with_optimizer=True)

    def _share_owned(self, model: Any, with_optimizer: bool) -> None:
        graph = keras_internals.functional_of(model)
        owned: list[tuple[Any, int]] = []
        seen: set[int] = set()
        for layer in graph.layers:
            stage = self._layer_stage.get(layer.name)
            if stage is None:
                continue
            for v in layer.weights:
                if id(v) not in seen:
                    seen.add(id(v))
                    owned.append((v, stage))  # replica 0's worker of a stage has rank = stage
        optimizer = keras_internals.inner_optimizer(model.optimizer)
        if with_optimizer and optimizer.built:
            stage_of = {id(v): s for v, s in owned}
            variables = model.trainable_variables
            for ov, i in keras_internals.optimizer_slot_references(optimizer, variables):
                if i is not None and id(variables[i]) in stage_of:
                    owned.append((ov, stage_of[id(variables[i])]))
        share_variables(self.collectives, [v for v, _ in owned], [s for _, s in owned])

    def share_logs(self, result: dict) -> dict:
        """The loss workers' epoch logs (averaged over replicas), identical on every worker."""
        keys = sorted(k for k, v in result.items() if np.ndim(v) == 0)
        if self.engine.world_size == 1 or not keys:
            return result
        check = float(zlib.crc32(",".join(keys).encode()))
        mine = self.stage == self.loss_stage
        values = [check] + [float(result[k]) if mine else 0.0 for k in keys]
        (summed,) = self.collectives.allreduce([np.asarray(values, np.float64)], average=False, purpose="logs")
        if summed[0] != check * self.engine.world_size:
            raise RuntimeError(f"workers disagree on the metrics they report ({keys}); compile them alike")
        return {**result, **{k: float(v) / self.replicas for k, v in zip(keys, summed[1:], strict=True)}}
