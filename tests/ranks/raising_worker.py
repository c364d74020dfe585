"""A worker script for tests/multiproc/test_root_cause.py: ranks exchange in a ring until `culprit` meets a
bug of its own (an uncaught exception) at step `step`, or is killed from outside. A third argument makes each
rank's exit take that many seconds more (a teardown as slow as TensorFlow's can be on a loaded machine)."""

from __future__ import annotations

import atexit
import sys
import time

import numpy as np

import rdkeras

culprit, step = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:
    atexit.register(time.sleep, float(sys.argv[3]))
with rdkeras.Engine() as eng:
    ring = eng.ring("grads", 1 << 20)
    grads = [np.ones(1 << 16, np.float32)]
    for i in range(1_000_000):
        if eng.rank == culprit and i == step:
            raise ValueError(f"a bug in rank {eng.rank}'s own code")
        ring(grads)
