"""A Keras user's lifecycle around fit, run inside each rank: save and load, resume, custom loops."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np

from tests.ranks.keras_workers import next_port

SAMPLES, BATCH = 96, 16


def _data(samples: int = SAMPLES):
    rng = np.random.default_rng(5)
    return rng.standard_normal((samples, 10)).astype("float32"), rng.integers(0, 4, samples)


def _model(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(4, name="logits"),
        ],
        name="net",
    )


def _compile(model) -> None:
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )


def _state(model) -> dict:
    """Weights and optimizer variables (in the optimizer's order: names carry per-process counters), as lists."""
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "optimizer": [np.asarray(v.numpy()).tolist() for v in model.optimizer.variables],
    }


def _keras_sites() -> dict:
    """Every attribute of Keras's that rdkeras may replace (keras_internals.PATCH_TABLE's sites, found here
    independently), by "owner.name": its current value's id."""
    import keras
    from keras.src.backend.tensorflow import random as backend_random
    from keras.src.losses import loss as loss_module

    owners = [c for c in keras.Model.__mro__ if {"compile", "fit", "evaluate", "predict"} & set(vars(c))]
    owners += [c for k in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer) for c in k.__mro__]
    sites = {f"{c.__qualname__}.{n}": id(vars(c)[n]) for c in owners for n in
             ("compile", "fit", "evaluate", "predict", "apply") if n in vars(c)}  # fmt: skip
    for name in ("normal", "uniform", "truncated_normal", "randint", "dropout"):
        sites[f"random.{name}"] = id(getattr(backend_random, name))
    sites["losses.reduce_weighted_values"] = id(loss_module.reduce_weighted_values)
    return sites


def _patches_seen() -> tuple[list, object]:
    """A list, and a callback that adds keras_internals.active_patches() to it at every training batch's end."""
    import keras

    from rdkeras import keras_internals

    seen: list = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.extend(p for p in keras_internals.active_patches() if p not in seen)

    return seen, Record()


def save_all(out_dir: str, mode: str, policies: list) -> dict:
    """save_everything once per dtype policy, into out_dir/POLICY, in this one pair of processes."""
    out = {}
    for i, policy in enumerate(policies):
        folder = os.path.join(out_dir, policy)
        os.makedirs(folder, exist_ok=True)
        out[policy] = save_everything(folder, mode, policy, next_tag=f"policy{i}" if i + 1 < len(policies) else None)
    return out


def save_everything(out_dir: str, mode: str, policy: str = "float32", next_tag: str | None = None) -> dict:
    """2 workers train with ModelCheckpoint (.keras and .weights.h5); the chief saves .keras, a
    SavedModel and the JSON config; a model loaded inside scope trains distributed again; a model
    compiled outside scope refuses to fit; close() leaves plain Keras objects."""
    import keras

    import rdkeras
    from rdkeras import fitting, keras_internals

    keras.mixed_precision.set_global_policy(policy)
    x, y = _data()
    sites = _keras_sites()
    strategy = rdkeras.RDMAStrategy(mode=mode)
    rank = strategy.worker_index
    with strategy.scope():
        model = _model(seed=10 + rank)  # different on every worker: the chief's must win
        _compile(model)
    patches, record = _patches_seen()
    checkpoints = [
        keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "ck.keras")),
        keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "ck.weights.h5"), save_weights_only=True),
        record,
    ]
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=checkpoints)
    out = {"rank": rank, "trained": _state(model), "predict": model.predict(x[:8], verbose=0).tolist()}
    # 9 rows in global batches of 4: the last batch has 1 row for 2 workers (padded, then cut).
    out["predict_odd"] = model.predict(x[:9], batch_size=4, verbose=0).tolist()
    if strategy.is_chief:
        model.save(os.path.join(out_dir, "m.keras"))
        model.export(os.path.join(out_dir, "savedmodel"), verbose=False)
        with open(os.path.join(out_dir, "model.json"), "w") as f:
            f.write(model.to_json())
        out["config_module"] = model.get_config().get("module", type(model).__module__)
    strategy.engine.barrier("saved")

    # Loaded inside the scope, it trains distributed again (load_model compiles it).
    with strategy.scope():
        loaded = keras.models.load_model(os.path.join(out_dir, "m.keras"))
    out["loaded_is_distributed"] = fitting.parallel_of(loaded) is not None
    loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["continued"] = _state(loaded)

    # A model compiled outside the scope would train one copy per worker: refused.
    outside = _model(seed=3)
    _compile(outside)
    try:
        outside.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        out["outside_error"] = None
    except RuntimeError as e:
        out["outside_error"] = str(e)

    if next_tag:
        next_port(strategy, next_tag)
    strategy.close()
    out["after_close"] = {
        "model_overrides": sorted(k for k in model.__dict__ if k in ("fit", "evaluate", "predict", "save")),
        "optimizer_overrides": "apply" in model.optimizer.__dict__,
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "optimizer_class": f"{type(model.optimizer).__module__}.{type(model.optimizer).__name__}",
        "patches_during_fit": patches,
        "patches": keras_internals.active_patches(),
        "sites_changed": sorted(k for k, v in _keras_sites().items() if sites[k] != v),
    }
    if rank == 0:  # the same two trainings in one plain Keras process (the global batch is the same)
        ref = _model(seed=10)
        _compile(ref)
        ref.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        out["reference"] = _state(ref)
        out["reference_predict_odd"] = ref.predict(x[:9], batch_size=4, verbose=0).tolist()
        ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out["reference_continued"] = _state(ref)
    return out


