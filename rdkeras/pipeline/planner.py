"""The graph analyzer: which stage runs each layer, and every tensor that crosses stages.

Input: a built Functional (or Sequential) Keras model and a placement, layer-name
glob -> stage, e.g. ``{"block*": 0, "fc*": 1, "predictions": 1}``.
Output: a :class:`Plan` -- the stage of every layer, the order of the stages, and
one :class:`Edge` per (tensor, consuming stage) pair whose producer lives on
another stage, each marked **static** (shape fully known once the batch size is:
the receiver pre-allocates the destination) or **dynamic** (a dimension is only
known at run time: the receiver allocates per step and reads).

Rules, in the order they apply:
- a layer named exactly by a key is placed there; otherwise the first glob (in
  the placement's order) that matches its name wins;
- an unplaced layer follows the producer of its first input (stage 0 when it
  reads only model inputs);
- model inputs are read by one stage, the *reader* (stage 0), and sent to every
  other stage that consumes them; labels and sample weights go straight from
  the reader to the *loss stage* (the one that owns the model's outputs), never
  through the stages in between, the whole batch once a step (the loss stage
  splits them into micro-batches);
- every pattern must match a layer, every stage must own a layer, and the
  stages must form a pipeline without cycles -- otherwise a ValueError says
  what is wrong before any process waits on another.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdkeras.keras_internals import functional_of, nodes_in_order, producer_of
from rdkeras.pipeline.cut.split import part_rows, rows_of_part

READER = 0


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


@dataclass
class Plan:
    """Where each layer runs and what crosses the wire; identical on every worker."""

    model_name: str
    stages: int
    layer_stage: dict[str, int]  # every non-input layer -> its stage
    stage_order: list[int]  # stages in pipeline (topological) order
    loss_stage: int
    edges: list[Edge]
    batch_size: int | None
    micro_batches: int = 1
    replicas: int = 1  # hybrid: copies of this pipeline, data-parallel among them
    partition: Any = None  # the automatic cut (rdkeras.pipeline.cut.partition.Partition) that made layer_stage
    # Per stage: bytes of the activations one micro-batch's forward pass produces (what its backward needs
    # kept: the layers' outputs), when the batch is known.
    activation_bytes: dict[int, int] = field(default_factory=dict)
    schedule: str = "gpipe"
    stashed: dict[int, int] = field(default_factory=dict)  # per stage: most micro-batches stashed at once
    # Per stage: Dense layers whose weight gradients it computes once a step over every micro-batch's rows
    # (keeping each one's inputs and output gradients until then: deferred_bytes).
    deferred: dict[int, list[str]] = field(default_factory=dict)
    deferred_bytes: dict[int, int] = field(default_factory=dict)
    # Where the automatic cut alternates layers between stages: each micro-batch's plan (this one, or one that
    # differs in those layers' stages and the edges around them); empty: this plan for every micro-batch.
    micro_plans: list[Plan] = field(default_factory=list, repr=False, compare=False)
    # The model this plan places: the user's, or a split model over its layers (rdkeras.pipeline.cut.split).
    model: Any = field(default=None, repr=False, compare=False)

    @property
    def group(self) -> int:
        """1F1B's unit of micro-batches: 2 where layers alternate between stages (a turn of each per unit)."""
        return 2 if any(p is not self for p in self.micro_plans) else 1

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


def assign_layers(model: Any, placement: Mapping[str, int], stages: int) -> dict[str, int]:
    """Maps every (non-input) layer of `model` to a stage; raises ValueError on a bad placement."""
    graph = functional_of(model)
    if stages < 1:
        raise ValueError(f"model parallelism needs at least one stage, got {stages}")
    if not placement:
        raise ValueError("placement is empty: map layer-name patterns to stages, e.g. {'conv*': 0, 'fc*': 1}")
    for pattern, where in placement.items():
        if not isinstance(where, (int, np.integer)) or isinstance(where, bool) or not 0 <= where < stages:
            raise ValueError(
                f"placement {pattern!r}: {where!r} is not a stage index in 0..{stages - 1} "
                f"(this job has {stages} pipeline stages)"
            )
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]
    layers = []
    for n in nodes:
        if n.operation.name not in layers:
            layers.append(n.operation.name)
    unmatched = [p for p in placement if not any(fnmatch.fnmatchcase(name, p) for name in layers)]
    if unmatched:
        raise ValueError(
            f"placement pattern(s) {', '.join(repr(p) for p in unmatched)} match no layer of model "
            f"{model.name!r}; its layers are: {', '.join(layers)}"
        )
    stage: dict[str, int] = {}
    for name in layers:
        if name in placement:
            stage[name] = int(placement[name])
            continue
        for pattern, where in placement.items():
            if fnmatch.fnmatchcase(name, pattern):
                stage[name] = int(where)
                break
    for n in nodes:  # producers come first, so a follower's producer is already placed
        name = n.operation.name
        if name not in stage:
            producers = [producer_of(t)[0] for t in n.input_tensors]
            placed = [stage[p.name] for p in producers if p.name in stage]
            stage[name] = placed[0] if placed else READER
    empty = sorted(set(range(stages)) - set(stage.values()))
    if empty:
        raise ValueError(
            f"stage(s) {', '.join(map(str, empty))} would own no layer of model {model.name!r}: "
            f"every one of the {stages} stages needs at least one (placement: {dict(placement)})"
        )
    return stage


