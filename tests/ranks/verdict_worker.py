"""A worker for the one-verdict tests: the ranks exchange in a ring until rank `victim` kills (KILL) or stops
(STOP) itself at step `step`; no TensorFlow."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import rdkeras

victim, step, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with rdkeras.Engine() as eng:
    ring = eng.ring("grads", 1 << 16)
    grads = [np.ones(1 << 12, np.float32)]
    for i in range(1_000_000):
        if eng.rank == victim and i == step:
            print(f"rank {eng.rank} sends itself SIG{how} at step {i}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{how}"))
        ring(grads)
