"""The Keras guides' patterns, each written once and run both in one plain Keras process and under RDMAStrategy on
N data-parallel workers (tests/multiproc/test_keras_patterns.py compares the two).

A pattern is ``fn(env) -> dict`` of arrays and numbers: final weights, the history, evaluate's results,
predictions. `env` gives it ``scope()`` (the strategy's, or nothing in one process) and little else, so the code is
the code a user writes for one process. :func:`run` runs a list of patterns in this process, one after another,
each with a fresh Keras session, the same seed and (on N workers) a strategy of its own.
"""

from __future__ import annotations

import contextlib
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np

PATTERNS: dict = {}
SEED = 1234
# The patterns that apply to a pipeline too (a Functional or Sequential model of several layers, one per strategy).
PIPELINE_PATTERNS = ["fit_default_shuffle", "dropout_lstm", "embedding_adam", "image_augmentation",
                     "functional_multi_input_output"]  # fmt: skip


def pattern(fn):
    PATTERNS[fn.__name__] = fn
    return fn


# Models that train sharded (tests/multiproc/test_sharded.py), apart from the guides' patterns; those that also
# train with shard="parameters" (the others use what it refuses: constraints, mixed precision, accumulation, EMA).
SHARDED: dict = {}
PARAMETERS_SHARDED = ["sharded_gpt2_adam_clipnorm", "sharded_sgd_clipvalue_lr_callback", "sharded_mixed_float16"]
# The guides' patterns also trained with shard="parameters".
PARAMETERS_PATTERNS = ["embedding_adam", "fine_tuning", "evaluate_fit_twice_predict_set_weights"]


def sharded(fn):
    SHARDED[fn.__name__] = fn
    return fn


class Env:
    """What a pattern may ask of where it runs."""

    def __init__(self, strategy, tmp: str):
        self.strategy, self.tmp = strategy, tmp

    def scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    @property
    def distributed(self) -> bool:
        return self.strategy is not None


def run(names: list, distributed: bool, tmp: str, strategy_kwargs: dict | None = None, label: str = "") -> dict:
    """Runs each named pattern in turn (each with a strategy of `strategy_kwargs` where `distributed`, its files in
    a folder of `tmp` named after it and `label`); returns {name: its results as lists, or {"error": traceback}}."""
    import keras

    from tests.ranks.in_turn import _fresh_keras

    out = {}
    for i, name in enumerate(names):
        keras.utils.set_random_seed(SEED)
        strategy = None
        base, _, shard = name.partition("@")  # "name@optimizer": the model trained with shard="optimizer"
        try:
            if distributed:
                import rdkeras

                strategy = rdkeras.RDMAStrategy(**(strategy_kwargs or {}), **({"shard": shard} if shard else {}))
            folder = os.path.join(tmp, base, label or shard or ("distributed" if distributed else "one"))
            os.makedirs(folder, exist_ok=True)
            out[name] = _plain({**PATTERNS, **SHARDED}[base](Env(strategy, folder)))
            if strategy is not None and strategy.parallelism != "data" and "error" not in out[name]:
                out[name]["plan"] = strategy.plan_text()  # (what the pipeline's automatic cut chose)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        finally:
            if strategy is not None:
                from tests.ranks.keras_workers import next_port

                next_port(strategy, f"pattern{i}")
                strategy.close()
            _fresh_keras()
    return out


def load_saved(folder: str) -> dict:
    """The weights of the KerasHub model kerashub_gpt2 saved in `folder` (a .keras file and a preset), loaded by
    Keras and KerasHub alone: the test runs this in a fresh process and checks rdkeras was never imported."""
    import sys

    import keras
    import keras_hub

    from_file = keras.saving.load_model(os.path.join(folder, "lm.keras"))
    from_preset = keras_hub.models.GPT2CausalLM.from_preset(os.path.join(folder, "preset"))
    return {
        "file": _plain(from_file.get_weights()),
        "preset": _plain(from_preset.get_weights()),
        "file_class": type(from_file).__name__,
        "rdkeras_imported": any(name.split(".")[0] == "rdkeras" for name in sys.modules),
    }