def load_without_rdkeras(out_dir: str, policy: str = "float32") -> dict:
    """Runs in a fresh process that never imports rdkeras: loads every file, then trains on."""
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy(policy)
    x, y = _data()
    result = {}
    for name in ("m.keras", "ck.keras"):
        model = keras.models.load_model(os.path.join(out_dir, name))
        result[name] = _state(model)
        result[name + "/class"] = f"{type(model).__module__}.{type(model).__name__}"
        if name == "m.keras":
            result["predict"] = model.predict(x[:8], verbose=0).tolist()
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            result["continued"] = _state(model)
    fresh = _model(seed=0)
    _compile(fresh)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(os.path.join(out_dir, "ck.weights.h5"))
    result["ck.weights.h5"] = _state(fresh)
    served = tf.saved_model.load(os.path.join(out_dir, "savedmodel"))
    result["savedmodel_predict"] = np.asarray(served.serve(x[:8])).tolist()
    with open(os.path.join(out_dir, "model.json")) as f:
        text = f.read()
    result["json_mentions_rdkeras"] = "rdkeras" in text
    result["from_json"] = type(keras.models.model_from_json(text)).__name__
    result["rdkeras_imported"] = "rdkeras" in sys.modules
    return result


def load_all_without_rdkeras(out_dirs: list, policies: list) -> dict:
    out = {}
    for out_dir in out_dirs:
        out[out_dir] = {policy: load_without_rdkeras(os.path.join(out_dir, policy), policy) for policy in policies}
        keras_reset()
    return out


def keras_reset() -> None:
    import keras

    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("float32")


def load_in_fresh_process(out_dirs: list, policies: list) -> dict:
    """load_without_rdkeras for each policy's folder in each of `out_dirs`, in one new process that never
    imports rdkeras; by out_dir, then policy."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[3]);"
        "from tests.ranks.lifecycle_workers import load_all_without_rdkeras;"
        "print('@@' + json.dumps(load_all_without_rdkeras(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env["PYTHONPATH"] = ""  # the test package only, through sys.path; never rdkeras's launcher env
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(out_dirs), json.dumps(policies), root],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][2:])


class KillAtEpoch:
    """A callback that SIGKILLs this process when epoch `epoch` begins, if env RDKERAS_TEST_KILL is this rank."""

    def __new__(cls, epoch: int):
        import keras

        class Kill(keras.callbacks.Callback):
            def on_epoch_begin(self, e, logs=None):
                if e == epoch and os.environ.get("RDKERAS_TEST_KILL") == os.environ.get("RDKERAS_RANK"):
                    os.kill(os.getpid(), signal.SIGKILL)

        return Kill()


def train_with_backup(backup_dir: str, epochs: int = 4, kill_epoch: int = 2, mode: str = "allreduce") -> dict:
    """fit with BackupAndRestore; one rank may be killed at `kill_epoch` (env RDKERAS_TEST_KILL). After a
    relaunch the job resumes; then, in the same processes, an uninterrupted run for comparison."""
    import keras

    import rdkeras

    x, y = _data()
    strategy = rdkeras.RDMAStrategy(mode=mode)
    rank = strategy.worker_index
    with strategy.scope():
        model = _model(seed=20 + rank)
        _compile(model)
    backup = keras.callbacks.BackupAndRestore(backup_dir)
    epochs_run = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            epochs_run.append(e)

    history = model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[backup, KillAtEpoch(kill_epoch), Seen()],
    )  # fmt: skip
    resumed = _state(model)
    next_port(strategy, "uninterrupted")
    strategy.close()

    strategy = rdkeras.RDMAStrategy(mode=mode)
    with strategy.scope():
        model = _model(seed=20 + rank)
        _compile(model)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    uninterrupted = _state(model)
    strategy.close()
    return {
        "epochs_run": epochs_run,
        "loss": history.history["loss"],
        "resumed": resumed,
        "uninterrupted": uninterrupted,
        "backup_left": os.path.exists(backup_dir) and bool(os.listdir(backup_dir)),
    }


def custom_loop(distributed: bool = True, steps: int = 6) -> dict:
    """A hand-written training loop: the dataset split with experimental_distribute_dataset, gradients
    averaged by DistributedGradientTape, the chief's initial variables broadcast."""
    import keras
    import tensorflow as tf

    import rdkeras

    x, y = _data()
    strategy = rdkeras.RDMAStrategy() if distributed else None
    rank = strategy.worker_index if strategy else 0
    model = _model(seed=30 + rank)
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # global batches
    if strategy:
        strategy.broadcast_variables(model.weights)
        ds = strategy.experimental_distribute_dataset(ds)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape_ = rdkeras.DistributedGradientTape(tape, strategy) if strategy else tape
        grads = tape_.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return strategy.reduce("MEAN", loss) if strategy else loss

    losses = []
    for xb, yb in itertools_take(ds, steps):
        losses.append(float(step(xb, yb)))
    out = {"weights": [w.tolist() for w in model.get_weights()], "losses": losses}
    if strategy:
        strategy.close()
    else:
        out["reference"] = True
    return out


