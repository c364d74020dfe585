"""Model (pipeline) parallelism, and hybrid: R replicas of a K-stage pipeline.

Every worker builds the user's whole model (cheap) but trains only its stage:
the layers the placement gives it (rdkeras.graph). Per step, on each stage:

    forward, per micro-batch m:   recv activations -> stage model -> send activations
    backward, m in reverse:       recv output gradients -> tape.gradient(outputs,
                                  output_gradients=...) -> send input gradients
    then: sum over micro-batches (average over replicas) -> optimizer.apply

The reader (worker 0 of each replica) iterates the data and sends each other
stage the model inputs it consumes and the loss worker the labels, directly.
Every other worker iterates the same dataset only to keep Keras's loop in step.
Loss, metrics and the progress bar live on the loss worker; epoch logs are
shared with every worker (so EarlyStopping decides the same everywhere), and
every epoch ends with each layer's weights copied from its owner to all
workers, so any worker can save the whole trained model.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from rdkeras._log import logger
from rdkeras.engine import Engine
from rdkeras.graph import Plan, Stage, analyze, assign_layers, build_stage, functional_of
from rdkeras.ops import rdma_recv, rdma_send
from rdkeras.parallel.data import (
    Collectives,
    GradientAllreduce,
    Sharding,
    _bind,
    _unpack,
    reporting_callbacks,
    shard_fit_arguments,
)


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
        placement: layer-name glob -> stage index (0..num_stages-1).
        num_stages: workers per pipeline (K); the job runs world_size / K replicas.
        micro_batches: M; each batch is split into M equal micro-batches (GPipe schedule).
    """

    def __init__(
        self,
        engine: Engine,
        placement: dict[str, int],
        num_stages: int | None = None,
        micro_batches: int = 1,
        bucket_bytes: int = 64 << 20,
        seed: int = 1234,
    ):
        if not isinstance(placement, dict) or not placement:
            raise ValueError(
                "model parallelism needs a placement: a dict of layer-name patterns to workers, "
                "e.g. placement={'conv*': 0, 'dense*': 1}"
            )
        n = engine.world_size
        k = num_stages or n
        if k < 1 or n % k:
            raise ValueError(f"{n} workers cannot run replicas of a {k}-stage pipeline: world size must be a multiple")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.engine, self.placement, self.num_stages = engine, dict(placement), k
        self.micro_batches, self.seed = int(micro_batches), seed
        self.replicas, self.replica, self.stage = n // k, engine.rank // k, engine.rank % k
        self.collectives = Collectives(engine, bucket_bytes)  # all workers: weights and logs
        group = [r * k + self.stage for r in range(self.replicas)]
        # Hybrid: each stage's gradients are averaged over its replicas, as data parallelism does.
        self.average_over_replicas = GradientAllreduce(Collectives(engine, bucket_bytes, group, name="stage/"))
        # Replicas share data the data-parallel way: replica r takes shard r.
        self.sharding = Sharding(self.replicas, self.replica, warn=engine.rank == 0)
        self.synced = False
        self.batch_size: int | None = None
        self._pipelines: dict[tuple, Pipeline] = {}
        self._current: dict[str, Pipeline] = {}
        self._serial = 0
        self._printed = False
        self._model: Any = None
        self._layer_stage: dict[str, int] = {}
        self.loss_stage = k - 1

    def rank_of(self, stage: int) -> int:
        """This replica's worker running `stage`."""
        return self.replica * self.num_stages + stage

    @property
    def report_rank(self) -> int:
        """The worker with the loss, metrics, progress bar and chief-only callbacks (replica 0's loss worker)."""
        return self.loss_stage

    @property
    def is_reporter(self) -> bool:
        return self.engine.rank == self.report_rank

    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train as a pipeline. Validates the placement now, before any
        worker waits on another."""
        if getattr(model, "_rdkeras", None) is not None:
            return model
        if self._model is not None:
            raise ValueError("a model-parallel RDMAStrategy distributes one model; create another strategy")
        if model.optimizer is None:
            raise ValueError("compile the model (with an optimizer) before distributing it")
        self._layer_stage = assign_layers(model, self.placement, self.num_stages)
        # Cycles and the like are found now, with no data yet.
        self.loss_stage = analyze(model, self.placement, self.num_stages).loss_stage
        model.jit_compile = False
        self._model = model
        base = model.__class__
        model.__class__ = type(base.__name__, (_PipelinedModel, base), {"_rdkeras_base": base})
        object.__setattr__(model, "_rdkeras", self)
        return model

    # -- plans ---------------------------------------------------------------------

    def prepare(self, purpose: str, x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> None:
        """Makes the pipeline for this data current (creating its channels the first time)."""
        model = self._model
        rows, label_specs, weight_specs = _data_specs(x, y, sample_weight, batch_size)
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

    def plan_text(self) -> str:
        """The current training plan as text (for TensorBoard), or '' before the first fit."""
        pipeline = self._current.get("train") or next(iter(self._current.values()), None)
        return pipeline.plan.text() if pipeline is not None else ""

    # -- weights and logs ----------------------------------------------------------

    def gather_weights(self, model: Any) -> None:
        """Every worker gets each layer's weights from its owner (replica 0's worker of that stage)."""
        if self.engine.world_size == 1:
            return
        graph = functional_of(model)
        owned, seen = [], set()
        for layer in graph.layers:
            stage = self._layer_stage.get(layer.name)
            if stage is None:
                continue
            for v in layer.weights:
                if id(v) not in seen and np.dtype(v.dtype).kind == "f":
                    seen.add(id(v))
                    owned.append((v, stage))
        if not owned:
            return
        me = self.engine.rank
        values = [np.asarray(v.numpy()) if me == s else np.zeros(v.shape, v.dtype) for v, s in owned]
        # A sum where exactly one worker contributes non-zeros: exact.
        summed = self.collectives.allreduce(values, average=False, purpose="weights")
        for (v, _), value in zip(owned, summed, strict=True):
            v.assign(value)

    def shared_logs(self, result: dict) -> dict:
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

    def worker_callbacks(self, callbacks: Any, verbose: Any) -> tuple[Any, Any]:
        """Chief-only callbacks and the progress bar run where the loss is."""
        return reporting_callbacks(callbacks, verbose, self.is_reporter)


def _data_specs(x: Any, y: Any, sample_weight: Any, batch_size: int | None) -> tuple:
    """(rows per batch when every batch has them, label specs, sample-weight specs)."""
    import keras
    import tensorflow as tf

    def from_arrays(arrays: Any, rows: int | None) -> list | None:
        if arrays is None:
            return None
        specs = []
        for a in keras.tree.flatten(arrays):
            a = np.asarray(a)
            dtype = keras.config.floatx() if a.dtype.kind == "f" else a.dtype.name
            specs.append(((rows, *a.shape[1:]), dtype))
        return specs

    def from_tensor_specs(specs: Any) -> list | None:
        if specs is None:
            return None
        return [(tuple(s.shape.as_list()), s.dtype.name) for s in keras.tree.flatten(specs)]

    if isinstance(x, tf.data.Dataset):
        _, ys, ws = _unpack(x.element_spec)
        out_y, out_w = from_tensor_specs(ys), from_tensor_specs(ws)
        first = next((s for s in keras.tree.flatten(x.element_spec)), None)
        rows = first.shape[0] if first is not None and first.shape.rank else None
        return rows, out_y, out_w
    if isinstance(x, keras.utils.PyDataset):
        _, ys, ws = _unpack(x[0])
        return None, from_arrays(ys, None), from_arrays(ws, None)
    if x is None:
        return None, None, None
    batch_size = batch_size or 32
    samples = len(keras.tree.flatten(x)[0])
    rows = batch_size if samples % batch_size == 0 or samples < batch_size else None
    rows = min(rows, samples) if rows is not None else None
    return rows, from_arrays(y, rows), from_arrays(sample_weight, rows)


class _PipelinedModel:
    """Mixed into the user's model class (ahead of it) by ModelParallel.attach."""

    _rdkeras: ModelParallel

    # -- the Keras entry points ---------------------------------------------------

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        import keras

        a = _bind(self._rdkeras_base.fit, self, args, kwargs)
        mp = self._rdkeras
        shard_fit_arguments(a, mp.sharding)  # over replicas (a no-op for one pipeline)
        mp.batch_size = a["batch_size"]
        mp.prepare("train", a["x"], a["y"], a["sample_weight"], a["batch_size"])
        if a["validation_data"] is not None:
            mp.prepare("eval", *_unpack(a["validation_data"]), a["validation_batch_size"])
        callbacks, a["verbose"] = mp.worker_callbacks(a["callbacks"], a["verbose"])

        class GatherWeights(keras.callbacks.Callback):  # first, so checkpoints save trained weights
            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                mp.gather_weights(self.model)

        a["callbacks"] = [GatherWeights(), *(callbacks or [])]
        return self._rdkeras_base.fit(self, **a)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: prepared by fit
            return self._rdkeras_base.evaluate(self, *args, **kwargs)
        a = _bind(self._rdkeras_base.evaluate, self, args, kwargs)
        mp = self._rdkeras
        a["x"], a["y"], a["sample_weight"], a["batch_size"] = mp.sharding.shard(
            a["x"], a["y"], a["sample_weight"], a["batch_size"], shuffle=False
        )
        mp.prepare("eval", a["x"], a["y"], a["sample_weight"], a["batch_size"])
        a["callbacks"], a["verbose"] = mp.worker_callbacks(a["callbacks"], a["verbose"])
        return self._rdkeras_base.evaluate(self, **a)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        # Every replica predicts all of its input; every worker returns the predictions.
        a = _bind(self._rdkeras_base.predict, self, args, kwargs)
        mp = self._rdkeras
        mp.prepare("predict", a["x"], None, None, a["batch_size"])
        a["callbacks"], a["verbose"] = mp.worker_callbacks(a["callbacks"], a["verbose"])
        return self._rdkeras_base.predict(self, **a)

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> None:
        # Build metrics on every worker (so all report the same keys), then give
        # everyone each layer's initial weights from its owner.
        mp = self._rdkeras
        if not mp.synced:
            if iterator is not None and data_batch is None:
                for _, _, it in iterator:
                    data_batch = next(it)
                    break
            if data_batch is not None:
                self._symbolic_build(data_batch=data_batch)
            mp.gather_weights(self)
            mp.synced = True
        self._rdkeras_base._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)

    def _get_metrics_result_or_logs(self, logs: Any) -> Any:
        # Once per epoch and per evaluate, on every worker alike.
        return self._rdkeras.shared_logs(self._rdkeras_base._get_metrics_result_or_logs(self, logs))

    # -- the steps -------------------------------------------------------------------

    def train_step(self, data: Any) -> Any:
        import tensorflow as tf

        mp, run = self._rdkeras, self._rdkeras.current("train")
        stage, plan = run.stage, run.plan
        x, y, sw = _unpack(data)
        feeds = _Feeds(self, run, x, y, sw)
        chain = feeds.after_data()
        passes = []
        total_loss = None
        for m in range(plan.micro_batches):
            chain = feeds.send_data(m, chain)
            received, chain = feeds.receive(m, chain)
            with tf.GradientTape() as tape:
                for e in stage.received:
                    if e.needs_grad:
                        tape.watch(received[e.name])
                outs = _run_stage(stage, feeds, m, received, chain, training=True)
                objective = _regularization(stage, plan.micro_batches)
                if stage.is_loss:
                    loss = feeds.loss(m, outs, received, training=True)
                    if loss is not None:
                        total_loss = loss if total_loss is None else total_loss + loss
                        objective = loss if objective is None else objective + loss
            chain = _send_outputs(run, stage, m, outs, chain)
            # The next receive waits until this micro-batch is computed: a receive blocks
            # TensorFlow's (one) thread, which must not idle while work is ready.
            chain = [*chain, _computed(outs, objective)]
            passes.append((tape, outs, received, objective))
        variables = stage.trainable_variables
        summed: list[Any] = [None] * len(variables)
        for m in reversed(range(plan.micro_batches)):
            tape, outs, received, objective = passes[m]
            targets, output_grads = [], []
            for pos, edges in enumerate(stage.sends):
                grads_in = []
                for e in edges:
                    if e.needs_grad:
                        g = rdma_recv(run.bwd[(e.name, m)], e.shape, e.dtype, f"{e.name}/{m}/grad", chain)
                        chain = [g]
                        grads_in.append(g)
                if grads_in:
                    targets.append(outs[pos])
                    output_grads.append(tf.add_n(grads_in) if len(grads_in) > 1 else grads_in[0])
            if objective is not None:
                targets.append(objective)
                output_grads.append(tf.ones_like(objective))
            back = [received[e.name] for e in stage.received if e.needs_grad]
            with tf.control_dependencies(chain):  # after the previous micro-batch's gradients left
                grads = tape.gradient(targets, variables + back, output_gradients=output_grads) if targets else []
            grads = [None if g is None else tf.convert_to_tensor(g) for g in grads] or [None] * (
                len(variables) + len(back)
            )
            for e, g in zip([e for e in stage.received if e.needs_grad], grads[len(variables) :], strict=True):
                g = tf.zeros_like(received[e.name]) if g is None else g
                chain = [rdma_send(run.bwd[(e.name, m)], g, f"{e.name}/{m}/grad", chain)]
            chain = [*chain, _computed(grads)]
            for i, g in enumerate(grads[: len(variables)]):
                if g is not None:
                    summed[i] = g if summed[i] is None else summed[i] + g
        if mp.replicas > 1 and variables:
            summed = mp.average_over_replicas(summed)
        pairs = [(g, v) for g, v in zip(summed, variables, strict=True) if g is not None]
        with tf.control_dependencies(chain):
            if pairs:
                self.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        if stage.is_loss:
            feeds.update_metrics(total_loss)
        return self.get_metrics_result()

    def test_step(self, data: Any) -> Any:
        run = self._rdkeras.current("eval")
        stage, plan = run.stage, run.plan
        x, y, sw = _unpack(data)
        feeds = _Feeds(self, run, x, y, sw)
        chain = feeds.after_data()
        total_loss = None
        for m in range(plan.micro_batches):
            chain = feeds.send_data(m, chain)
            received, chain = feeds.receive(m, chain)
            outs = _run_stage(stage, feeds, m, received, chain, training=False)
            chain = _send_outputs(run, stage, m, outs, chain)
            if stage.is_loss:
                loss = feeds.loss(m, outs, received, training=False)
                if loss is not None:
                    total_loss = loss if total_loss is None else total_loss + loss
        if stage.is_loss:
            feeds.update_metrics(total_loss)
        return self.get_metrics_result()

    def predict_step(self, data: Any) -> Any:
        import keras
        import tensorflow as tf

        run = self._rdkeras.current("predict")
        stage = run.stage
        x, _, _ = _unpack(data)
        feeds = _Feeds(self, run, x, None, None)
        chain = feeds.send_data(0, feeds.after_data())
        received, chain = feeds.receive(0, chain)
        outs = _run_stage(stage, feeds, 0, received, chain, training=False)
        chain = _send_outputs(run, stage, 0, outs, chain)
        graph = functional_of(self)
        if stage.is_loss:
            flat = feeds.model_outputs(outs, received)
            for s, ch in sorted(run.predict_out.items()):
                for i, t in enumerate(flat):
                    chain = [rdma_send(ch, t, f"predict/{s}/{i}", chain)]
        else:
            # Dynamic channels: each received tensor owns its buffer (Keras keeps predictions).
            flat = []
            for i, t in enumerate(graph.outputs):
                r = rdma_recv(run.predict_out[stage.index], t.shape, t.dtype, f"predict/{i}", chain)
                chain = [r]
                flat.append(r)
        with tf.control_dependencies(chain):
            flat = [tf.identity(t) for t in flat]
        return keras.tree.pack_sequence_as(graph._outputs_struct, flat)


