"""Workers for the overlap tests in tests/multiproc/test_data_parallel.py: data-parallel fit with the gradient
exchange in buckets."""

from __future__ import annotations

from tests.ranks.keras_workers import fit_in_turn


def fit_bucketed_many(configs: list, batch: int) -> dict:
    """For each (kind, mode, overlap_bytes): fit with RDMAStrategy(overlap_bytes=...), in this one
    set of processes; also the writes the engine made, and the exchange threads still running once every strategy
    closed. Then rank 0 trains each kind in one plain process."""
    import threading

    import rdkeras

    def start(config):
        kind, mode, overlap = config
        # The ring at every size (auto would send these small gradients by recursive doubling): one ring per bucket.
        strategy = rdkeras.RDMAStrategy(mode=mode, overlap_bytes=overlap, algorithm="ring")
        return f"{kind}/{mode}/{overlap}", kind, strategy

    def writes(strategy, before):
        return {"writes": strategy.engine.traffic()["writes"] - before["writes"]}

    out = fit_in_turn(configs, batch, start, "bucketed", writes)
    out["threads left"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("rdkeras-"))
    return out
