"""Model-parallel worker functions: each trains a placed model and compares it with one process."""

from __future__ import annotations

import os
import zlib

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def build(kind: str):
    import keras

    L = keras.layers  # noqa: N806
    if kind == "mlp":
        x = keras.Input((20,), name="x")
        h = L.Dense(32, activation="relu", name="fc1")(x)
        h = L.Dense(32, activation="tanh", name="fc2")(h)
        h = L.Dense(16, activation="relu", name="fc3")(h)
        return keras.Model(x, L.Dense(5, activation="softmax", name="out")(h), name="mlp")
    if kind == "cnn":
        x = keras.Input((12, 12, 3), name="image")
        h = L.Conv2D(8, 3, activation="relu", name="conv1")(x)
        h = L.MaxPooling2D(name="pool1")(h)
        h = L.Conv2D(8, 3, activation="relu", name="conv2")(h)
        h = L.Flatten(name="flatten")(h)
        h = L.Dense(16, activation="relu", name="fc1")(h)
        return keras.Model(x, L.Dense(4, activation="softmax", name="out")(h), name="cnn")
    if kind == "dominant":  # one layer costs far more than the rest: the automatic cut alternates it
        x = keras.Input((8,), name="x")
        h = L.Dense(1024, activation="relu", name="widen")(x)
        h = L.Dense(1024, activation="relu", name="big")(h)
        h = L.Dense(8, activation="tanh", name="narrow")(h)
        return keras.Model(x, L.Dense(5, activation="softmax", name="out")(h), name="dominant")
    if kind == "skip":  # a -> b -> add(a, b) -> out: with 3 workers, a's output crosses two boundaries
        x = keras.Input((20,), name="x")
        a = L.Dense(24, activation="tanh", name="a")(x)
        b = L.Dense(24, activation="tanh", name="b")(a)
        s = L.Add(name="add")([a, b])
        return keras.Model(x, L.Dense(5, activation="softmax", name="out")(s), name="skip")
    if kind == "two_inputs":
        xa, xb = keras.Input((10,), name="xa"), keras.Input((6,), name="xb")
        ha = L.Dense(16, activation="tanh", name="left")(xa)
        hb = L.Dense(16, activation="tanh", name="right")(xb)
        h = L.Concatenate(name="join")([ha, hb])
        return keras.Model([xa, xb], L.Dense(5, activation="softmax", name="out")(h), name="two_inputs")
    if kind == "rnn":
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        h = L.Embedding(30, 8, name="embed")(tokens)
        h = L.GRU(12, return_sequences=True, name="gru")(h)
        h = L.LSTM(10, name="lstm")(h)
        return keras.Model(tokens, L.Dense(5, activation="softmax", name="out")(h), name="rnn")
    raise ValueError(kind)


def data(kind: str, samples: int):
    rng = np.random.default_rng(7)
    y = rng.integers(0, 5 if kind != "cnn" else 4, samples)
    if kind == "cnn":
        return rng.standard_normal((samples, 12, 12, 3)).astype("float32"), y
    if kind == "dominant":
        return rng.standard_normal((samples, 8)).astype("float32"), y
    if kind == "two_inputs":
        xa, xb = rng.standard_normal((samples, 10)), rng.standard_normal((samples, 6))
        return (xa.astype("float32"), xb.astype("float32")), y
    if kind == "rnn":
        return None, y
    return rng.standard_normal((samples, 20)).astype("float32"), y


