"""How a compiled Keras model is spread over workers: data, model (pipeline) and hybrid parallelism."""

from __future__ import annotations

from typing import Any

from rdkeras.parallel.options import (
    AUTO,
    MODES,
    PARALLELISMS,
    SCHEDULES,
    DataParallelOptions,
    ParallelOptions,
    PipelineOptions,
    canonical,
    from_flat,
    is_auto,
)

__all__ = ["AUTO", "MODES", "PARALLELISMS", "SCHEDULES", "DataParallelOptions", "ParallelOptions",
           "PipelineOptions", "canonical", "check_settings", "is_auto"]  # fmt: skip


def check_settings(parallelism: str = "data", workers: int | None = None, **settings: Any) -> ParallelOptions:
    """The options of flat `settings` (the training app's ``parallel`` group), checked as RDMAStrategy checks its
    keywords (:func:`from_flat`), and against `workers` where given: ValueError, saying what to change."""
    options = from_flat(parallelism, **settings)
    if workers is not None:
        options.check_workers(workers)
    return options