def load_optimizer(paths: list) -> dict:
    """Each .keras file loaded by Keras (and KerasHub) alone, and the optimizer variables it holds (read from the
    file: Keras builds a loaded model's optimizer only once it trains); the test runs this in a fresh process and
    checks rdkeras was never imported."""
    import sys
    import zipfile

    import h5py
    import keras
    import keras_hub  # noqa: F401 (registers KerasHub's classes for loading)

    out = {}
    for path in paths:
        keras.saving.load_model(path)
        with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw, h5py.File(raw) as f:
            group = f["optimizer/vars"]
            out[path] = [np.asarray(group[str(i)]).astype(np.float64).tolist() for i in range(len(group))]
    return {"files": out, "rdkeras_imported": any(name.split(".")[0] == "rdkeras" for name in sys.modules)}


def _plain(value):
    """Arrays and numbers as JSON-able lists and floats."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OSU":
            return [str(v) for v in value.ravel()]
        return value.astype(np.float64).tolist()
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return float(value)
    return value


def _result(model, history=None, **more) -> dict:
    out = {"weights": model.get_weights()}
    if history is not None:
        out["history"] = history.history
    out.update(more)
    return out


def _classify(env, layers, x, y, optimizer, **fit) -> dict:
    """The common shape of a guide's classifier: ``keras.Sequential(layers())`` built and compiled in the scope
    with `optimizer` and sparse categorical cross-entropy on logits, fit (2 epochs unless `fit` says), results."""
    import keras

    with env.scope():
        model = keras.Sequential(layers())
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, **{"epochs": 2, "verbose": 0, **fit})
    return _result(model, history)


def _classification(samples: int = 96, features: int = 12, classes: int = 3, seed: int = 7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype("float32")
    y = (x[:, :classes].argmax(1) + (rng.random(samples) < 0.2)) % classes
    return x, y.astype("int32")


def _mlp(classes: int = 3, features: int = 12, activation=None):
    import keras

    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(classes, activation=activation),
        ]
    )


# -- training with built-in methods ------------------------------------------------------------------------------


@pattern
def fit_default_shuffle(env):
    """fit(x, y) with Keras's default shuffle=True: one process's batch order, split over the workers."""
    import keras

    x, y = _classification()
    with env.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True),
                      metrics=["accuracy"])  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    return _result(model, history, evaluate=model.evaluate(x, y, batch_size=16, verbose=0),
                   predict=model.predict(x[:10], batch_size=4, verbose=0))  # fmt: skip


@pattern
def tf_data_seeded_shuffle(env):
    """A tf.data pipeline shuffled with a seed, batched at the global batch."""
    import keras
    import tensorflow as tf

    x, y = _classification()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(16)
    with env.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
    history = model.fit(ds, epochs=3, verbose=0)
    return _result(model, history)


@pattern
def metrics_auc_precision_recall_f1(env):
    """AUC, Precision, Recall and F1 where one worker's rows hold the positives: metric state, not results."""
    import keras

    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 8)).astype("float32")
    y = np.zeros((64, 1), "float32")
    y[:24] = 1.0  # the first global batch's first rows: worker 0's
    with env.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                               keras.metrics.Recall(name="recall"), keras.metrics.F1Score(threshold=0.5, name="f1"),
                               "accuracy"])  # fmt: skip
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    return _result(model, history, evaluate=evaluated)


@pattern
def dropout_lstm(env):
    """Embedding -> LSTM -> Dropout -> Dense: dropout's masks drawn for the global batch."""
    import keras

    rng = np.random.default_rng(5)
    x = rng.integers(1, 50, (64, 10)).astype("int32")
    y = (x[:, 0] > 25).astype("int32")

    def layers():
        return [keras.Input((10,), dtype="int32"), keras.layers.Embedding(50, 8), keras.layers.LSTM(8),
                      keras.layers.Dropout(0.3), keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=16, shuffle=False)


@pattern
def loss_sum_reduction(env):
    """A loss reduced by "sum": the global batch's sum, not the mean of the workers' sums."""
    import keras

    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = x @ rng.standard_normal((6, 2)).astype("float32")
    with env.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss=keras.losses.MeanSquaredError(reduction="sum"))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return _result(model, history, evaluate=model.evaluate(x, y, batch_size=16, verbose=0))