def replica_checks(mode: str = "allreduce") -> dict:
    """Replicas kept in agreement: BatchNormalization's statistics (each worker's own batches) averaged, and
    a variable one worker changes on its own caught at the next epoch end and by strategy.check_replicas()."""
    import keras

    import rdkeras

    x, y = _data()
    strategy = rdkeras.RDMAStrategy(mode=mode)
    rank = strategy.worker_index
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [keras.Input((10,)), keras.layers.Dense(16, name="hidden"), keras.layers.BatchNormalization(name="bn"),
             keras.layers.Dense(4, name="logits")],
            name="net",
        )  # fmt: skip
        _compile(model)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    bn = model.get_layer("bn")
    out: dict = {"bn": [np.asarray(v.numpy()).tolist() for v in (bn.moving_mean, bn.moving_variance)]}

    bn.moving_mean.assign(bn.moving_mean + rank)  # replica-local state: averaged, not an error
    strategy.check_replicas()
    out["bn after check"] = np.asarray(bn.moving_mean.numpy()).tolist()

    class OneWorkerNudges(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if rank == 1 and epoch == 1:
                kernel = self.model.get_layer("logits").kernel
                kernel.assign(kernel + 1e-3)

    for name, run in {
        "epoch end": lambda: model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[OneWorkerNudges()]),
        "on demand": strategy.check_replicas,
    }.items():
        try:
            run()
            out[name] = None
        except rdkeras.ReplicasDivergedError as e:
            out[name] = str(e)
    strategy.close()
    return out


