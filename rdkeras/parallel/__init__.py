"""How a compiled Keras model is spread over workers: data, model (pipeline) and hybrid parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PARALLELISMS = ("data", "model", "hybrid")  # (and "pipeline", another name for "model")
MODES = ("allreduce", "ps")  # the data-parallel gradient exchange
SCHEDULES = ("1f1b", "gpipe")  # the pipeline's order of forward and backward passes (rdkeras.parallel.schedule)
AUTO = "auto"  # placement: cut the layers into balanced stages from measured costs


def canonical(parallelism: Any) -> Any:
    """The parallelism's name as rdkeras uses it: "pipeline" is "model" (a pipeline of the model's layers)."""
    return "model" if parallelism == "pipeline" else parallelism


def is_auto(placement: Mapping[str, Any] | str | None) -> bool:
    """Whether `placement` asks for the automatic, cost-balanced cut (None, {} or "auto")."""
    return not placement or placement == AUTO


def check_settings(
    parallelism: str,
    mode: str | None = "allreduce",
    placement: Mapping[str, Any] | str | None = None,
    micro_batches: Any = 1,
    workers: int | None = None,
    stages: Any = None,
    schedule: Any = "1f1b",
) -> None:
    """Raises ValueError, saying what to change, for settings no model can run with. The one check
    RDMAStrategy and the training app's config share (the analyzer checks a placement against a model)."""
    parallelism = canonical(parallelism)
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism must be data, pipeline (or model) or hybrid; got {parallelism!r}")
    if parallelism in ("data", "hybrid") and mode not in MODES:
        raise ValueError(f"mode (the data-parallel gradient exchange) must be allreduce or ps; got {mode!r}")
    if parallelism == "data":
        if placement:
            raise ValueError("a placement is for parallelism model or hybrid; data parallelism places nothing")
        return
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be '1f1b' (the default) or 'gpipe', got {schedule!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a whole number >= 1, got {micro_batches!r}")
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise ValueError(f"stages must be a whole number >= 1, got {stages!r}")
    if isinstance(placement, str) and placement != AUTO:
        raise ValueError(
            f"placement must be layer-name globs -> pipeline stages (e.g. {{'block*': 0, 'fc*': 1}}) or "
            f"{AUTO!r}; got {placement!r}"
        )
    if is_auto(placement):
        # The cut is chosen from measured layer costs when the model is attached, into as many stages as
        # model parallelism has workers; hybrid must be told how many workers each pipeline takes.
        if stages is None and parallelism == "hybrid":
            raise ValueError(
                "parallelism=hybrid needs a placement (layer-name globs -> pipeline stages, e.g. "
                "{'block*': 0, 'fc*': 1}) or stages=N (workers per pipeline) to cut the model into N stages "
                "balanced by measured layer costs (placement=None or 'auto')"
            )
        if stages is None or workers is None:
            return
        if stages != workers if parallelism == "model" else workers % stages:
            fit = (
                "model parallelism runs one pipeline over all of them"
                if parallelism == "model"
                else f"hybrid runs replicas of a {stages}-stage pipeline: use a multiple of {stages} workers"
            )
            raise ValueError(f"stages={stages} does not fit {workers} workers: {fit}")
        return
    assert isinstance(placement, Mapping)
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