@pattern
def masked_token_loss(env):
    """A token loss over padded sequences: divided by the global batch's unmasked tokens."""
    import keras

    rng = np.random.default_rng(11)
    x = rng.integers(1, 30, (64, 12)).astype("int32")
    lengths = np.where(np.arange(64) % 16 < 8, 2, 12)  # worker 0's rows mostly padding
    x[np.arange(12)[None, :] >= lengths[:, None]] = 0
    y = (x + 1) % 30
    with env.scope():
        model = keras.Sequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(30, 8, mask_zero=True),
                                  keras.layers.Dense(30)])  # fmt: skip
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return _result(model, history)


@pattern
def embedding_adam(env):
    """Embedding trained with Adam: its sparse gradients reach the optimizer as one process's."""
    import keras

    rng = np.random.default_rng(13)
    x = rng.integers(0, 100, (64, 6)).astype("int32")
    y = (x.sum(1) % 2).astype("int32")

    def layers():
        return [keras.Input((6,), dtype="int32"), keras.layers.Embedding(100, 8),
                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=16, epochs=3, shuffle=False)


@pattern
def evaluate_fit_twice_predict_set_weights(env):
    """A model's life in a notebook: evaluated before training, fit with validation data, fit again, evaluated,
    asked to predict, its weights halved by set_weights and evaluated again."""
    import keras

    x, y = _classification(seed=43)
    with env.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(3)])  # fmt: skip
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    before = model.evaluate(x, y, batch_size=16, verbose=0)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x[:32], y[:32]))
    again = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    after = model.evaluate(x, y, batch_size=16, verbose=0)
    predicted = model.predict(x[:8], batch_size=8, verbose=0)
    out = _result(model, history, before=before, again=again, after=after, predicted=predicted)
    model.set_weights([w * 0.5 for w in model.get_weights()])
    return {**out, "halved": model.evaluate(x, y, batch_size=16, verbose=0)}


@pattern
def fine_tuning(env):
    """Transfer learning: a frozen base, fit, unfreeze, recompile with a low learning rate, fit again."""
    import keras

    x, y = _classification()
    with env.scope():
        base = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu")], name="base")
        base.trainable = False
        inputs = keras.Input((12,))
        outputs = keras.layers.Dense(3)(base(inputs, training=False))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    first = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    base.trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True))
    second = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return _result(model, first=first.history, second=second.history)


@pattern
def text_vectorization_strings(env):
    """Strings in: TextVectorization in the model (keras.io text classification), fit and predict on text."""
    import keras
    import tensorflow as tf

    words = ["good", "great", "bad", "awful", "film", "plot", "fine", "dull"]
    rng = np.random.default_rng(17)
    texts = [" ".join(rng.choice(words, 5)) for _ in range(64)]
    y = np.array([int(sum(w in ("good", "great", "fine") for w in t.split()) >= 2) for t in texts], "int32")
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=6)
    vectorize.adapt(texts)
    with env.scope():
        model = keras.Sequential([keras.Input((1,), dtype="string"), vectorize, keras.layers.Embedding(20, 8),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])  # fmt: skip
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(tf.constant(texts)[:, None], y, batch_size=16, epochs=2, verbose=0)
    predicted = model.predict(tf.constant([["good great film"], ["awful dull plot"]]), verbose=0)
    return _result(model, history, predict=predicted)


@pattern
def kerashub_gpt2(env):
    """KerasHub's GPT-2 causal LM, built from a small config, trained with its own fit, then generate()."""
    import keras
    import keras_hub

    rng = np.random.default_rng(19)
    tokens = rng.integers(1, 64, (32, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((32, 8), bool)}
    y = tokens[:, 1:]
    with env.scope():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=16, dropout=0.1)  # fmt: skip
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True),
                   sampler="greedy")  # fmt: skip
    history = lm.fit(x, y, batch_size=16, epochs=2, verbose=0)
    if not env.distributed or env.strategy.is_chief:  # read back by load_saved, in a process without rdkeras
        lm.save(os.path.join(env.tmp, "lm.keras"))
        lm.save_to_preset(os.path.join(env.tmp, "preset"))
    prompt_mask = np.arange(8)[None, :] < np.array([[3], [5]])
    generated = lm.generate({"token_ids": tokens[:2, :8] * prompt_mask, "padding_mask": prompt_mask},
                            stop_token_ids=None)  # fmt: skip
    return _result(lm, history, generated=generated["token_ids"])


