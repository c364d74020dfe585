"""Workers for tests/multiproc/test_overlap.py: data-parallel fit with the gradient exchange in buckets."""

from __future__ import annotations

from tests.multiproc.keras_workers import _fit_model_with, next_port


def fit_bucketed_many(configs: list, batch: int) -> dict:
    """For each (kind, mode, overlap_bytes): fit with rdkeras.parallel.collectives.OVERLAP_BYTES set, in this one
    set of processes; also the bytes the engine wrote. Then rank 0 trains each kind in one plain process."""
    import rdkeras
    from rdkeras.parallel import collectives

    out, rank = {}, 0
    for i, (kind, mode, overlap) in enumerate(configs):
        collectives.OVERLAP_BYTES = overlap
        strategy = rdkeras.RDMAStrategy(mode=mode)
        before = strategy.engine.traffic()["writes"]
        result = _fit_model_with(strategy, kind, batch)
        result["writes"] = strategy.engine.traffic()["writes"] - before
        out[f"{kind}/{mode}/{overlap}"] = result
        if i + 1 < len(configs):
            next_port(strategy, f"bucketed{i}")
        rank = strategy.worker_index
        strategy.close()
    if rank == 0:
        for kind in sorted({c[0] for c in configs}):
            out[f"{kind}/reference"] = _fit_model_with(None, kind, batch)
    return out
