"""Workers for tests/multiproc/test_stalls.py that need more than the kill-trial workload."""

from __future__ import annotations

import time

import numpy as np

import rdkeras


def busy_then_send(busy_seconds: float) -> dict:
    """Rank 1 computes in pure Python (holding the GIL) for `busy_seconds`, longer than the heartbeat
    timeout, then sends; rank 0 waits for it meanwhile. A busy rank is alive: nobody may call it stalled."""
    with rdkeras.Engine() as eng:
        ch = eng.static_channel("after-a-long-step", 1, 0, (4,), "float32")
        if eng.rank == 1:
            end, spins = time.monotonic() + busy_seconds, 0
            while time.monotonic() < end:
                spins += 1  # the GIL stays with this thread; the heartbeat thread runs no Python
            ch.send(np.arange(4, dtype=np.float32))
            return {"spins": spins}
        return {"received": ch.recv().tolist()}
