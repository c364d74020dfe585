"""Workers for tests/multiproc/test_hangs.py: a rank that lives but hangs outside the engine (its heartbeat goes
on) while the others wait for it in a ring allreduce."""

from __future__ import annotations

import threading
import time

import numpy as np

import rdkeras
from rdkeras.errors import EngineError


def _sleeping_callback(seconds: float) -> None:
    time.sleep(seconds)  # a Keras callback that sleeps


def _deadlock(seconds: float) -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire(timeout=seconds)  # held by this very thread: a deadlock (bounded, so the test ends)


def _numpy_function_that_never_returns(seconds: float) -> None:
    import tensorflow as tf

    def stuck(x: np.ndarray) -> np.ndarray:
        time.sleep(seconds)
        return x

    tf.numpy_function(stuck, [tf.constant(1.0)], tf.float32)


HANGS = {"callback": _sleeping_callback, "lock": _deadlock, "numpy_function": _numpy_function_that_never_returns}


def hang_in_allreduce(victim: int, how: str, hang_seconds: float) -> dict:
    """Three allreduces on every rank, then `victim` hangs (`how`) for `hang_seconds` before its fourth while the
    others enter it: they must fail naming the victim and the allreduce it has not entered."""
    if how == "numpy_function":
        import tensorflow  # noqa: F401 (imported before the clock starts: it takes seconds)
    with rdkeras.Engine() as eng:
        ring = eng.ring("grads", 4096)
        x = np.ones(16, np.float32)
        for _ in range(3):
            ring([x])
        if eng.rank == victim:
            HANGS[how](hang_seconds)
            return {"hung": True}
        started = time.monotonic()
        try:
            ring([x])
            return {"error": None}
        except EngineError as e:
            return {
                "error": [type(e).__name__, str(e), getattr(e, "rank", None)],
                "seconds": time.monotonic() - started,
            }


def hang_in_keras_fit(victim: int, hang_seconds: float) -> dict:
    """``model.fit`` under RDMAStrategy on every rank; `victim`'s Keras callback sleeps at its 4th batch while the
    others go on into that step's gradient allreduce: they must fail naming the victim and an allreduce."""
    import keras

    from tests.ranks.keras_workers import _data, _model

    strategy = rdkeras.RDMAStrategy()
    rank = strategy.worker_index

    class Sleepy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if rank == victim and batch == 3:
                _sleeping_callback(hang_seconds)

    x, y = _data("mlp")
    with strategy.scope():
        model = _model("mlp", seed=1)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    started = time.monotonic()
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Sleepy()])
    except Exception as e:  # the engine's PeerError, inside TensorFlow's error where the step's graph raised it
        return {"error": [type(e).__name__, str(e), getattr(e, "rank", None)], "seconds": time.monotonic() - started}
    return {"hung": True} if rank == victim else {"error": None}
