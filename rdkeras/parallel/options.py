"""What a parallelism is told, as data: frozen options that check themselves when they are made.

``RDMAStrategy(data=DataParallelOptions(...))`` or ``RDMAStrategy(parallelism="model",
pipeline=PipelineOptions(...))``; the strategy's flat keywords build the same objects. A value no model can run
with is refused here, once, saying what to change; what depends on the job (its worker count) is checked by
:meth:`ParallelOptions.check_workers` when the cluster is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PARALLELISMS = ("data", "model", "hybrid")  # (and "pipeline", another name for "model")
MODES = ("allreduce", "ps")  # the data-parallel gradient exchange
SCHEDULES = ("1f1b", "gpipe")  # the pipeline's order of forward and backward passes (rdkeras.pipeline.schedule)
ALGORITHMS = ("auto", "ring", "hierarchical", "doubling")  # the allreduce (rdkeras.parallel.collectives)
COMPRESSIONS = (None, "fp16", "bf16")
SHARDS = (
    "none",
    "optimizer",
    "gradients",
    "parameters",
)  # what each data-parallel worker keeps 1/N of (sharded_optimizer)
AUTO = "auto"  # placement: cut the layers into balanced stages from measured costs


def canonical(parallelism: Any) -> Any:
    """The parallelism's name as rdkeras uses it: "pipeline" is "model" (a pipeline of the model's layers)."""
    return "model" if parallelism == "pipeline" else parallelism


def is_auto(placement: Mapping[str, Any] | str | None) -> bool:
    """Whether `placement` asks for the automatic, cost-balanced cut (None, {} or "auto")."""
    return not placement or placement == AUTO


def _whole(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class DataParallelOptions:
    """Data parallelism: every worker trains the whole model on its rows of each global batch (and, in hybrid
    parallelism, how the pipeline replicas exchange their gradients).

    Args:
        mode: "allreduce" (the gradients averaged by a ring allreduce) or "ps" (parameter servers sharded over
            the workers).
        algorithm: The allreduce: "auto", "ring", "hierarchical" or "doubling" (see
            :class:`rdkeras.parallel.collectives.Collectives`).
        compression: None, "fp16" or "bf16": float32 gradients cross host boundaries as that type.
        compress_within_hosts: Compress inside each host too.
        overlap_bytes: Gradient bucket size for overlapping the exchange with backprop; 0 off, None the
            transport's default.
        sparse_as_dense: An Embedding's sparse gradients allreduced as dense tensors (Horovod's switch).
        shard: "none"; "optimizer": each worker keeps the optimizer state of its 1/N of the parameters (ZeRO
            stage 1); "gradients": and receives only its 1/N of the averaged gradients (stage 2); "parameters": and
            stores only its 1/N of each layer's weights, gathered for each call (stage 3).
    """

    mode: str = "allreduce"
    algorithm: str = "auto"
    compression: str | None = None
    compress_within_hosts: bool = False
    overlap_bytes: int | None = None
    sparse_as_dense: bool = False
    shard: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode (the data-parallel gradient exchange) must be allreduce or ps; got {self.mode!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {self.compression!r}")
        _whole("overlap_bytes", self.overlap_bytes, 0, optional=True)
        if self.shard not in SHARDS:
            raise ValueError(f"shard must be one of {', '.join(SHARDS)}, got {self.shard!r}")
        if self.shard != "none" and self.mode == "ps":
            raise ValueError(
                f"shard={self.shard!r} needs mode='allreduce': parameter servers already keep each variable's "
                "optimizer state on one worker only"
            )
        if self.shard in ("gradients", "parameters") and self.compression:
            raise ValueError(f"shard={self.shard!r} reduce-scatters the gradients uncompressed: set compression=None")
        for name in ("compress_within_hosts", "sparse_as_dense"):
            _flag(name, getattr(self, name))


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Model parallelism: the layers cut into pipeline stages, one worker each, micro-batches in flight.

    Args:
        placement: Layer-name globs -> stage indices (e.g. ``{"block*": 0, "fc*": 1}``), or None / "auto": a
            cut balanced by measured layer costs.
        stages: Workers per pipeline (hybrid with an automatic cut needs it; model parallelism uses all).
        micro_batches: Micro-batches each global batch is split into.
        schedule: "1f1b" or "gpipe".
        defer_weight_gradients: Plain Dense/Conv layers' weight gradients once a step, over every micro-batch.
        alternate_layers: Automatic cut: a layer at a cut may alternate between its two stages by micro-batch.
        split_layers: Automatic cut: a layer at a cut may be split between its two stages by rows.
    """

    placement: Mapping[str, int] | str | None = None
    stages: int | None = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    defer_weight_gradients: bool = True
    alternate_layers: bool = False
    split_layers: bool = False

    def __post_init__(self) -> None:
        placement = self.placement
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be '1f1b' (the default) or 'gpipe', got {self.schedule!r}")
        _whole("micro_batches", self.micro_batches, 1)
        _whole("stages", self.stages, 1, optional=True)
        for name in ("defer_weight_gradients", "alternate_layers", "split_layers"):
            _flag(name, getattr(self, name))
        if isinstance(placement, str) and placement != AUTO:
            raise ValueError(
                f"placement must be layer-name globs -> pipeline stages (e.g. {{'block*': 0, 'fc*': 1}}) or "
                f"{AUTO!r}; got {placement!r}"
            )
        if placement is not None and not isinstance(placement, (str, Mapping)):
            raise ValueError(
                f"placement must be a mapping of layer-name globs to stages or {AUTO!r}; got {placement!r}"
            )
        if isinstance(placement, Mapping):
            for pattern, stage in placement.items():
                if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                    raise ValueError(f"placement[{pattern!r}] must be a stage index >= 0, got {stage!r}")

    @property
    def layout(self) -> dict[str, int] | None:
        """The explicit placement as a dict, or None for the automatic cut."""
        return None if is_auto(self.placement) else dict(self.placement)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """A parallelism and its options: `data` for data parallelism, `pipeline` for model parallelism, both for
    hybrid (replicas of a pipeline, exchanging gradients as `data` says).

    Args:
        parallelism: "data", "model" (or "pipeline") or "hybrid".
        bucket_bytes: Bytes the ring moves per pass.
        global_batch: ``batch_size`` is the global batch, split over the replicas (False: each worker's own).
        data: Data parallelism's options (default ones for data and hybrid).
        pipeline: The pipeline's options (default ones for model and hybrid).
    """

    parallelism: str = "data"
    bucket_bytes: int = 64 << 20
    global_batch: bool = True
    data: DataParallelOptions | None = None
    pipeline: PipelineOptions | None = None

    def __post_init__(self) -> None:
        _whole("bucket_bytes", self.bucket_bytes, 1)
        _flag("global_batch", self.global_batch)
        kind = canonical(self.parallelism)
        if kind not in PARALLELISMS:
            raise ValueError(f"parallelism must be data, pipeline (or model) or hybrid; got {self.parallelism!r}")
        if kind == "data" and self.pipeline is not None and self.pipeline != PipelineOptions():
            what = "a placement is" if self.pipeline.placement else "pipeline options are"
            raise ValueError(f"{what} for parallelism model or hybrid; data parallelism places nothing")
        if kind == "model" and self.data is not None:
            raise ValueError(
                "data-parallel options (mode, algorithm, compression, overlap_bytes, ...) need parallelism 'data' "
                "or 'hybrid'; parallelism='model' runs one pipeline"
            )
        if kind == "hybrid" and self.data is not None:
            extra = [f.name for f in dataclasses.fields(DataParallelOptions)
                     if f.name != "mode" and getattr(self.data, f.name) != f.default]  # fmt: skip
            if extra:
                raise ValueError(f"{', '.join(extra)}: parallelism='data' only (hybrid's replicas take mode alone)")
        if kind == "hybrid" and is_auto(self.pipeline.placement if self.pipeline else None):
            if self.pipeline is None or self.pipeline.stages is None:
                raise ValueError(
                    "parallelism=hybrid needs a placement (layer-name globs -> pipeline stages, e.g. "
                    "{'block*': 0, 'fc*': 1}) or stages=N (workers per pipeline) to cut the model into N stages "
                    "balanced by measured layer costs (placement=None or 'auto')"
                )

    def resolved(self) -> ParallelOptions:
        """These options as the strategy runs them: the parallelism by its canonical name ("pipeline" is
        "model"), and the default options of a part it runs and was not given."""
        kind = canonical(self.parallelism)
        return dataclasses.replace(
            self,
            parallelism=kind,
            data=self.data or (DataParallelOptions() if kind != "model" else None),
            pipeline=self.pipeline or (PipelineOptions() if kind != "data" else None),
        )

    @property
    def stages(self) -> int | None:
        """Workers per pipeline: given, or one more than the placement's last stage; None for data parallelism
        (and for model parallelism's automatic cut, which takes every worker)."""
        if self.pipeline is None or self.pipeline.stages is not None:
            return None if self.pipeline is None else self.pipeline.stages
        layout = self.pipeline.layout
        return None if layout is None else max(layout.values()) + 1

    def check_workers(self, workers: int) -> None:
        """Raises ValueError where these options cannot run on `workers` workers, saying what to change."""
        kind, pipeline = canonical(self.parallelism), self.pipeline
        if kind == "data":
            return
        pipeline = pipeline or PipelineOptions()
        layout, stages = pipeline.layout, pipeline.stages
        if layout is None:
            if stages is not None and (stages != workers if kind == "model" else workers % stages):
                fit = (
                    "model parallelism runs one pipeline over all of them"
                    if kind == "model"
                    else f"hybrid runs replicas of a {stages}-stage pipeline: use a multiple of {stages} workers"
                )
                raise ValueError(f"stages={stages} does not fit {workers} workers: {fit}")
            return
        placed = max(layout.values()) + 1  # the stages the placement names
        if kind == "model" and placed > workers:
            pattern = max(layout, key=lambda p: layout[p])
            raise ValueError(
                f"placement[{pattern!r}] = {layout[pattern]}, but there are only {workers} workers "
                f"(stages 0..{workers - 1}): add workers or change the placement"
            )
        if kind == "model" and stages not in (None, workers):
            raise ValueError(f"parallelism='model' runs one {workers}-stage pipeline; stages={stages}")
        if kind == "hybrid" and workers % placed:
            raise ValueError(
                f"{workers} workers cannot run replicas of a {placed}-stage pipeline: use a multiple of {placed}"
            )


