"""The planner: a model and a placement in, one whole :class:`~rdkeras.pipeline.plan.PipelinePlan` out.

Input: a built Functional (or Sequential) Keras model and a placement, layer-name
glob -> stage, e.g. ``{"block*": 0, "fc*": 1, "predictions": 1}`` (the rules:
:mod:`rdkeras.pipeline.placement`), or an automatic cut's.
Output: the plan -- the stage of every layer, the order of the stages, and
one :class:`~rdkeras.pipeline.plan.Edge` per (tensor, consuming stage) pair whose
producer lives on another stage, each marked **static** (shape fully known once
the batch size is: the receiver pre-allocates the destination) or **dynamic** (a
dimension is only known at run time: the receiver allocates per step and reads);
then (:func:`make_plan`) each micro-batch's plan where layers alternate, the
micro-batches the schedule stashes and the layers whose weight gradients wait
for the step's end. Nothing changes a plan once made.

Model inputs are read by one stage, the *reader* (stage 0), and sent to every
other stage that consumes them; labels and sample weights go straight from the
reader to the *loss stage* (the one that owns the model's outputs), never
through the stages in between, the whole batch once a step (the loss stage
splits them into micro-batches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rdkeras.keras_internals import functional_of, nodes_in_order, producer_of
from rdkeras.pipeline.cut.partition import Partition
from rdkeras.pipeline.cut.split import part_rows, rows_of_part
from rdkeras.pipeline.deferred import deferrable
from rdkeras.pipeline.placement import assign_layers, producer_stage, topological
from rdkeras.pipeline.plan import READER, Edge, PipelinePlan, frozen


def micro_rows(batch_size: int | None, micro_batches: int) -> int | None:
    """The rows of each micro-batch of a batch of `batch_size` (None: unknown); ValueError where they differ."""
    if batch_size is None:
        return None
    if batch_size % micro_batches:
        raise ValueError(
            f"batch size {batch_size} does not split into {micro_batches} equal micro-batches: "
            "choose a batch size divisible by micro_batches"
        )
    return batch_size // micro_batches


def make_plan(
    model: Any,
    placement: Mapping[str, int],
    stages: int,
    batch_size: int | None = None,
    micro_batches: int = 1,
    label_specs: list[tuple[tuple, str]] | None = None,
    sample_weight_specs: list[tuple[tuple, str]] | None = None,
    *,
    partition: Partition | None = None,
    split_model: Callable[[Partition], Any] | None = None,
    replicas: int = 1,
    schedule: str = "gpipe",
    defer_weight_gradients: bool = False,
) -> PipelinePlan:
    """The whole plan of `model` on `stages` stages (:func:`analyze`), for `replicas` copies of the pipeline run
    by `schedule`. Where `partition` (the automatic cut that made `placement`) splits a layer by rows and every
    micro-batch has rows to split, the plan places ``split_model(partition)``
    (:func:`rdkeras.pipeline.cut.split.split_model`); where it alternates layers, each micro-batch follows the
    plan of the cuts it moves them at. With `defer_weight_gradients` and micro-batches, each plan's plain Dense
    and convolution layers compute their weight gradients once a step (:func:`~rdkeras.pipeline.deferred.deferrable`:
    a layer shared by two stages defers on each, over its rows or micro-batches there)."""
    from rdkeras.pipeline.schedule import most_stashed, passes_in_order

    cut, graph = partition, model
    if cut is not None and cut.splits and split_model is not None and batch_size is not None:
        if batch_size // micro_batches >= 2:
            graph, placement = split_model(cut), cut.split_placement()
    specs = (batch_size, micro_batches, label_specs, sample_weight_specs)
    plans: dict[tuple[int, ...], PipelinePlan] = {(): analyze(graph, placement, stages, *specs)}
    uses: list[tuple[int, ...]] = []  # each micro-batch's cuts that move layers (none: the plan above)
    if cut is not None and cut.shares and micro_batches == cut.micro_batches:
        for m in range(micro_batches):
            uses.append(cut.moved(m))
            if uses[-1] not in plans:
                plans[uses[-1]] = analyze(model, cut.stage_of(uses[-1]), stages, *specs)
    if defer_weight_gradients and micro_batches > 1:
        for moved, p in plans.items():
            names, kept = deferrable(graph, p)
            plans[moved] = dataclasses.replace(p, deferred=frozen(names), deferred_bytes=frozen(kept))
    plan = plans.pop(())
    variant = {moved: i for i, moved in enumerate(plans, 1)}
    group = 2 if plans else 1  # 1F1B's unit of micro-batches (PipelinePlan.group)
    stashed = {
        s: most_stashed(passes_in_order(schedule, p, stages, micro_batches, group))
        for p, s in enumerate(plan.stage_order)
    }
    return dataclasses.replace(
        plan,
        replicas=replicas,
        partition=partition,
        schedule=schedule,
        stashed=frozen(stashed),
        variants=tuple(plans.values()),
        micro_variant=tuple(variant.get(moved, 0) for moved in uses),
    )


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
) -> PipelinePlan:
    """Places `model`'s layers on `stages` stages and finds every cut edge.

    Args:
        batch_size: the per-step batch, when every batch has it (else the batch
            dimension makes edges dynamic). With micro-batching, edges carry
            ``batch_size / micro_batches`` rows.
        label_specs / sample_weight_specs: (shape with batch first, dtype) of each
            label / sample-weight tensor, when known (they travel reader -> loss stage).
    """
    graph = functional_of(model)
    rows = micro_rows(batch_size, micro_batches)
    stage = assign_layers(model, placement, stages)
    influenced = _trainable_ancestry(graph)
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]

    # Output tensors of the model: the loss stage owns the last of them in pipeline order.
    outputs = list(graph.outputs)
    output_stages = [producer_stage(t, stage) for t in outputs]

    # Consumers per (tensor, stage), in graph order.
    consumers: dict[tuple[int, int], list[str]] = {}
    tensors: dict[int, Any] = {}
    for n in nodes:
        dst = stage[n.operation.name]
        for t in n.input_tensors:
            src = producer_stage(t, stage)
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
        src = producer_stage(tensors[tid], stage)
        if src is not None:
            succ[src].add(dst)
    order = topological(succ, stage, consumers, tensors)
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
        src = producer_stage(t, stage)
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
    return PipelinePlan(
        model_name=model.name,
        stages=stages,
        layer_stage=frozen(stage),
        stage_order=tuple(order),
        loss_stage=loss_stage,
        edges=tuple(edges),
        batch_size=batch_size,
        micro_batches=micro_batches,
        activation_bytes=frozen(activation_bytes),
        model=model,
    )
