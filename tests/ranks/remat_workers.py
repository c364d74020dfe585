"""keras.RematScope under RDMAStrategy (tests/multiproc/test_remat.py): one small model with Dropout, built under a
RematScope of the given mode, trained a few steps in one plain Keras process or on the workers of a strategy; each
run returns what the test compares (the weights, the losses) and the Keras patches still in effect after it."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np

SEED = 1234
PLACEMENT = {"hidden1": 0, "dropout": 0, "hidden2": 1, "logits": 1}  # a pipeline's two stages


def _data(samples: int = 64, features: int = 12, classes: int = 3, seed: int = 7) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype("float32")
    return x, x[:, :classes].argmax(1).astype("int32")


def train(mode: str | None, strategy_kwargs: dict | None = None, threshold: int = 1024, names: tuple = ()) -> dict:
    """The model built under ``keras.RematScope(mode)`` (None: no scope at all) in one plain Keras process
    (`strategy_kwargs` None) or under ``RDMAStrategy(**strategy_kwargs)``, fit 2 epochs of 4 steps."""
    import keras

    from rdkeras import keras_internals

    keras.utils.set_random_seed(SEED)
    strategy = None
    if strategy_kwargs is not None:
        import rdkeras

        strategy = rdkeras.RDMAStrategy(**strategy_kwargs)
    try:
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        remat = keras.RematScope(mode, threshold, list(names)) if mode else contextlib.nullcontext()
        with scope:
            with remat:
                inputs = keras.Input((12,))
                h = keras.layers.Dense(32, activation="relu", name="hidden1")(inputs)
                h = keras.layers.Dropout(0.3, name="dropout")(h)
                h = keras.layers.Dense(32, activation="tanh", name="hidden2")(h)
                model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True))
        x, y = _data()
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        out = {"weights": [w.astype(np.float64).tolist() for w in model.get_weights()], "loss": history.history["loss"]}
    finally:
        if strategy is not None:
            strategy.close()
    out["patches_after"] = keras_internals.active_patches()
    return out