def _producer_stage(tensor: Any, stage: Mapping[str, int]) -> int | None:
    op = producer_of(tensor)[0]
    return stage.get(op.name)  # None: a model input


def _trainable_ancestry(graph: Any) -> dict[int, bool]:
    """id(tensor) -> whether any trainable weight influences it."""
    influenced: dict[int, bool] = {}
    for n in nodes_in_order(graph):
        if n.is_input:
            for t in n.output_tensors:
                influenced[id(t)] = False
            continue
        upstream = any(influenced.get(id(t), False) for t in n.input_tensors)
        own = bool(getattr(n.operation, "trainable_weights", []))
        for t in n.output_tensors:
            influenced[id(t)] = upstream or own
    return influenced


def _spec(shape: tuple, batch_size: int | None, what: str) -> tuple[tuple, bool, str]:
    full = (batch_size, *shape[1:]) if shape and shape[0] is None else tuple(shape)
    unknown = [i for i, d in enumerate(full) if d is None]
    if not unknown:
        return full, True, "shape fully known"
    if unknown == [0] and shape and shape[0] is None:
        return full, False, "batch size varies (a partial last batch): use drop_remainder=True for static"
    dims = ", ".join(str(i) for i in unknown if i)
    return full, False, f"{what} dimension {dims} known only at run time (variable length)"


def _is_float(dtype: str) -> bool:
    return np.dtype(dtype).kind == "f" if dtype != "bfloat16" else True


