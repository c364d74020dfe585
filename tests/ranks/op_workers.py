"""Workers for test_tf_ops: rdkeras's send and receive ops inside tf.functions, rank 0 -> rank 1 -> rank 0."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.ranks.workers import open_engine


def _op_types(fn: Any, *args: Any) -> list[str]:
    graph = fn.get_concrete_function(*args).graph
    return sorted({op.type for op in graph.get_operations() if "RDMA" in op.name})


def round_trip(steps: int = 3) -> dict:
    """Rank 0 sends a float32 and an int32 tensor in one op; rank 1 adds one and sends them back. Returns
    what came back (rank 0) and the op types each side's traced step holds."""
    import tensorflow as tf

    from rdkeras.ops import rdma_recv_all, rdma_send_all

    with open_engine() as eng:
        there = [eng.static_channel("x", 0, 1, (4, 3), np.float32), eng.static_channel("n", 0, 1, (5,), np.int32)]
        back = [eng.static_channel("x'", 1, 0, (4, 3), np.float32), eng.static_channel("n'", 1, 0, (5,), np.int32)]
        specs = [((4, 3), np.float32), ((5,), np.int32)]
        if eng.rank == 0:

            @tf.function
            def step(x: Any, n: Any) -> Any:
                token = rdma_send_all(there, [x, n], "there")
                return rdma_recv_all(back, specs, "back", after=[token])

            came = []
            for i in range(steps):
                x = tf.reshape(tf.range(12, dtype=tf.float32) * (i + 1), (4, 3))
                n = tf.range(5, dtype=tf.int32) - i
                came.append([t.numpy().tolist() for t in step(x, n)])
            eng.barrier()
            return {"came": came, "ops": _op_types(step, x, n)}

        @tf.function
        def echo() -> Any:
            x, n = rdma_recv_all(there, specs, "there")
            return rdma_send_all(back, [x + 1, n + 1], "back")

        for _ in range(steps):
            echo()
        eng.barrier()
        return {"ops": _op_types(echo)}


def wrong_shape() -> dict:
    """A tensor that does not match its channel's shape: the error says both, when the step is traced."""
    import tensorflow as tf

    from rdkeras.ops import rdma_send

    with open_engine() as eng:
        channel = eng.static_channel("x", 0, 1, (4,), np.float32)
        error = None
        if eng.rank == 0:
            try:
                tf.function(lambda: rdma_send(channel, tf.zeros((5,)), "x"))()
            except ValueError as e:
                error = str(e)
        eng.barrier()
        return {"error": error}


def after_close() -> dict:
    """A traced step run again after its engine closed: a clear error, not a crash."""
    import tensorflow as tf

    from rdkeras.ops import rdma_send

    eng = open_engine()
    channel = eng.static_channel("x", 0, 1, (4,), np.float32)
    step = tf.function(lambda: rdma_send(channel, tf.zeros((4,)), "x"))
    step.get_concrete_function()  # traced while the engine is open
    eng.close()
    if eng.rank == 1:
        return {"error": None}
    try:
        step()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}
