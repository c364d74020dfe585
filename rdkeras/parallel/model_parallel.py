"""Model (pipeline) parallelism, and hybrid: R replicas of a K-stage pipeline.

Every worker builds the user's whole model (cheap) but trains only its stage:
the layers the placement gives it (:mod:`rdkeras.pipeline`), one
:class:`~rdkeras.pipeline.stages.Pipeline` (stage and channels) per plan; the
schedule is :mod:`rdkeras.pipeline.schedule`, the per-step data
:mod:`rdkeras.pipeline.feeds`.
This module orchestrates: the plans, their stages and the schedule are :mod:`rdkeras.pipeline`'s.
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
from collections.abc import Callable
from typing import Any

import numpy as np

from rdkeras import fitting, keras_internals
from rdkeras._log import logger
from rdkeras.engine import Engine
from rdkeras.parallel.base import Parallelism
from rdkeras.parallel.collectives import Collectives, GradientAllreduce, share_variables
from rdkeras.parallel.options import PipelineOptions
from rdkeras.parallel.sharding import Sharding, shard_fit_arguments, unpack
from rdkeras.pipeline import PipelinePlan, analyze, assign_layers, make_plan, schedule
from rdkeras.pipeline.cut.automatic import AutoCut
from rdkeras.pipeline.cut.partition import Partition
from rdkeras.pipeline.feeds import data_specs
from rdkeras.pipeline.planner import micro_rows
from rdkeras.pipeline.stages import Pipeline


class ModelParallel(Parallelism):
    """Attaches pipeline (and hybrid) training to compiled Functional/Sequential Keras models.

    Args:
        engine: The job's engine.
        options: The pipeline's (frozen, checked) options: its placement (layer-name glob -> stage index; None or
            "auto": cut the model into `stages` stages balanced by its layers' costs, measured on a dry run when
            it is attached, :mod:`rdkeras.pipeline.cut`), micro-batches, schedule
            (:mod:`rdkeras.pipeline.schedule`), deferred weight gradients (:mod:`rdkeras.pipeline.deferred`) and
            layers shared at a cut, alternating or split by rows (:mod:`rdkeras.pipeline.cut.split`).
        stages: workers per pipeline (K); the job runs world_size / K replicas (default: all workers).
        bucket_bytes: Bytes the ring moves per pass.
        global_batch: Whether ``batch_size`` is the global batch (split over replicas; default) or
            per replica.
    """

    def __init__(
        self,
        engine: Engine,
        options: PipelineOptions,
        stages: int | None = None,
        bucket_bytes: int = 64 << 20,
        global_batch: bool = True,
    ):
        n = engine.world_size
        k = stages or n
        if k < 1 or n % k:  # (RDMAStrategy checked the placement itself: rdkeras.parallel.check_settings)
            raise ValueError(f"{n} workers cannot run replicas of a {k}-stage pipeline: world size must be a multiple")
        if options.alternate_layers and options.split_layers:
            raise ValueError(
                "alternate_layers and split_layers both share the layer at a cut between two stages: choose one"
            )
        self.engine, self.stages, self.options = engine, k, options
        self.placement: dict[str, int] = options.layout or {}
        self.partition: Partition | None = None  # the automatic cut, when there was no placement
        self.auto_cut = AutoCut(options, k, engine.capabilities.costs[1], self._rank0_seconds)
        self._pair_sums: dict[int, GradientAllreduce] = {}  # cut -> the sum between the stages that share a layer
        self._replicas, self.replica, self.stage = n // k, engine.rank // k, engine.rank % k
        self.collectives = Collectives(engine, bucket_bytes)  # all workers: weights and logs
        group = [r * k + self.stage for r in range(self.replicas)]
        # Hybrid: each stage's gradients are averaged over its replicas, as data parallelism does.
        self.average_over_replicas = GradientAllreduce(Collectives(engine, bucket_bytes, group, name="stage/"))
        # Replicas split each global batch the data-parallel way.
        self.sharding = Sharding(self.replicas, self.replica, global_batch, warn=engine.rank == 0)
        self._pipelines: dict[tuple, Pipeline] = {}
        self._current: dict[str, list[Pipeline]] = {}  # purpose -> its pipelines: [full batches',] any batch's
        self._serial = 0
        self._printed = False
        self._model: Any = None
        self._layer_stage: dict[str, int] = {}
        self._gathered_at: int | None = None
        self.loss_stage = k - 1

    def rank_of(self, stage: int) -> int:
        """This replica's worker running `stage`."""
        return self.replica * self.stages + stage

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def reporter_rank(self) -> int:
        """The worker with the loss, metrics, progress bar and chief-only callbacks: replica 0's loss stage."""
        return self.loss_stage  # replica 0's worker of that stage

    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train as a pipeline. Validates the placement now, before any
        worker waits on another."""
        if not self._check_attachable(model):
            return model
        if self._model is not None:
            raise ValueError("a model-parallel RDMAStrategy distributes one model; create another strategy")
        if not self.placement:
            self._place(self.auto_cut.cut(model))
        self._layer_stage = assign_layers(model, self.placement, self.stages)
        # Cycles and the like are found now, with no data yet.
        self.loss_stage = analyze(model, self.placement, self.stages).loss_stage
        self._model = model
        fitting.distribute_model(model, self)
        return model

    def _rank0_seconds(self, model: Any, what: str, count: int, measure: Any) -> list[float]:
        """`measure()` (`count` seconds) on every worker, rank 0's taken by all (collective)."""
        seconds = [float("nan")] * count
        failure: Exception | None = None
        try:
            seconds = list(measure())
        except Exception as e:  # the others still take part in the broadcast, and fail with it
            failure = e
        if self.num_workers > 1:
            (shared,) = self.collectives.broadcast([np.asarray(seconds, np.float64)], root=0)
            seconds = [float(v) for v in shared]
        if failure is not None:
            raise failure
        if any(np.isnan(seconds)):
            raise RuntimeError(f"worker 0 could not time {what} of {model.name!r} for the automatic placement")
        return seconds

    def _recut(self, model: Any, rows: int) -> None:
        """The automatic cut again, its layers timed at the micro-batches' rows (the first training data tell
        them; collective), before any pipeline is built on the cut made at compile time."""
        if rows == self.auto_cut.rows:
            return
        self._place(self.auto_cut.cut(model, rows))
        self._layer_stage = assign_layers(model, self.placement, self.stages)

    def _place(self, partition: Partition) -> None:
        self.partition = partition
        self.placement = partition.stage_of()

    def _pair_sum(self, cut: int) -> GradientAllreduce:
        """The sum of an alternating layer's gradients between this replica's stages `cut` and `cut` + 1."""
        if cut not in self._pair_sums:
            members = [self.rank_of(cut), self.rank_of(cut + 1)]
            collectives = Collectives(self.engine, self.collectives.bucket_bytes, members, name=f"alternate{cut}/")
            self._pair_sums[cut] = GradientAllreduce(collectives, average=False)
        return self._pair_sums[cut]

    @property
    def models(self) -> list[Any]:
        return [] if self._model is None else [self._model]

    # -- plans ---------------------------------------------------------------------

    def prepare(self, purpose: str, x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> None:
        """Makes the pipelines for this data current (creating their channels the first time)."""
        model = self._model
        rows, label_specs, weight_specs = data_specs(x, y, sample_weight, batch_size)
        if purpose == "predict":  # predictions need no labels (a dataset may still yield them)
            label_specs = weight_specs = None
        micro = self.options.micro_batches if purpose != "predict" else 1
        micro_rows(rows, micro)  # (before a new cut is timed)
        # Arrays with a partial last batch: the batches before it run a static plan of their own (the step
        # chooses by the batch's rows), the last one the dynamic plan.
        full, *full_specs = data_specs(x, y, sample_weight, batch_size, full_batches=True)
        full = full if rows is None and purpose != "predict" and full is not None and full % micro == 0 else None
        if purpose == "train" and self.partition is not None and not self._pipelines and (rows or full):
            self._recut(model, (rows or full) // micro)  # type: ignore[operator]
        runs = [self._pipeline(full, micro, *full_specs)] if full is not None else []
        runs.append(self._pipeline(rows, micro, label_specs, weight_specs))
        if purpose == "predict":
            runs[-1].ensure_predict_channels(self.stages)
        if self._current.get(purpose) != runs:  # the same pipelines (Pipeline compares by identity)
            self._current[purpose] = runs
            # Keras caches its compiled step; a new pipeline needs a new trace.
            attr = {"train": "train_function", "eval": "test_function", "predict": "predict_function"}[purpose]
            setattr(model, attr, None)

    def _pipeline(self, rows: int | None, micro: int, label_specs: Any, weight_specs: Any) -> Pipeline:
        """The pipeline for batches of `rows` rows (None: any), made the first time."""
        model = self._model
        key = (rows, micro, str(label_specs), str(weight_specs))
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        plan = make_plan(
            model,
            self.placement,
            self.stages,
            rows,
            micro,
            label_specs,
            weight_specs,
            partition=self.partition,
            split_model=lambda cut: self.auto_cut.split_model(model, cut),
            replicas=self.replicas,
            schedule=self.options.schedule,
            defer_weight_gradients=self.options.defer_weight_gradients,
        )
        self._serial += 1
        pipeline = Pipeline(
            self.engine, plan.model, plan, self.stage, self.replica, self.rank_of, self._serial, self._pair_sum
        )
        self._pipelines[key] = pipeline
        if not self._printed and self.engine.rank == 0:
            self._printed = True
            logger.info("%s", plan.text())
        return pipeline

    def _step(self, purpose: str, data: Any, step: Callable[[Pipeline, Any], Any]) -> Any:
        """`step` on this batch's pipeline: where the batches before a partial last one have a static plan, the
        batch's rows choose it (every worker iterates the same batches, so all choose alike)."""
        import keras
        import tensorflow as tf

        runs = self._current[purpose]
        if len(runs) == 1:
            return step(runs[0], data)
        static, dynamic = runs
        full = static.plan.batch_size

        def with_rows(t: Any) -> Any:
            # Not ensure_shape or reshape: Grappler takes their shape for the input's, in both branches, and
            # folds the predicate and the dynamic branch's sizes. A split's first part says nothing of the rest.
            return t if t is None else tf.split(t, [full, -1])[0]

        rows = tf.shape(keras.tree.flatten(data)[0])[0]
        return tf.cond(
            tf.equal(rows, full),
            lambda: step(static, keras.tree.map_structure(with_rows, data)),
            lambda: step(dynamic, data),
        )

    def current(self, purpose: str) -> Pipeline:
        """The pipeline of `purpose`'s batches (the full batches' where the last one is partial)."""
        return self._current[purpose][0]

    @property
    def plan(self) -> PipelinePlan | None:
        """The current training plan (else the latest evaluation/prediction plan; None before any)."""
        runs = self._current.get("train") or next(iter(self._current.values()), None)
        return runs[0].plan if runs else None

    # -- the hooks rdkeras.fitting calls ---------------------------------------------------

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
        # The steps get this strategy's current pipeline (and the replicas' average) from here, at trace time.
        average = self.average_over_replicas if self.replicas > 1 else None

        def train_step(model: Any, data: Any) -> Any:
            how = self.options.schedule
            return self._step("train", data, lambda run, d: schedule.train_step(model, run, d, average, how))

        def test_step(model: Any, data: Any) -> Any:
            return self._step("eval", data, lambda run, d: schedule.test_step(model, run, d))

        def predict_step(model: Any, data: Any) -> Any:
            return schedule.predict_step(model, self.current("predict"), data)

        return {"train_step": train_step, "test_step": test_step, "predict_step": predict_step}

    @property
    def _partial_state_between_epochs(self) -> str:
        # Each worker holds its own stage's weights only.
        return "model parallelism" if self.num_workers > 1 else ""

    def sync_state(self, model: Any, restored: bool) -> None:
        """After a restore, every worker takes the reporter's whole state; otherwise each layer's
        weights come from the worker that owns them."""
        if self.num_workers > 1:
            if self._share_restore(model, restored, root=self.reporter_rank):
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