def analyze(
    model: Any,
    placement: Mapping[str, int],
    stages: int,
    batch_size: int | None = None,
    micro_batches: int = 1,
    label_specs: list[tuple[tuple, str]] | None = None,
    sample_weight_specs: list[tuple[tuple, str]] | None = None,
) -> Plan:
    """Places `model`'s layers on `stages` stages and finds every cut edge.

    Args:
        batch_size: the per-step batch, when every batch has it (else the batch
            dimension makes edges dynamic). With micro-batching, edges carry
            ``batch_size / micro_batches`` rows.
        label_specs / sample_weight_specs: (shape with batch first, dtype) of each
            label / sample-weight tensor, when known (they travel reader -> loss stage).
    """
    graph = functional_of(model)
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    rows = None
    if batch_size is not None:
        if batch_size % micro_batches:
            raise ValueError(
                f"batch size {batch_size} does not split into {micro_batches} equal micro-batches: "
                "choose a batch size divisible by micro_batches"
            )
        rows = batch_size // micro_batches
    stage = assign_layers(model, placement, stages)
    influenced = _trainable_ancestry(graph)
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]

    # Output tensors of the model: the loss stage owns the last of them in pipeline order.
    outputs = list(graph.outputs)
    output_stages = [_producer_stage(t, stage) for t in outputs]

    # Consumers per (tensor, stage), in graph order.
    consumers: dict[tuple[int, int], list[str]] = {}
    tensors: dict[int, Any] = {}
    for n in nodes:
        dst = stage[n.operation.name]
        for t in n.input_tensors:
            src = _producer_stage(t, stage)
            if src is None:
                src = READER
                if dst == READER:
                    continue  # the reader feeds its own layers directly
            elif src == dst:
                continue
            key = (id(t), dst)
            tensors[id(t)] = t
            names = consumers.setdefault(key, [])
            if n.operation.name not in names:
                names.append(n.operation.name)

    # Stage order: topological over activation edges (data edges from the reader are
    # sent before anything else each step, so they cannot form a cycle).
    succ: dict[int, set[int]] = {s: set() for s in range(stages)}
    for tid, dst in consumers:
        src = _producer_stage(tensors[tid], stage)
        if src is not None:
            succ[src].add(dst)
    order = _topological(succ, stage, consumers, tensors)
    loss_stage = max((s for s in output_stages if s is not None), key=order.index, default=READER)

    edges: list[Edge] = []
    parts = part_rows(model)  # (a split model's: rdkeras.pipeline.cut.split)

    def add(
        name: str,
        producer: str,
        consumers: tuple,
        src: int,
        dst: int,
        shape: tuple,
        dtype: str,
        kind: str,
        needs_grad: bool,
        tensor: Any = None,
        note: str = "",
        transfers: int = micro_batches,
    ) -> None:
        batch = None if batch_size is None else batch_size // transfers  # the rows each transfer carries
        if batch is not None and tensor is not None and id(tensor) in parts:  # one part of a layer's rows
            batch = rows_of_part(batch, parts[id(tensor)])
        full, static, reason = _spec(shape, batch, "tensor" if kind in ("activation", "input") else kind)
        edges.append(
            Edge(
                name,
                producer,
                consumers,
                src,
                dst,
                full,
                dtype,
                kind,
                needs_grad,
                static,
                reason + note,
                tensor,
                transfers=transfers,
            )
        )

    def trained(t: Any) -> bool:  # a gradient flows back through t
        return _is_float(str(t.dtype)) and influenced.get(id(t), False)

    for (tid, dst), names in consumers.items():
        t = tensors[tid]
        src = _producer_stage(t, stage)
        op = producer_of(t)[0]
        if src is None:
            producer, kind, src = f"input:{op.name}", "input", READER
        else:
            producer, kind = f"{op.name}:{producer_of(t)[1]}", "activation"
        add(
            f"{producer}->{dst}",
            producer,
            tuple(names),
            src,
            dst,
            tuple(t.shape),
            str(t.dtype),
            kind,
            kind == "activation" and trained(t),
            t,
        )
    # Model outputs produced away from the loss stage travel there too.
    for i, (t, s) in enumerate(zip(outputs, output_stages, strict=True)):
        s = READER if s is None else s
        if s != loss_stage and (id(t), loss_stage) not in consumers:
            producer = f"{producer_of(t)[0].name}:{producer_of(t)[1]}"
            add(
                f"output[{i}]->{loss_stage}",
                producer,
                ("loss",),
                s,
                loss_stage,
                tuple(t.shape),
                str(t.dtype),
                "output",
                trained(t),
                t,
            )
    if loss_stage != READER:
        for kind, specs in (("labels", label_specs), ("sample_weight", sample_weight_specs)):
            for i, (shape, dtype) in enumerate(specs or []):
                add(
                    f"{kind}[{i}]->{loss_stage}",
                    f"{kind}[{i}]",
                    ("loss",),
                    READER,
                    loss_stage,
                    (None, *tuple(shape)[1:]),
                    str(np.dtype(dtype)),
                    kind,
                    False,
                    note=" (straight from the reader to the loss stage, once a step)",
                    transfers=1,  # the loss stage splits them: M-1 fewer hops on both ends
                )
    activation_bytes: dict[int, int] = {}
    if rows is not None:
        for n in nodes:
            s = stage[n.operation.name]
            for t in n.output_tensors:
                shape = (rows_of_part(rows, parts[id(t)]) if id(t) in parts else rows, *(d or 0 for d in t.shape[1:]))
                activation_bytes[s] = activation_bytes.get(s, 0) + int(np.prod(shape)) * np.dtype(str(t.dtype)).itemsize
    return Plan(
        model_name=model.name,
        stages=stages,
        layer_stage=stage,
        stage_order=order,
        loss_stage=loss_stage,
        edges=edges,
        batch_size=batch_size,
        micro_batches=micro_batches,
        activation_bytes=activation_bytes,
        model=model,
    )


def _topological(succ: dict[int, set[int]], stage: Mapping[str, int], consumers: dict, tensors: dict) -> list[int]:
    indegree = {s: 0 for s in succ}
    for outs in succ.values():
        for d in outs:
            indegree[d] += 1
    ready = sorted(s for s, d in indegree.items() if d == 0)
    order: list[int] = []
    while ready:
        s = ready.pop(0)
        order.append(s)
        for d in sorted(succ[s]):
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append(d)
        ready.sort()
    if len(order) < len(succ):
        stuck = sorted(set(succ) - set(order))
        crossing = []
        for (tid, dst), names in consumers.items():
            src = _producer_stage(tensors[tid], stage)
            if src in stuck and dst in stuck:
                op = producer_of(tensors[tid])[0]
                crossing.append(f"{op.name} (stage {src}) -> {names[0]} (stage {dst})")
        raise ValueError(
            f"placement makes a cycle between stages {', '.join(map(str, stuck))}: "
            f"{'; '.join(crossing[:4])}. A pipeline needs tensors to flow one way: "
            "move those layers so that each stage only feeds later ones"
        )
    return order