@pattern
def pydataset_shuffled(env):
    """A keras.utils.PyDataset that reshuffles its rows each epoch (seeded), with fit's default shuffle."""
    import keras

    x, y = _classification()

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.rng, self.order = np.random.default_rng(21), np.arange(len(x))

        def __len__(self):
            return len(x) // 16

        def __getitem__(self, i):
            rows = self.order[i * 16 : (i + 1) * 16]
            return x[rows], y[rows]

        def on_epoch_end(self):
            self.order = self.rng.permutation(len(x))

    with env.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(Batches(), epochs=3, verbose=0)
    return _result(model, history)


@pattern
def validation_split_and_class_weight(env):
    """validation_split, class_weight and Keras's default shuffle together."""
    import keras

    x, y = _classification(samples=120)
    with env.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True),
                      metrics=["accuracy"])  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=2, validation_split=0.2, class_weight={0: 1.0, 1: 3.0, 2: 0.5},
                        verbose=0)  # fmt: skip
    return _result(model, history)


@pattern
def sample_weights_uneven(env):
    """Sample weights whose totals differ between the workers' rows, with every loss reduction that uses them."""
    import keras

    rng = np.random.default_rng(23)
    x = rng.standard_normal((64, 6)).astype("float32")
    y = x @ rng.standard_normal((6, 1)).astype("float32")
    weights = np.where(np.arange(64) % 16 < 8, 3.0, 0.25).astype("float32")
    out = {}
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight", "mean", "sum"):
        keras.utils.set_random_seed(SEED)
        with env.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss=keras.losses.MeanSquaredError(reduction=reduction))  # fmt: skip
        history = model.fit(x, y, sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0)
        out[reduction] = _result(model, history, evaluate=model.evaluate(x, y, sample_weight=weights, verbose=0))
    return out


@pattern
def custom_loss_function(env):
    """A plain function as the loss (Keras wraps it, reducing by sum_over_batch_size), and add_loss."""
    import keras
    from keras import ops

    def huberish(y_true, y_pred):
        error = ops.abs(y_true - y_pred)
        return ops.mean(ops.where(error < 1.0, 0.5 * error**2, error - 0.5), axis=-1)

    rng = np.random.default_rng(29)
    x = rng.standard_normal((48, 5)).astype("float32")
    y = x @ rng.standard_normal((5, 2)).astype("float32")
    with env.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activity_regularizer="l2"),
                                  keras.layers.Dense(2, kernel_regularizer="l2")])  # fmt: skip
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=huberish, metrics=["mae"])
    history = model.fit(x, y, batch_size=12, epochs=3, shuffle=False, verbose=0)
    return _result(model, history)


@pattern
def functional_multi_input_output(env):
    """A functional model with two inputs and two outputs, loss weights and per-output metrics."""
    import keras

    rng = np.random.default_rng(31)
    a = rng.standard_normal((64, 5)).astype("float32")
    b = rng.integers(0, 20, (64, 4)).astype("int32")
    label = (a[:, 0] > 0).astype("int32")
    value = (a.sum(1, keepdims=True) + b.mean(1, keepdims=True) / 10).astype("float32")
    with env.scope():
        in_a, in_b = keras.Input((5,), name="a"), keras.Input((4,), dtype="int32", name="b")
        h = keras.layers.Concatenate()(
            [
                keras.layers.Dense(8, activation="relu")(in_a),
                keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(in_b)),
            ]
        )
        model = keras.Model(
            {"a": in_a, "b": in_b},
            {"label": keras.layers.Dense(2, name="label")(h), "value": keras.layers.Dense(1, name="value")(h)},
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss={"label": keras.losses.SparseCategoricalCrossentropy(True), "value": "mse"},
                      loss_weights={"label": 1.0, "value": 0.5},
                      metrics={"label": ["accuracy"], "value": ["mae"]})  # fmt: skip
    history = model.fit({"a": a, "b": b}, {"label": label, "value": value}, batch_size=16, epochs=2, verbose=0)
    predicted = model.predict({"a": a[:6], "b": b[:6]}, verbose=0)
    return _result(model, history, predict=predicted)


@pattern
def subclassed_model(env):
    """A subclassed model with its own call() (dropout inside), trained with fit."""
    import keras

    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.drop, self.out = (
                keras.layers.Dense(16, "relu"),
                keras.layers.Dropout(0.25),
                keras.layers.Dense(3),
            )

        def call(self, x, training=False):
            return self.out(self.drop(self.hidden(x), training=training))

    x, y = _classification()
    with env.scope():
        model = Classifier()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return _result(model, history, predict=model.predict(x[:5], verbose=0))


