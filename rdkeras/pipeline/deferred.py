"""Weight gradients apart from input gradients: the layers of a pipeline stage that compute their weight gradients
once a step, over every micro-batch's rows, instead of once per micro-batch (one matmul or filter gradient of the
whole batch is far cheaper on a CPU than M of its slices and their sum). Keras's public layer API only: which
layers may (:func:`defers_weight_gradients`), which of a plan's do (:func:`deferrable`), and the maths
(:func:`pre_activation_gradient`, :func:`weight_gradients`) that :mod:`rdkeras.pipeline.passes` runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rdkeras.keras_internals import functional_of, nodes_in_order
from rdkeras.pipeline.cut.split import part_rows, rows_of_part, weights_layer

if TYPE_CHECKING:
    from rdkeras.pipeline.plan import PipelinePlan


def defers_weight_gradients(layer: Any) -> bool:
    """Whether a pipeline stage may compute `layer`'s weight gradients once a step, over every micro-batch's rows
    (:func:`weight_gradients`), instead of once per micro-batch: a plain trainable Dense or Conv1D/2D/3D layer
    (its call is ``activation(op(inputs, kernel) + bias)``) with an activation :func:`pre_activation_gradient`
    knows, no regularizer, LoRA or quantization. A convolution's filter gradient on a few rows costs far more per
    row on a CPU than on the whole batch (oneDNN's small-batch kernels), as M small matmuls do."""
    import keras

    return (
        type(layer) in (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
        and layer.trainable
        and bool(layer.trainable_variables)
        and _activation_name(layer) is not None
        and layer.kernel_regularizer is None
        and layer.bias_regularizer is None
        and layer.activity_regularizer is None
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer.dtype_policy, "quantization_mode", None) is None
    )


def _activation_name(layer: Any) -> str | None:
    import keras

    known = {
        keras.activations.linear: "linear",
        keras.activations.relu: "relu",
        keras.activations.sigmoid: "sigmoid",
        keras.activations.tanh: "tanh",
    }
    return known.get(layer.activation)


def pre_activation_gradient(layer: Any, outputs: Any, output_grads: Any) -> Any:
    """The gradient of a deferrable layer's pre-activation (``op(inputs, kernel) + bias``) from its outputs
    and their gradient: what TensorFlow's own gradient of the activation computes, with the same kernels."""
    import tensorflow as tf

    name = _activation_name(layer)
    if name == "relu":
        return tf.raw_ops.ReluGrad(gradients=output_grads, features=outputs)  # outputs > 0 exactly where inputs are
    if name == "sigmoid":
        return tf.raw_ops.SigmoidGrad(y=outputs, dy=output_grads)
    if name == "tanh":
        return tf.raw_ops.TanhGrad(y=outputs, dy=output_grads)
    return output_grads


def weight_gradients(layer: Any, inputs: Any, pre_activation_grads: Any) -> list[Any]:
    """The gradients of a deferrable layer's trainable variables (:func:`defers_weight_gradients`) given its
    inputs and the gradients of its pre-activation output, for any number of rows: the layer is called without
    its activation, whose forward TensorFlow prunes (a matmul's or a convolution's kernel gradient needs only
    its inputs: ``Conv2DBackpropFilter``, not the convolution)."""
    import keras
    import tensorflow as tf

    activation = layer.activation
    layer.activation = keras.activations.linear  # Dense.call and BaseConv.call read it at trace time
    try:
        with tf.GradientTape() as tape:
            outputs = layer(inputs)
        return tape.gradient(outputs, layer.trainable_variables, output_gradients=pre_activation_grads)
    finally:
        layer.activation = activation


def deferrable(model: Any, plan: PipelinePlan) -> tuple[dict[int, list[str]], dict[int, int]]:
    """Per stage of `plan`: its layers whose weight gradients wait for the step's end
    (:func:`defers_weight_gradients`, called once in the graph; a layer shared
    between two stages, alternating or split by rows, on each of them), and the bytes of their inputs and
    outputs over the whole batch, or over its rows of it where a split gives the stage only some (what waiting
    keeps)."""
    import numpy as np

    graph = functional_of(model)
    parts = part_rows(graph)
    micro = plan.micro_batches
    calls: dict[int, list[Any]] = {}
    for n in nodes_in_order(graph):
        if not n.is_input:
            calls.setdefault(id(n.operation), []).append(n)
    names: dict[int, list[str]] = {}
    kept: dict[int, int] = {}
    for layer in graph.layers:
        s = plan.layer_stage.get(layer.name)
        once = len(calls.get(id(layer), [])) == 1
        if s is None or not once or not defers_weight_gradients(weights_layer(layer)):
            continue
        names.setdefault(s, []).append(layer.name)
        (node,) = calls[id(layer)]
        if plan.batch_size is not None:
            for t in (node.input_tensors[0], node.output_tensors[0]):
                part = parts.get(id(t))
                rows = plan.batch_size if part is None else micro * rows_of_part(plan.batch_size // micro, part)
                size = rows * int(np.prod([d or 0 for d in tuple(t.shape)[1:]]))
                kept[s] = kept.get(s, 0) + size * np.dtype(str(t.dtype)).itemsize
    return names, kept
