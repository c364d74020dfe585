"""A worker script for tests/multiproc/test_root_cause.py: ranks exchange in a ring until `culprit` meets a
bug of its own (an uncaught exception) at step `step`, or is killed from outside."""

from __future__ import annotations

import sys

import numpy as np

import rdkeras

culprit, step = int(sys.argv[1]), int(sys.argv[2])
with rdkeras.Engine() as eng:
    ring = eng.ring("grads", 1 << 20)
    grads = [np.ones(1 << 16, np.float32)]
    for i in range(1_000_000):
        if eng.rank == culprit and i == step:
            raise ValueError(f"a bug in rank {eng.rank}'s own code")
        ring(grads)