@pattern
def custom_train_step(env):
    """keras.io "customizing what happens in fit": a train_step of one's own over compute_loss and the metrics."""
    import keras
    import tensorflow as tf

    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    x, y = _classification()
    with env.scope():
        inputs = keras.Input((12,))
        model = Custom(inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True),
                      metrics=["accuracy"])  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return _result(model, history)


@pattern
def custom_training_loop(env):
    """keras.io "writing a training loop from scratch", distributed the tf.distribute way: strategy.run, a loss
    averaged over the global batch, a metric made in the scope. In one process, TensorFlow's default strategy."""
    import keras
    import tensorflow as tf

    strategy = env.strategy or tf.distribute.get_strategy()
    x, y = _classification()
    y = np.where(np.arange(len(y)) % 16 < 8, y, (y + 1) % 3)  # worker 1's rows mislabelled: its accuracy is lower
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with env.scope():
        model = _mlp()
        optimizer = keras.optimizers.Adam(0.01)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def step(batch):
        bx, by = batch
        with tf.GradientTape() as tape:
            logits = model(bx, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(by, logits), global_batch_size=16)
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
        )
        accuracy.update_state(by, logits)
        return loss

    losses = []
    for _ in range(2):
        for batch in strategy.experimental_distribute_dataset(dataset):
            losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None)))
    return _result(model, losses=losses, accuracy=accuracy.result())


@pattern
def preprocessing_layers(env):
    """Normalization, Discretization and CategoryEncoding (adapted beforehand) inside the model."""
    import keras

    rng = np.random.default_rng(37)
    x = (rng.standard_normal((64, 4)) * [1, 10, 100, 0.1] + [0, 5, -50, 1]).astype("float32")
    y = (x[:, 1] > 5).astype("int32")
    normalize = keras.layers.Normalization()
    normalize.adapt(x)
    bins = keras.layers.Discretization(num_bins=4)
    bins.adapt(x[:, :1])
    with env.scope():
        inputs = keras.Input((4,))
        encoded = keras.layers.CategoryEncoding(num_tokens=4, output_mode="one_hot")(bins(inputs[:, :1]))
        h = keras.layers.Concatenate()([normalize(inputs), encoded])
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, "relu")(h)))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return _result(model, history)


@pattern
def conv_batch_norm_synchronized(env):
    """A small convnet with BatchNormalization(synchronized=True): statistics of the global batch."""
    import keras

    rng = np.random.default_rng(41)
    x = rng.standard_normal((32, 8, 8, 2)).astype("float32")
    y = (x.mean((1, 2, 3)) > 0).astype("int32")
    with env.scope():
        model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3),
                                  keras.layers.BatchNormalization(synchronized=True), keras.layers.ReLU(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])  # fmt: skip
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return _result(model, history, evaluate=model.evaluate(x, y, batch_size=8, verbose=0))


@pattern
def noise_and_dropout_layers(env):
    """SpatialDropout1D, GaussianNoise, GaussianDropout and AlphaDropout: each draws the global batch's values."""
    import keras

    rng = np.random.default_rng(43)
    x = rng.standard_normal((48, 6, 4)).astype("float32")
    y = (x[:, :, 0].sum(1) > 0).astype("int32")

    def layers():
        return [keras.Input((6, 4)), keras.layers.SpatialDropout1D(0.2), keras.layers.GaussianNoise(0.3),
                      keras.layers.Flatten(), keras.layers.Dense(8, activation="selu"), keras.layers.AlphaDropout(0.2),
                      keras.layers.GaussianDropout(0.2), keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=16)


@pattern
def image_augmentation(env):
    """RandomFlip, RandomRotation, RandomZoom, RandomTranslation and RandomCrop in the model."""
    import keras

    rng = np.random.default_rng(47)
    x = rng.random((32, 12, 12, 1)).astype("float32")
    y = (x[:, :6].mean((1, 2, 3)) > x[:, 6:].mean((1, 2, 3))).astype("int32")

    def layers():
        return [keras.Input((12, 12, 1)), keras.layers.RandomFlip(), keras.layers.RandomRotation(0.1),
                      keras.layers.RandomZoom(0.1), keras.layers.RandomTranslation(0.1, 0.1),
                      keras.layers.RandomCrop(10, 10), keras.layers.Conv2D(4, 3, activation="relu"),
                      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=8)


