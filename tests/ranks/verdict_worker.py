"""A worker for the one-verdict and launcher hang tests: the ranks exchange in a ring until rank `victim` kills
(KILL) or stops (STOP) itself at step `step`, or hangs there alive (callback, lock, numpy_function: the ways of
tests/ranks/hang_workers.py) for `hang` seconds (default 60: longer than its naming, so its launcher ends it).
Each rank prints the wall-clock time it hung or failed at, for the tests' times to name; no TensorFlow but for
numpy_function."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import rdkeras
from rdkeras.errors import EngineError
from tests.ranks.hang_workers import HANGS

victim, step, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
hang_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
if how == "numpy_function":
    import tensorflow  # noqa: F401 (before the ring: it takes seconds)
with rdkeras.Engine() as eng:
    ring = eng.ring("grads", 1 << 16)
    grads = [np.ones(1 << 12, np.float32)]
    for i in range(1_000_000):
        if eng.rank == victim and i == step:
            if how in HANGS:
                print(f"rank {eng.rank} hangs ({how}) before allreduce #{i + 1} at {time.time():.3f}", flush=True)
                HANGS[how](hang_seconds)
            else:
                print(f"rank {eng.rank} sends itself SIG{how} at step {i}", flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{how}"))
        try:
            ring(grads)
        except EngineError as e:
            print(f"rank {eng.rank} failed at {time.time():.3f}: {type(e).__name__}: {e}", flush=True)
            raise
