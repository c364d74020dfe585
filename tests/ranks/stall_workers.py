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


def close_while_another_thread_waits() -> dict:
    """Rank 0: a thread waits for a message rank 1 never sends while the main thread closes the engine; the
    waiting thread must end at once with an error that says the engine was closed."""
    import threading

    from rdkeras.errors import EngineError

    with rdkeras.Engine() as eng:
        ch = eng.static_channel("never", 1, 0, (4,), "float32")
        eng.barrier("ready")
        if eng.rank == 1:
            eng.barrier("done")
            time.sleep(3)  # alive meanwhile: rank 0's waiting thread must hear of its own engine's close
            return {}
        outcome: dict = {}

        def wait() -> None:
            started = time.monotonic()
            try:
                ch.recv()
                outcome["error"] = None
            except EngineError as e:
                outcome["error"] = [type(e).__name__, str(e)]
            outcome["seconds"] = time.monotonic() - started

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
        eng.barrier("done")
        eng.close()
        waiter.join(30)
        return outcome