@pattern
def gan_with_keras_random(env):
    """A GAN's train_step (keras.io DCGAN, small): keras.random noise, two optimizers of the model's own."""
    import keras
    import tensorflow as tf

    class GAN(keras.Model):
        def __init__(self):
            super().__init__()
            self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(6)])
            self.discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "relu"),
                                                   keras.layers.Dense(1)])  # fmt: skip
            self.seed_generator = keras.random.SeedGenerator(7)

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
            self.d_loss, self.g_loss = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss, self.g_loss]

        def train_step(self, real):
            rows = tf.shape(real)[0]
            noise = keras.random.normal((rows, 4), seed=self.seed_generator)
            fake = self.generator(noise)
            images = tf.concat([fake, real], 0)
            labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(images))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights, strict=True))
            noise = keras.random.normal((rows, 4), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(tf.zeros((rows, 1)), self.discriminator(self.generator(noise)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
            self.d_loss.update_state(d_loss)
            self.g_loss.update_state(g_loss)
            return {"d_loss": self.d_loss.result(), "g_loss": self.g_loss.result()}

    real = np.random.default_rng(53).standard_normal((32, 6)).astype("float32")
    with env.scope():
        gan = GAN()
        gan.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01))
    history = gan.fit(real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return _result(gan, history)


@pattern
def mixed_precision(env):
    """The keras.io mixed precision guide's policies: mixed_bfloat16, and mixed_float16 with its LossScaleOptimizer,
    whose dynamic loss scale moves alike everywhere."""
    import keras

    x, y = _classification()
    out = {"tolerance": 1e-3}  # (bfloat16/float16 sums in another order)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        keras.utils.set_random_seed(SEED)
        keras.mixed_precision.set_global_policy(policy)

        def layers():
            return [
                keras.Input((12,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3, dtype="float32"),
            ]

        out[policy] = _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=16)
    return out


@pattern
def callbacks_monitor_global_metrics(env):
    """EarlyStopping and ReduceLROnPlateau on val_auc, ModelCheckpoint(save_best_only): they see one process's
    numbers, so they stop, lower the rate and save at one process's epochs."""
    import keras

    rng = np.random.default_rng(59)
    x = rng.standard_normal((96, 8)).astype("float32")
    y = ((x[:, 0] + 0.5 * rng.standard_normal(96)) > 0.6).astype("float32")[:, None]
    best = os.path.join(env.tmp, "best.keras")
    with env.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy",
                      metrics=[keras.metrics.AUC(name="auc")])  # fmt: skip
    callbacks = [keras.callbacks.EarlyStopping("val_auc", mode="max", patience=1),
                 keras.callbacks.ReduceLROnPlateau("val_auc", mode="max", patience=0, factor=0.5),
                 keras.callbacks.ModelCheckpoint(best, monitor="val_auc", mode="max", save_best_only=True)]  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=12, validation_split=0.25, callbacks=callbacks, verbose=0)
    out = _result(model, history, stopped=callbacks[0].stopped_epoch, lr=model.optimizer.learning_rate)
    if not env.distributed or env.strategy.is_chief:  # (ModelCheckpoint runs on the chief)
        out["saved"] = {"best": callbacks[2].best, "weights": keras.models.load_model(best).get_weights()}
    return out


@pattern
def bidirectional_gru_masked(env):
    """keras.io's RNN guide: a masked Embedding into a bidirectional GRU with recurrent dropout."""
    import keras

    rng = np.random.default_rng(61)
    x = rng.integers(1, 40, (48, 10)).astype("int32")
    x[np.arange(10)[None, :] >= rng.integers(3, 11, 48)[:, None]] = 0
    y = (x[:, 0] % 2).astype("int32")

    def layers():
        return [keras.Input((10,), dtype="int32"), keras.layers.Embedding(40, 6, mask_zero=True),
                      keras.layers.Bidirectional(keras.layers.GRU(6, dropout=0.2, recurrent_dropout=0.2)),
                      keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, x, y, keras.optimizers.Adam(0.01), batch_size=16)


