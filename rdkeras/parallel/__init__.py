"""How a compiled Keras model is spread over workers: data, model (pipeline) and hybrid parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARALLELISMS = ("data", "model", "hybrid")
MODES = ("allreduce", "ps")  # the data-parallel gradient exchange


def check_settings(
    parallelism: str,
    mode: str | None = "allreduce",
    placement: Mapping[str, Any] | None = None,
    micro_batches: Any = 1,
    workers: int | None = None,
) -> None:
    """Raises ValueError, saying what to change, for settings no model can run with. The one check
    RDMAStrategy and the training app's config share (the analyzer checks a placement against a model)."""
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism must be data, model or hybrid; got {parallelism!r}")
    if parallelism in ("data", "hybrid") and mode not in MODES:
        raise ValueError(f"mode (the data-parallel gradient exchange) must be allreduce or ps; got {mode!r}")
    if parallelism == "data":
        if placement:
            raise ValueError("a placement is for parallelism model or hybrid; data parallelism places nothing")
        return
    if not placement:
        raise ValueError(
            f"parallelism={parallelism} needs a placement: layer-name globs -> pipeline stages, "
            "e.g. {'block*': 0, 'fc*': 1}"
        )
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}")
    for pattern, stage in placement.items():
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise ValueError(f"placement[{pattern!r}] must be a stage index >= 0, got {stage!r}")
    stages = max(placement.values()) + 1
    if workers is None:
        return
    if parallelism == "model" and stages > workers:
        pattern = max(placement, key=lambda p: placement[p])
        raise ValueError(
            f"placement[{pattern!r}] = {placement[pattern]}, but there are only {workers} workers "
            f"(stages 0..{workers - 1}): add workers or change the placement"
        )
    if parallelism == "hybrid" and workers % stages:
        raise ValueError(
            f"{workers} workers cannot run replicas of a {stages}-stage pipeline: use a multiple of {stages}"
        )
