"""What rdkeras.introspect reads of a 2-worker job: the traffic of one allreduce, the state bytes of a small model
in each shard mode, the plan and the algorithm for a size."""

from __future__ import annotations

from tests.ranks.keras_workers import next_port


def inspected(shards: list, nbytes: int) -> dict:
    import keras
    import numpy as np

    import rdkeras
    from rdkeras import introspect

    out: dict = {}
    for i, shard in enumerate(shards):
        strategy = rdkeras.RDMAStrategy(algorithm="ring", shard=shard)
        view = introspect.inspect(strategy)
        x = np.full(nbytes // 4, 1.0 + strategy.worker_index, np.float32)
        strategy.collectives.allreduce([x], average=False, purpose="probe")  # its ring set up
        before = view.traffic()
        (summed,) = strategy.collectives.allreduce([x], average=False, purpose="probe")
        after = view.traffic()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.fit(np.ones((8, 4), np.float32), np.ones((8, 3), np.float32), batch_size=8, epochs=1, verbose=0)
        out[shard] = {
            "written": after["bytes_written"] - before["bytes_written"],
            "received": after["bytes_received"] - before["bytes_received"],
            "summed": float(summed[0]),
            "state": view.state_bytes(model).as_dict(),
            "workers": view.workers,
            "shard": view.shard,
            "plan_text": view.plan_text(),
            "plan_is_the_strategys": view.plan == strategy.plan and view.plan.text() == strategy.plan_text(),
            "algorithm": view.algorithm_for(nbytes),
        }
        if i + 1 < len(shards):
            next_port(strategy, f"introspect{i}")
        strategy.close()
    return out
