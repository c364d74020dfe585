"""Workers for tests/multiproc/test_overlap.py: data-parallel fit with the gradient exchange in buckets."""

from __future__ import annotations

from tests.multiproc.keras_workers import _data, _model


def fit_bucketed(kind: str, batch: int, mode: str, overlap_bytes: int, epochs: int = 2) -> dict:
    """fit_model with rdkeras.parallel.collectives.OVERLAP_BYTES set; also what the engine moved."""
    import keras

    import rdkeras
    from rdkeras.parallel import collectives

    collectives.OVERLAP_BYTES = overlap_bytes
    x, y = _data(kind)
    strategy = rdkeras.RDMAStrategy(mode=mode)
    with strategy.scope():
        model = _model(kind, seed=100 + strategy.worker_index)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    before = strategy.engine.traffic()
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    after = strategy.engine.traffic()
    results = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    out = {
        "weights": [w.tolist() for w in model.get_weights()],
        "evaluate": results,
        "writes": after["writes"] - before["writes"],
    }
    strategy.close()
    return out