@pattern
def kerashub_lora(env):
    """LoRA on a KerasHub backbone (enable_lora): only the LoRA weights train, and only they cross the wire."""
    import keras
    import keras_hub

    rng = np.random.default_rng(67)
    tokens = rng.integers(1, 64, (32, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((32, 8), bool)}
    with env.scope():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=16, dropout=0.0)  # fmt: skip
        backbone.enable_lora(2)
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))
    before = env.strategy.engine.traffic()["bytes_written"] if env.distributed else 0
    history = lm.fit(x, tokens[:, 1:], batch_size=16, epochs=1, verbose=0)
    out = _result(lm, history)
    if env.distributed:  # what crossed the wire in the 2 steps, against the bytes of the trainable weights and of all
        from rdkeras.fitting.saving import variables_bytes

        out["wire"] = {
            "sent": env.strategy.engine.traffic()["bytes_written"] - before,
            "trainable": variables_bytes(lm.trainable_variables),
            "all": variables_bytes(lm.weights),
        }
    return out


@pattern
def kerashub_text_classifier(env):
    """A KerasHub BERT text classifier with its preprocessor: strings in, tokenized by a tf.data map inside fit."""
    import keras
    import keras_hub

    words = ["good", "great", "bad", "awful", "film", "plot", "fine", "dull"]
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    rng = np.random.default_rng(71)
    texts = np.array([" ".join(rng.choice(words, 4)) for _ in range(32)])
    labels = np.array([int(sum(w in ("good", "great", "fine") for w in t.split()) >= 2) for t in texts])
    with env.scope():
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary)
        preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=8)
        backbone = keras_hub.models.BertBackbone(vocabulary_size=len(vocabulary), num_layers=1, num_heads=2,
                                                 hidden_dim=8, intermediate_dim=16, max_sequence_length=8)  # fmt: skip
        classifier = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=preprocessor)
        classifier.compile(optimizer=keras.optimizers.Adam(1e-2),
                           loss=keras.losses.SparseCategoricalCrossentropy(True), metrics=["accuracy"])  # fmt: skip
    history = classifier.fit(texts, labels, batch_size=8, epochs=2, verbose=0)
    evaluated = classifier.evaluate(texts, labels, batch_size=8, verbose=0)
    return _result(classifier, history, evaluate=evaluated, predict=classifier.predict(texts[:4], verbose=0))


@pattern
def partial_last_batches(env):
    """Data that ends in a partial batch split unevenly (3 rows: 2 and 1) or leaving a worker no row at all (1 row),
    with Dropout, metrics, evaluate and predict."""
    import keras

    out = {}
    for samples in (99, 97):
        keras.utils.set_random_seed(SEED)
        x, y = _classification(samples=samples)
        with env.scope():
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dropout(0.2), keras.layers.Dense(3)])  # fmt: skip
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True),
                          metrics=["accuracy"])  # fmt: skip
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        out[str(samples)] = _result(model, history, evaluate=model.evaluate(x, y, batch_size=16, verbose=0),
                                    predict=model.predict(x, batch_size=16, verbose=0))  # fmt: skip
    return out


@pattern
def ragged_inputs(env):
    """Sequences of different lengths as a tf.RaggedTensor (Keras takes them where a layer does): each worker
    gets its rows of every ragged global batch."""
    import keras
    import tensorflow as tf

    class RaggedMean(keras.layers.Layer):
        def call(self, x):
            return tf.reduce_mean(x, axis=1)

    rng = np.random.default_rng(73)
    lengths = rng.integers(1, 8, 48)
    tokens = tf.ragged.constant([rng.integers(0, 30, n).tolist() for n in lengths], dtype=tf.int32)
    y = (lengths > 4).astype("int32")

    def layers():
        return [keras.Input((None,), dtype="int32", ragged=True), keras.layers.Embedding(30, 4), RaggedMean(),
                keras.layers.Dense(2)]  # fmt: skip

    return _classify(env, layers, tokens, y, keras.optimizers.Adam(0.01), batch_size=16)


# -- trained sharded (tests/multiproc/test_sharded.py) ------------------------------------------------------------


