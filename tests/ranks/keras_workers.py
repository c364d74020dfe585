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


def fit_model(
    kind: str, batch: int, epochs: int = 2, distributed: bool = True, mode: str = "allreduce", global_batch: bool = True
) -> dict:
    """Trains with SGD; returns final weights and evaluate() results."""
    import rdkeras

    strategy = rdkeras.RDMAStrategy(mode=mode, global_batch=global_batch) if distributed else None
    out = _fit_model_with(strategy, kind, batch, epochs)
    if strategy:
        strategy.close()
    return out


def fit_model_many(configs: list, batch: int) -> dict:
    """fit_model for each (kind, transport, mode) in this one set of processes (TensorFlow imports once), one
    strategy after another; then rank 0 trains each kind in one plain Keras process (the same global batch)."""
    import rdkeras

    def run(config):
        kind, transport, mode = config
        return "/".join(config), kind, rdkeras.RDMAStrategy(transport=transport, mode=mode)

    return fit_in_turn(configs, batch, run, "many")


def fit_in_turn(configs: list, batch: int, start, tag: str, measured=None) -> dict:
    """One strategy after another in this one set of processes (TensorFlow imports once): `start(config)` gives
    (key, kind, strategy); `measured(strategy, before)` adds to the result what the engine did, if given. Then
    rank 0 trains each kind in one plain Keras process (the same global batch)."""
    out, rank = {}, 0
    for i, config in enumerate(configs):
        key, kind, strategy = start(config)
        before = strategy.engine.traffic()
        out[key] = _fit_model_with(strategy, kind, batch)
        if measured is not None:
            out[key].update(measured(strategy, before))
        if i + 1 < len(configs):
            next_port(strategy, f"{tag}{i}")
        rank = strategy.worker_index
        strategy.close()
    if rank == 0:
        for kind in sorted({c[0] for c in configs}):
            out[f"{kind}/reference"] = _fit_model_with(None, kind, batch)
    return out


def _fit_model_with(strategy, kind: str, batch: int, epochs: int = 2) -> dict:
    import contextlib

    import keras

    x, y = _data(kind)
    rank = strategy.worker_index if strategy else 0
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _model(kind, seed=100 + rank)  # different on every rank: the chief's must win
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    results = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "evaluate": results,
        "transport": strategy.transport if strategy else None,
    }


def fit_over_transports(runs: list, kind: str, batch: int, epochs: int = 1) -> dict:
    """fit_model once per (transport, data mode) in this one process (TensorFlow is imported once: slow in the VM).

    Each run gets its own rendezvous port, which rank 0 picks and shares before the previous run ends.
    """
    import keras

    import rdkeras
    from rdkeras.launch import free_port

    x, y = _data(kind)
    out = {}
    for i, (transport, mode) in enumerate(runs):
        strategy = rdkeras.RDMAStrategy(transport=transport, mode=mode)
        with strategy.scope():
            model = _model(kind, seed=100 + strategy.worker_index)
            model.compile(
                optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        out[f"{strategy.transport}/{mode}"] = [w.tolist() for w in model.get_weights()]
        if i + 1 < len(runs):
            store = strategy.engine.store
            if strategy.worker_index == 0:
                store.set(f"next_port/{i}", str(free_port()).encode())
            (port,) = store.get([f"next_port/{i}"], waiting_for=[0])
            os.environ["RDKERAS_MASTER_PORT"] = port.decode()
        strategy.close()
        keras.backend.clear_session()
    return out


def next_port(strategy, tag: str) -> None:
    """Rank 0 picks the rendezvous port of the next strategy in this process and tells the others."""
    from rdkeras.launch import free_port

    store = strategy.engine.store
    if strategy.worker_index == 0:
        store.set(f"next_port/{tag}", str(free_port()).encode())
    (port,) = store.get([f"next_port/{tag}"], waiting_for=[0])
    os.environ["RDKERAS_MASTER_PORT"] = port.decode()


def fit_callbacks(checkpoint_dir: str) -> dict:
    """Epoch logs are averaged over workers, so EarlyStopping stops everyone at the same epoch."""
    import keras

    import rdkeras

    x, y = _data("mlp")
    strategy = rdkeras.RDMAStrategy()
    rank = strategy.worker_index
    # Each worker sees different data, so its own loss differs from the others'.
    x = x + rank * 0.5
    with strategy.scope():
        model = _model("mlp", seed=1)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.02, patience=0)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.05)
    # A per-rank path, so a non-chief checkpoint would show up as its own file.
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, f"rank{rank}.keras"))
    history = model.fit(x, y, batch_size=16, epochs=30, verbose=0, callbacks=[stop, plateau, checkpoint])
    strategy.close()
    return {
        "loss": history.history["loss"],
        "stopped_epoch": stop.stopped_epoch,
        "lr": float(model.optimizer.learning_rate.numpy()),
    }


def fit_with_stats(log_dir: str) -> dict:
    """Trains with rdkeras.callbacks.TrainingStats; the chief writes TensorBoard scalars."""
    import keras

    import rdkeras
    from rdkeras.callbacks import TrainingStats

    x, y = _data("mlp")
    strategy = rdkeras.RDMAStrategy()
    with strategy.scope():
        model = _model("mlp", seed=1)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[TrainingStats(log_dir)])
    traffic = strategy.engine.traffic()
    strategy.close()
    return {"traffic": traffic}


def fit_until_a_peer_dies(victim: int) -> dict:
    """``model.fit`` under RDMAStrategy; `victim` SIGKILLs itself after its third step, so the others' next
    gradient exchange (inside the traced step) fails. Returns what the others caught as ``rdkeras.PeerError``:
    (class, message, ``.rank``, the class of the error it was chained from)."""
    import signal

    import keras

    import rdkeras

    strategy = rdkeras.RDMAStrategy()
    rank = strategy.worker_index

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if rank == victim and batch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = _data("mlp")
    with strategy.scope():
        model = _model("mlp", seed=1)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[Die()])
    except rdkeras.PeerError as e:
        return {"error": [type(e).__name__, str(e), e.rank, type(e.__cause__).__name__]}
    return {"error": None}
