"""A pipeline stage's compute, without its transfers: one micro-batch's forward and backward pass, and the
weight gradients of the layers that wait for the step's end. :mod:`rdkeras.pipeline.schedule` runs them between
its sends and receives; :mod:`rdkeras.pipeline.cut.timing` times them as the step runs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rdkeras.pipeline import deferred
from rdkeras.pipeline.rewriter import Stage


def run_stage_model(stage: Stage, inputs: list[Any], training: bool) -> tuple[list[Any], list[Any]]:
    """`stage`'s model on `inputs` (one per ``stage.feeds``): its outputs, and in training the deferred layers'
    inputs and outputs."""
    model = stage.tapped_model if training and stage.tapped_model is not None else stage.model
    outs = model(inputs, training=training)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if model is stage.model:
        return outs, []
    return outs[: len(stage.sends)], [inputs[i] if kind == "in" else outs[i] for kind, i in stage.taps]


def pass_gradients(
    stage: Stage,
    tape: Any,
    targets: list[Any],
    output_grads: list[Any],
    variables: list[Any],
    back: list[Any],
    taps: list[Any],
    after: Sequence[Any] = (),
) -> tuple[list[Any], list[Any], tuple]:
    """One micro-batch's backward compute on `stage`, after `after` (no transfers): (the gradients of
    `variables`, None for the deferred layers' and those the targets do not reach; those of `back`, the
    received tensors it sends gradients back for; per deferred layer, its inputs and pre-activation gradients,
    for :func:`deferred_weight_gradients`)."""
    import tensorflow as tf

    waiting = {id(v) for layer in stage.deferred for v in layer.trainable_variables}
    direct = [i for i, v in enumerate(variables) if id(v) not in waiting]  # their gradients now
    layer_outputs = taps[1::2]
    sources = [variables[i] for i in direct] + back + layer_outputs
    with tf.control_dependencies(list(after)):
        grads = tape.gradient(targets, sources, output_gradients=output_grads) if targets else []
    # An Embedding's weight gradient stays IndexedSlices (the optimizer applies it as it would in one process).
    n = len(direct)
    grads = [g if g is None or (i < n and isinstance(g, tf.IndexedSlices)) else tf.convert_to_tensor(g)
             for i, g in enumerate(grads)] or [None] * len(sources)  # fmt: skip
    weight_grads: list[Any] = [None] * len(variables)
    for i, g in zip(direct, grads[: len(direct)], strict=True):
        weight_grads[i] = g
    input_grads = grads[len(direct) : len(direct) + len(back)]
    later = []
    output_grads_of_deferred = grads[len(direct) + len(back) :]
    for layer, x, y, dy in zip(stage.deferred, taps[0::2], layer_outputs, output_grads_of_deferred, strict=True):
        dy = tf.zeros_like(y) if dy is None else dy
        later.append((x, deferred.pre_activation_gradient(layer, y, dy)))
    return weight_grads, input_grads, tuple(later)


def deferred_weight_gradients(kept: list[tuple[Stage, tuple]], variables: list, summed: list) -> None:
    """The deferred layers' weight gradients, each computed once over every micro-batch's rows (one matmul or
    filter gradient of the whole batch is far cheaper on a CPU than M of its slices and their sum): into
    `summed` (one entry per `variables`); `kept`: per micro-batch, its stage (:meth:`Pipeline.stage_for`: a layer
    that alternates is on this stage for some micro-batches only) and what :func:`pass_gradients` returned."""
    import tensorflow as tf

    index = {id(v): i for i, v in enumerate(variables)}
    rows: dict[int, tuple[Any, list[Any], list[Any]]] = {}  # layer -> (layer, its inputs, pre-activation grads)
    for stage, later in kept:
        for layer, (x, dz) in zip(stage.deferred, later, strict=True):
            _, xs, dzs = rows.setdefault(id(layer), (layer, [], []))
            xs.append(x)
            dzs.append(dz)
    for layer, xs, dzs in rows.values():
        x = xs[0] if len(xs) == 1 else tf.concat(xs, axis=0)
        dz = dzs[0] if len(dzs) == 1 else tf.concat(dzs, axis=0)
        grads = deferred.weight_gradients(layer, x, dz)
        for v, g in zip(layer.trainable_variables, grads, strict=True):
            summed[index[id(v)]] = g
