"""Keras workloads run inside each rank of a multi-process test."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np


def _data(kind: str, samples: int = 96):
    rng = np.random.default_rng(7)
    if kind == "cnn":
        x = rng.standard_normal((samples, 8, 8, 1)).astype("float32")
        y = rng.integers(0, 3, samples)
    else:
        x = rng.standard_normal((samples, 12)).astype("float32")
        y = rng.integers(0, 3, samples)
    return x, y


def _model(kind: str, seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    if kind == "cnn":
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.Flatten()(h)
        outputs = keras.layers.Dense(3)(h)
        return keras.Model(inputs, outputs)
    return keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def fit_model(kind: str, batch: int, epochs: int = 2, distributed: bool = True) -> dict:
    """Trains with SGD; returns final weights and evaluate() results."""
    import keras

    import rdkeras

    x, y = _data(kind)
    if distributed:
        strategy = rdkeras.RDMAStrategy()
        rank = strategy.worker_index
        scope = strategy.scope()
    else:
        import contextlib

        strategy, rank, scope = None, 0, contextlib.nullcontext()
    with scope:
        model = _model(kind, seed=100 + rank)  # different on every rank: the chief's must win
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    results = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    out = {
        "weights": [w.tolist() for w in model.get_weights()],
        "evaluate": results,
        "transport": strategy.transport if strategy else None,
    }
    if strategy:
        strategy.close()
    return out