def _with_state(env, model, result: dict) -> dict:
    """`result` and the bytes of model state this process holds: its weights, its optimizer's state. The model is
    saved as model.keras (distributed: by RDMAStrategy.export, the optimizer's state whole), for load_optimizer."""
    from rdkeras.fitting.saving import variables_bytes  # (lazily: load_optimizer's process never imports rdkeras)

    path = os.path.join(env.tmp, "model.keras")
    if env.distributed:
        result["state"] = env.strategy.state_bytes(model)
        env.strategy.export(model, path)
        if env.strategy.options.data.shard == "parameters":  # Keras's own save would write pieces: refused
            try:
                model.save_weights(os.path.join(env.tmp, "refused.weights.h5"))
            except NotImplementedError as e:
                result["refused_save"] = str(e)
        else:
            result["told_saved_in_part"] = _warnings_saving_twice(env, model)
    else:
        model.save(path)
        result["state"] = {
            "parameters": variables_bytes(model.weights),
            "optimizer": variables_bytes(model.optimizer.variables),
        }
    return result


def _warnings_saving_twice(env, model) -> list[str]:
    """What rdkeras warns when Keras saves the sharded model twice on this worker, weights with its optimizer."""
    import logging

    from rdkeras._log import logger

    said: list[str] = []

    class Caught(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    caught = Caught(logging.WARNING)
    logger.addHandler(caught)
    try:
        rank = env.strategy.worker_index
        for i in range(2):
            model.save_weights(os.path.join(env.tmp, f"plain-{rank}-{i}.weights.h5"))
    finally:
        logger.removeHandler(caught)
    return said


@sharded
def sharded_gpt2_adam_clipnorm(env):
    """KerasHub's GPT-2 (a small config) with Adam and a per-variable clipnorm, trained with its own fit."""
    import keras
    import keras_hub

    rng = np.random.default_rng(23)
    tokens = rng.integers(1, 64, (32, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((32, 8), bool)}
    with env.scope():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=16, dropout=0.0)  # fmt: skip
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(3e-3, clipnorm=0.05),
                   loss=keras.losses.SparseCategoricalCrossentropy(True))  # fmt: skip
    history = lm.fit(x, tokens[:, 1:], batch_size=16, epochs=2, verbose=0)
    return _with_state(env, lm, _result(lm, history))


@sharded
def sharded_adamw_global_clipnorm(env):
    """Embedding, a frozen layer, a max-norm constraint; AdamW with decay (biases excluded), global_clipnorm and
    a decaying learning-rate schedule."""
    import keras

    rng = np.random.default_rng(29)
    x = rng.integers(0, 50, (64, 6)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    with env.scope():
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(24, activation="relu", kernel_constraint=keras.constraints.MaxNorm(0.9)),
            keras.layers.Dense(16, activation="tanh", trainable=False),
            keras.layers.Dense(3),
        ])  # fmt: skip
        schedule = keras.optimizers.schedules.ExponentialDecay(5e-3, decay_steps=3, decay_rate=0.7)
        optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.05, global_clipnorm=0.3)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return _with_state(env, model, _result(model, history))


@sharded
def sharded_accumulation_ema(env):
    """Adam accumulating 2 steps' gradients (clipped by their global norm once accumulated), with moving averages
    written into the weights every 3 steps and at the end; an Embedding among the layers; 5 steps an epoch."""
    import keras

    rng = np.random.default_rng(41)
    x = rng.integers(0, 40, (80, 5)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    with env.scope():
        model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 8),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])  # fmt: skip
        optimizer = keras.optimizers.Adam(0.02, gradient_accumulation_steps=2, global_clipnorm=0.5, use_ema=True,
                                          ema_momentum=0.8, ema_overwrite_frequency=3)  # fmt: skip
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    return _with_state(env, model, _result(model, history))


@sharded
def sharded_sgd_clipvalue_lr_callback(env):
    """SGD with momentum and clipvalue; a callback sets the learning rate each epoch."""
    import keras

    x, y = _classification(seed=31)
    with env.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, clipvalue=0.02),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch: 0.05 / (1 + epoch))
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[schedule])
    return _with_state(env, model, _result(model, history))


@sharded
def sharded_mixed_float16(env):
    """mixed_float16 with its LossScaleOptimizer around Adam: the loss scale moves alike everywhere."""
    import keras

    x, y = _classification(seed=37)
    keras.mixed_precision.set_global_policy("mixed_float16")
    layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3, dtype="float32")]
    with env.scope():
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    scale = float(model.optimizer.dynamic_scale.numpy())
    return _with_state(env, model, _result(model, history, scale=scale, tolerance=1e-3))