def gan(epochs: int = 2, distributed: bool = True) -> dict:
    """The keras.io GAN pattern ("Customizing what happens in fit()"): a model with no call(), a custom compile
    keeping two optimizers, a train_step applying each and drawing its noise for the batch it gets; its parts'
    weights after training on this worker (or in one process, with the whole batch)."""
    import keras
    import tensorflow as tf
    from keras import ops

    import rdkeras

    class GAN(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn
            self.d_loss_metric, self.g_loss_metric = (
                keras.metrics.Mean(name="d_loss"),
                keras.metrics.Mean(name="g_loss"),
            )

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real):
            batch = ops.shape(real)[0]
            noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
            combined = ops.concatenate([self.generator(noise), real], axis=0)
            labels = ops.concatenate([ops.ones((batch, 1)), ops.zeros((batch, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights, strict=True))
            noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(ops.zeros((batch, 1)), self.discriminator(self.generator(noise)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    x, _ = _data()
    strategy = rdkeras.RDMAStrategy() if distributed else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(3)
        disc = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        gen = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(10)])
        model = GAN(disc, gen, latent_dim=4)
        model.compile(
            d_optimizer=keras.optimizers.Adam(0.01),
            g_optimizer=keras.optimizers.Adam(0.01),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    history = model.fit(x, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False)
    out = {
        "weights": [w.tolist() for w in disc.get_weights() + gen.get_weights()],
        "d_loss": history.history["d_loss"],
    }
    if strategy is None:
        return out
    strategy.close()
    out["restored"] = not any(hasattr(o, "_rdkeras_originals") for o in (model.d_optimizer, model.g_optimizer))
    return out


def reduce_forms() -> dict:
    """tf.distribute's ``strategy.reduce`` in the forms MWMS custom loops use, eagerly and in a tf.function:
    each rank's values differ (rank 0 has one row, rank 1 three), so a wrong reduction shows."""
    import tensorflow as tf

    import rdkeras

    strategy = rdkeras.RDMAStrategy()
    r = strategy.worker_index
    rows = tf.constant([[1.0, 2.0]] if r == 0 else [[3.0, 4.0]] * 3)
    forms = {
        "sum scalar": lambda: strategy.reduce("SUM", tf.constant(r + 1.0)),
        "sum scalar, axis None": lambda: strategy.reduce(tf.distribute.ReduceOp.SUM, tf.constant(r + 1.0), axis=None),
        "sum vector": lambda: strategy.reduce("SUM", tf.constant([r, 10.0 * r])),
        "mean along rows": lambda: strategy.reduce(tf.distribute.ReduceOp.MEAN, rows, axis=0),
        "sum along rows": lambda: strategy.reduce("SUM", rows, axis=0),
        "allreduce one tensor": lambda: strategy.allreduce(tf.constant([r + 1.0])),
        "gather rows": lambda: strategy.gather(rows, axis=0),
        "gather columns": lambda: strategy.gather(tf.transpose(rows), axis=1),
        "gather a structure": lambda: strategy.gather({"ids": tf.constant([r] * (r + 1))}, axis=0),
        "local results": lambda: strategy.experimental_local_results(strategy.run(lambda: rows * 2.0)),
    }
    out = {}
    for name, form in forms.items():
        out[name] = tf.nest.map_structure(lambda t: t.numpy().tolist(), form())
        out[name + " (tf.function)"] = tf.nest.map_structure(lambda t: t.numpy().tolist(), tf.function(form)())
    strategy.close()
    return out


def mwms_custom_loop(distributed: bool = True, steps: int = 6) -> dict:
    """TensorFlow's "Custom training with tf.distribute.Strategy" tutorial (and the MultiWorkerMirrored
    custom-loop one) with only the strategy line changed: model and optimizer made in strategy.scope(), the
    per-example loss scaled by the global batch, strategy.run, strategy.reduce(SUM, ..., axis=None). Rank 1
    seeds its model differently: the scope starts it from the chief's values."""
    import keras
    import tensorflow as tf

    import rdkeras
    from rdkeras import keras_internals

    global_batch = BATCH
    sites = _keras_sites()
    strategy = rdkeras.RDMAStrategy() if distributed else tf.distribute.get_strategy()
    rank = strategy.worker_index if distributed else 0
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        keras.utils.set_random_seed(40 + 7 * rank)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    patches: list = []

    def train_step(inputs):
        patches.extend(p for p in keras_internals.active_patches() if p not in patches)  # (as it is traced)
        features, labels = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905 (the tutorial's line)
        return loss

    @tf.function
    def distributed_train_step(inputs):
        per_replica_losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = [float(distributed_train_step(batch)) for batch in itertools_take(dist_dataset, steps)]
    out = {"weights": [w.tolist() for w in model.get_weights()], "losses": losses}
    if distributed:
        strategy.close()
        out["patches"] = {"during": patches, "after": keras_internals.active_patches(),
                          "sites_changed": sorted(k for k, v in _keras_sites().items() if sites[k] != v)}  # fmt: skip
    return out


def ran_out_of_data() -> dict:
    """A dataset of unknown size that runs out in the second epoch: Keras's warnings each worker saw."""
    import warnings

    import tensorflow as tf

    import rdkeras

    x, y = _data()

    def batches():
        yield from ((x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 5 * BATCH, BATCH))

    spec = (tf.TensorSpec((None, 10), tf.float32), tf.TensorSpec((None,), tf.int64))
    ds = tf.data.Dataset.from_generator(batches, output_signature=spec)
    strategy = rdkeras.RDMAStrategy()
    with strategy.scope():
        model = _model(seed=2)
        _compile(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(ds, epochs=2, steps_per_epoch=4, verbose=0)
    strategy.close()
    return {"warnings": [str(w.message).split(";")[0] for w in seen if issubclass(w.category, UserWarning)]}


def itertools_take(ds, n):
    for i, item in enumerate(ds):
        if i >= n:
            return
        yield item


def tf_tutorial(per_worker_batch: int = 16, steps: int = 8) -> dict:
    """TensorFlow's multi-worker Keras tutorial with MultiWorkerMirroredStrategy replaced by RDMAStrategy:
    the cluster from TF_CONFIG alone, the dataset batched at per_worker_batch * num_workers."""
    import tensorflow as tf

    import rdkeras

    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = rdkeras.RDMAStrategy()  # was: tf.distribute.MultiWorkerMirroredStrategy()
    global_batch_size = per_worker_batch * num_workers
    x, y = _data(2048)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=1).repeat().batch(global_batch_size)
    with strategy.scope():
        model = _model(seed=1)
        _compile(model)
    history = model.fit(dataset, epochs=3, steps_per_epoch=steps, verbose=0)
    resolver = strategy.cluster_resolver
    out = {
        "loss": history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
        "replicas": strategy.num_replicas_in_sync,
        "task": [resolver.task_type, resolver.task_id],
        "env": sorted(k for k in os.environ if k.startswith("RDKERAS_")),
    }
    strategy.close()
    return out
