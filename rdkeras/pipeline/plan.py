"""A pipeline plan, as data: where each layer runs, the order of the stages, and every tensor that crosses
stages (:class:`Edge`), with what the step's schedule keeps. :mod:`rdkeras.pipeline.planner` makes one, whole;
nothing changes it afterwards (the stages, :mod:`rdkeras.pipeline.stages`, and the schedule,
:mod:`rdkeras.pipeline.schedule`, read it), as a Keras layout is data its users read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rdkeras.pipeline.cut.partition import Partition

READER = 0


def frozen(mapping: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    """A read-only copy of `mapping` (its list values as tuples)."""
    return MappingProxyType({k: tuple(v) if isinstance(v, list) else v for k, v in (mapping or {}).items()})


@dataclass(frozen=True)
class Edge:
    """One tensor crossing from stage `src` to stage `dst` each step (and its gradient back)."""

    name: str  # unique, stable across stages: producer layer / tensor index -> dst
    producer: str  # layer name, or "input:<name>", "labels[i]", "sample_weight[i]"
    consumers: tuple[str, ...]  # layer names on dst (or "loss")
    src: int
    dst: int
    shape: tuple[int | None, ...]  # with the batch dimension substituted where known
    dtype: str
    kind: str  # "activation" | "input" | "labels" | "sample_weight" | "output"
    needs_grad: bool  # a gradient flows back dst -> src
    static: bool
    reason: str
    tensor: Any = field(default=None, compare=False, repr=False)  # the KerasTensor (None for labels)
    transfers: int = 1  # per step: one per micro-batch (labels and sample weights: one, the whole batch)

    @property
    def bytes_per_transfer(self) -> int | None:
        """Bytes of one forward transfer (None when a dimension is unknown)."""
        dims = [d for d in self.shape if d is not None]
        if len(dims) < len(self.shape):
            return None
        return int(np.prod(dims, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def transfer(self) -> str:
        """ "static" (a pre-registered destination, written one-sidedly) or "dynamic" (metadata, then a read)."""
        return "static" if self.static else "dynamic"

    @property
    def bytes_per_step(self) -> int | None:
        """Bytes sent forward per step, all micro-batches (None when a dimension is unknown);
        a gradient adds as much again."""
        one = self.bytes_per_transfer
        return None if one is None else one * self.transfers


@dataclass(frozen=True)
class PipelinePlan:
    """Where each layer runs and what crosses the wire; identical on every worker, and never changed once made
    (:func:`rdkeras.pipeline.planner.make_plan`)."""

    model_name: str
    stages: int
    layer_stage: Mapping[str, int]  # every non-input layer -> its stage
    stage_order: tuple[int, ...]  # stages in pipeline (topological) order
    loss_stage: int
    edges: tuple[Edge, ...]
    batch_size: int | None
    micro_batches: int = 1
    replicas: int = 1  # hybrid: copies of this pipeline, data-parallel among them
    partition: Partition | None = None  # the automatic cut that made layer_stage
    # Per stage: bytes of the activations one micro-batch's forward pass produces (what its backward needs
    # kept: the layers' outputs), when the batch is known.
    activation_bytes: Mapping[int, int] = field(default_factory=frozen)
    schedule: str = "gpipe"
    stashed: Mapping[int, int] = field(default_factory=frozen)  # per stage: most micro-batches stashed at once
    # Per stage: Dense layers whose weight gradients it computes once a step over every micro-batch's rows
    # (keeping each one's inputs and output gradients until then: deferred_bytes).
    deferred: Mapping[int, tuple[str, ...]] = field(default_factory=frozen)
    deferred_bytes: Mapping[int, int] = field(default_factory=frozen)
    # Where the automatic cut alternates layers between stages: the plans that differ from this one in those
    # layers' stages and the edges around them, and per micro-batch the plan it follows (0: this one, i:
    # variants[i - 1]); empty: this plan for every micro-batch.
    variants: tuple[PipelinePlan, ...] = field(default=(), repr=False, compare=False)
    micro_variant: tuple[int, ...] = ()
    # The model this plan places: the user's, or a split model over its layers (rdkeras.pipeline.cut.split).
    model: Any = field(default=None, repr=False, compare=False)

    @property
    def micro_plans(self) -> tuple[PipelinePlan, ...]:
        """Each micro-batch's plan where layers alternate (this one or a variant); empty: this one for all."""
        plans = (self, *self.variants)
        return tuple(plans[i] for i in self.micro_variant)

    @property
    def group(self) -> int:
        """1F1B's unit of micro-batches: 2 where layers alternate between stages (a turn of each per unit)."""
        return 2 if self.variants else 1

    def layers_of(self, stage: int) -> list[str]:
        return [name for name, s in self.layer_stage.items() if s == stage]

    def deferred_of(self, stage: int) -> list[str]:
        """The layers whose weight gradients `stage` computes once a step, over every micro-batch's plan (a layer
        that alternates defers on both of its stages)."""
        return list(dict.fromkeys(n for p in [self, *self.micro_plans] for n in p.deferred.get(stage, [])))

    def text(self) -> str:
        """The plan as a table (printed once at startup, saved with the TensorBoard logs)."""
        batch = "unknown (dynamic)" if self.batch_size is None else str(self.batch_size)
        lines = [
            f"model-parallel plan for {self.model_name!r}: {self.stages} stages"
            + (f" x {self.replicas} replicas" if self.replicas > 1 else "")
            + f", batch {batch}, {self.micro_batches} micro-batch(es); pipeline "
            + " -> ".join(str(s) for s in self.stage_order)
            + f"; loss on stage {self.loss_stage}"
        ]
        if self.partition is not None:
            lines.append(self.partition.text(self.micro_batches))
        if self.stashed:
            peak = "; ".join(
                f"stage {s} {self.stashed[s]}"
                + (f" ({_human(self.stashed[s] * self.activation_bytes[s])})" if s in self.activation_bytes else "")
                for s in self.stage_order
            )
            lines.append(f"  schedule {self.schedule}: micro-batches' activations stashed at most: {peak}")
        plans = [self, *self.micro_plans]
        deferred = {s: self.deferred_of(s) for s in self.stage_order}
        if any(deferred.values()):
            kept = "; ".join(
                f"stage {s} {', '.join(deferred[s])} (keeps {_human(max(p.deferred_bytes.get(s, 0) for p in plans))})"
                for s in self.stage_order
                if deferred[s]
            )
            lines.append(f"  weight gradients once a step, over all micro-batches: {kept}")
        for s in self.stage_order:
            names = self.layers_of(s)
            shown = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, ..., {', '.join(names[-2:])}"
            lines.append(f"  stage {s}: {len(names)} layers: {shown}")
        header = ("edge", "src->dst", "shape (per transfer)", "dtype", "bytes/step", "grad", "transfer", "reason")
        # (edge, its share of the micro-batches, which ones): where micro-batches follow different plans, an edge
        # carries only those whose plan has it.
        edges = [(e, 1.0, "") for e in self.edges]
        if self.micro_plans:
            count: dict[str, tuple[Edge, int]] = {}
            for p in self.micro_plans:
                for e in p.edges:
                    count[e.name] = (e, count.get(e.name, (e, 0))[1] + 1)
            whole = len(self.micro_plans)
            edges = [
                (e, k / whole, "" if k == whole else f" ({k} of {whole} micro-batches)") for e, k in count.values()
            ]
        rows = [
            (
                f"{e.producer} -> {','.join(e.consumers)}",
                f"{e.src}->{e.dst}",
                "(" + ", ".join("?" if d is None else str(d) for d in e.shape) + ")",
                e.dtype,
                "?" if e.bytes_per_step is None else _human(e.bytes_per_step * share),
                "yes" if e.needs_grad else "no",
                e.transfer,
                e.reason + which,
            )
            for e, share, which in edges
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        known = [(e.bytes_per_step or 0) * share * (2 if e.needs_grad else 1) for e, share, _ in edges]
        total = sum(known)
        dynamic = " + the dynamic edges, sized per step" if any(e.bytes_per_step is None for e, _, _ in edges) else ""
        lines.append(f"  {len(edges)} edges; {_human(total)}{dynamic} per step over the wire (with gradients)")
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
