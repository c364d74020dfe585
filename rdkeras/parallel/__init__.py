"""How a compiled Keras model is spread over workers: data, model (pipeline) and hybrid parallelism."""

from __future__ import annotations

from collections.abc import Mapping
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
    is_auto,
)

__all__ = ["AUTO", "MODES", "PARALLELISMS", "SCHEDULES", "DataParallelOptions", "ParallelOptions",
           "PipelineOptions", "canonical", "check_settings", "is_auto"]  # fmt: skip


def check_settings(
    parallelism: str,
    mode: str | None = "allreduce",
    placement: Mapping[str, Any] | str | None = None,
    micro_batches: Any = 1,
    workers: int | None = None,
    stages: Any = None,
    schedule: Any = "1f1b",
) -> None:
    """Raises ValueError, saying what to change, for settings no model can run with (on `workers` workers,
    where given): the options' own checks, for the training app's flat config."""
    kind = canonical(parallelism)
    if kind not in PARALLELISMS:
        raise ValueError(f"parallelism must be data, pipeline (or model) or hybrid; got {parallelism!r}")
    data = DataParallelOptions(mode=mode) if kind in ("data", "hybrid") else None  # type: ignore[arg-type]
    pipeline = None
    if kind != "data" or placement:
        pipeline = PipelineOptions(placement, stages, micro_batches, schedule)
    options = ParallelOptions(kind, data=data, pipeline=pipeline)
    if workers is not None:
        options.check_workers(workers)