def rnn_dataset(batches: int, batch: int):
    """Batches of token sequences whose length changes from batch to batch."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    xs, ys = [], []
    for i in range(batches):
        length = 3 + (i * 5) % 7
        xs.append(rng.integers(0, 30, (batch, length)).astype("int32"))
        ys.append(rng.integers(0, 5, batch))

    def gen():
        yield from zip(xs, ys, strict=True)

    spec = (tf.TensorSpec((batch, None), tf.int32), tf.TensorSpec((batch,), tf.int64))
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)
    return ds.apply(tf.data.experimental.assert_cardinality(batches))


def _train(kind: str, strategy, batch: int, epochs: int, samples: int, val_samples: int = 40):
    import contextlib

    import keras

    keras.utils.set_random_seed(11)  # the same initial weights in every process
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(kind)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,
        )
    if kind == "rnn":
        ds = rnn_dataset(samples // batch, batch)
        hist = model.fit(ds, epochs=epochs, verbose=0)
        ev = model.evaluate(ds, verbose=0, return_dict=True)
        pred = model.predict(ds, verbose=0)  # dynamic edges: the sequence length changes per batch
    else:
        x, y = data(kind, samples)
        # 40 = 16 + 16 + 8: a partial last batch, so evaluation runs a dynamic plan.
        val = (keras.tree.map_structure(lambda a: a[:val_samples], x), y[:val_samples])
        hist = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, validation_data=val)
        ev = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        pred = model.predict(x, batch_size=batch, verbose=0)
    return model, hist.history, ev, pred


def _fixed_times(layer_ms: dict) -> None:
    """The automatic cut takes `layer_ms` as its layers' measured times, and each stage's as its predicted one
    (a loaded machine's measurements once tipped a cut the test is not about)."""
    import dataclasses

    from rdkeras.pipeline.cut import automatic, timing

    measure = timing.measure

    def given(model, rows=timing.DRY_RUN_ROWS, repeats=5):
        found = measure(model, rows, repeats=1)
        return dataclasses.replace(found, seconds=[layer_ms[name] * 1e-3 for name in found.names])

    timing.measure = given
    automatic.AutoCut._stage_seconds = lambda self, model, cut, rows: list(cut.compute)


def train_and_compare(
    kind: str, placement: dict, micro_batches: int = 1, batch: int = 16, epochs: int = 2, samples: int = 96, **kw
) -> dict:
    import rdkeras
    from rdkeras.pipeline.cut import automatic

    if "sharing_gain" in kw:  # what measured gain keeps a cut that shares a layer (the default: 5%)
        automatic.ALTERNATION_GAIN = kw.pop("sharing_gain")
    if "layer_ms" in kw:  # each layer's time given, and a stage's the sum of its layers': the cut, not the clock
        _fixed_times(kw.pop("layer_ms"))
    strategy = rdkeras.RDMAStrategy(
        parallelism=kw.pop("parallelism", "model"), placement=placement, micro_batches=micro_batches, **kw
    )
    model, history, ev, pred = _train(kind, strategy, batch, epochs, samples)
    weights = model.get_weights()
    result = {
        "digest": zlib.crc32(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)),
        "history": history,
        "evaluate": ev,
        "plan": [
            {
                "name": e.name,
                "producer": e.producer,
                "src": e.src,
                "dst": e.dst,
                "transfer": e.transfer,
                "kind": e.kind,
                "grad": e.needs_grad,
                "shape": list(e.shape),
                "transfers": e.transfers,
            }
            for e in strategy.plan.edges
        ],
        "plan_text": strategy.plan_text(),
        "registrations": strategy.engine.counters()["registrations"],
    }
    result["pred_digest"] = zlib.crc32(np.ascontiguousarray(pred).tobytes())
    rank = strategy.worker_index
    strategy.close()  # the reference is a plain Keras run: outside any strategy
    if rank == 0:
        # batch_size is the global batch: one process trains with the same one.
        ref_model, ref_history, ref_ev, ref_pred = _train(kind, None, batch, epochs, samples)
        result["max_weight_diff"] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(weights, ref_model.get_weights(), strict=True)
        )
        result["ref_history"] = ref_history
        result["ref_evaluate"] = ref_ev
        result["max_pred_diff"] = float(np.max(np.abs(pred - ref_pred)))
    return result


def bad_placement(kind: str, placement: dict) -> dict:
    """Compiling with a bad placement fails at once, on every worker, without waiting on the others."""
    import keras

    import rdkeras

    strategy = rdkeras.RDMAStrategy(parallelism="model", placement=placement)
    try:
        with strategy.scope():
            model = build(kind)
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", jit_compile=False)
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}
    finally:
        keras.backend.clear_session()
        strategy.close()


def stage_dies(victim: int, schedule: str) -> dict:
    """A 2-stage pipeline (4 micro-batches) whose stage `victim` SIGKILLs itself after its third step, while the
    other stage goes on into the next: the survivor returns the error that ended its fit and the seconds since
    its last completed step."""
    import signal
    import time

    import keras

    import rdkeras

    strategy = rdkeras.RDMAStrategy(parallelism="pipeline", placement={"fc1": 0, "fc2": 0, "fc3": 1, "out": 1},
                                    micro_batches=4, schedule=schedule)  # fmt: skip
    with strategy.scope():
        model = build("mlp")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", jit_compile=False)
    x, y = data("mlp", 16 * 40)
    last = {"t": time.monotonic()}

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            last["t"] = time.monotonic()
            if strategy.worker_index == victim and batch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Die()])
    except Exception as e:
        return {"error": [type(e).__name__, str(e)[-600:]], "seconds": time.monotonic() - last["t"]}
    return {"error": None}