class _Feeds:
    """One step's data on this worker: the reader's slices, and what the loss worker needs."""

    def __init__(self, model: Any, run: Pipeline, x: Any, y: Any, sw: Any):
        import keras
        import tensorflow as tf

        self.model, self.run, self.stage, self.plan = model, run, run.stage, run.plan
        self.graph = functional_of(model)
        self.y_struct, self.sw_struct = y, sw
        reader = self.stage.is_reader
        self.inputs = [self._split(t) for t in self.graph._standardize_inputs(x)] if reader else []
        self.labels = [self._split(t) for t in keras.tree.flatten(y)] if reader and y is not None else []
        self.weights = [self._split(t) for t in keras.tree.flatten(sw)] if reader and sw is not None else []
        # Every worker iterates the same batches (only the reader's contents are used), so
        # each knows the batch's row count locally.
        first = keras.tree.flatten(x)[0]
        self.rows = tf.cast(tf.shape(first)[0], keras.config.floatx())
        self._metric_batches: list[tuple] = []

    def after_data(self) -> list[Any]:
        """What the step's first transfer waits for: this batch. A worker that only receives must not
        start a blocking receive before its own iterator has yielded, or at the end of a dataset of
        unknown length it would wait for a step that no worker runs."""
        return [self.rows]

    def _split(self, t: Any) -> list[Any]:
        import tensorflow as tf

        m = self.plan.micro_batches
        if m == 1:
            return [t]
        if self.plan.batch_size is not None:
            return tf.split(t, m, axis=0)
        n = tf.shape(t)[0]
        return tf.split(t, tf.stack([(n + m - 1 - i) // m for i in range(m)]), num=m, axis=0)

    def send_data(self, m: int, chain: list[Any]) -> list[Any]:
        """Reader: micro-batch m's model inputs to the stages that consume them, labels to the loss worker."""
        import tensorflow as tf

        stage, run = self.stage, self.run
        if not stage.is_reader:
            return chain
        for pos, e in stage.data_edges:
            t = tf.cast(self.inputs[pos][m], e.dtype)
            chain = [rdma_send(run.fwd[(e.name, m)], t, f"{e.name}/{m}", chain)]
        for e in stage.label_edges:
            parts = self.labels if e.kind == "labels" else self.weights
            t = tf.cast(parts[int(e.producer.split("[")[1].rstrip("]"))][m], e.dtype)
            chain = [rdma_send(run.fwd[(e.name, m)], t, f"{e.name}/{m}", chain)]
        return chain

    def receive(self, m: int, chain: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        received = {}
        for e in self.stage.received:
            t = rdma_recv(self.run.fwd[(e.name, m)], e.shape, e.dtype, f"{e.name}/{m}", chain)
            received[e.name] = t
            chain = [t]
        return received, chain

    def model_outputs(self, outs: list[Any], received: dict[str, Any]) -> list[Any]:
        return [outs[ref] if kind == "local" else received[ref.name] for kind, ref in self.stage.outputs]

    def loss(self, m: int, outs: list[Any], received: dict[str, Any], training: bool) -> Any:
        """Loss worker: micro-batch m's share of the full batch's loss."""
        import keras
        import tensorflow as tf

        flat_pred = self.model_outputs(outs, received)
        y_pred = keras.tree.pack_sequence_as(self.graph._outputs_struct, flat_pred)
        if self.stage.is_reader:
            ys, ws = [p[m] for p in self.labels], [p[m] for p in self.weights]
        else:
            ys = [received[e.name] for e in self.stage.label_edges if e.kind == "labels"]
            ws = [received[e.name] for e in self.stage.label_edges if e.kind == "sample_weight"]
        y = keras.tree.pack_sequence_as(self.y_struct, ys) if self.y_struct is not None else None
        sw = keras.tree.pack_sequence_as(self.sw_struct, ws) if self.sw_struct is not None else None
        self._metric_batches.append((y, y_pred, sw))
        if self.model._compile_loss is None:
            return None
        loss = self.model._compile_loss(y, y_pred, sw)
        if self.plan.micro_batches == 1:
            return loss
        # The full batch's mean = sum over micro-batches of (rows_m / rows) x micro-batch mean.
        rows_m = tf.cast(tf.shape(keras.tree.flatten(flat_pred)[0])[0], loss.dtype)
        return loss * rows_m / tf.cast(self.rows, loss.dtype)

    def update_metrics(self, total_loss: Any) -> None:
        if total_loss is not None:
            self.model._loss_tracker.update_state(total_loss, sample_weight=self.rows)
        for y, y_pred, sw in self._metric_batches:
            self.model.compute_metrics(None, y, y_pred, sample_weight=sw)
        self._metric_batches.clear()


def _run_stage(
    stage: Stage, feeds: _Feeds, m: int, received: dict[str, Any], chain: list[Any], training: bool
) -> list[Any]:
    import tensorflow as tf

    if stage.model is None:
        return []
    inputs = [feeds.inputs[f.input_index][m] if f.edge is None else received[f.edge.name] for f in stage.feeds]
    # Micro-batch m computes only once m-1's activations are on their way: with one thread,
    # TensorFlow would otherwise run every micro-batch's forward before the first send, and
    # the next stage could not overlap with this one.
    with tf.control_dependencies(chain):
        outs = stage.model(inputs, training=training)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _send_outputs(run: Pipeline, stage: Stage, m: int, outs: list[Any], chain: list[Any]) -> list[Any]:
    for pos, edges in enumerate(stage.sends):
        for e in edges:
            chain = [rdma_send(run.fwd[(e.name, m)], outs[pos], f"{e.name}/{m}", chain)]
    return chain


def _computed(*tensors: Any) -> Any:
    """An op that runs once all of `tensors` (nested lists, Nones skipped) exist."""
    import keras
    import tensorflow as tf

    return tf.group(*[t for t in keras.tree.flatten(list(tensors)) if t is not None])


def _regularization(stage: Stage, micro_batches: int) -> Any:
    import tensorflow as tf

    if stage.model is None or not stage.model.losses:
        return None
    return tf.add_n(stage.model.losses) / micro_batches
