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