def from_flat(parallelism: str = "data", mode: str | None = None, **fields: Any) -> ParallelOptions:
    """:class:`ParallelOptions` from one flat mapping of every field by name -- RDMAStrategy's keywords, and the
    train app's ``parallel`` config group (whose ``_target_`` this is). A parallelism's own options are made
    where it takes them, or where one of them differs from its default (which ParallelOptions then refuses,
    naming it). `mode` None: "allreduce" (RDMAStrategy gives ``RDKERAS_DATA_MODE``'s)."""
    data_fields = {f.name: f.default for f in dataclasses.fields(DataParallelOptions)}
    pipeline_fields = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    top = {k: fields.pop(k) for k in ("bucket_bytes", "global_batch") if k in fields}
    unknown = sorted(set(fields) - set(data_fields) - set(pipeline_fields))
    if unknown:
        raise ValueError(f"unknown parallel option(s) {', '.join(unknown)}")
    kind = canonical(parallelism)
    data = {k: v for k, v in fields.items() if k in data_fields and v != data_fields[k]}
    pipeline = {k: v for k, v in fields.items() if k in pipeline_fields and v != pipeline_fields[k]}
    return ParallelOptions(
        parallelism,
        **top,
        data=DataParallelOptions(mode=mode or "allreduce", **data) if kind != "model" or data else None,
        pipeline=PipelineOptions(**pipeline) if kind != "data" or pipeline else None,
    )
