"""Row splits: one layer's rows of every micro-batch shared between two pipeline stages.

Cuts between layers balance only as finely as the layers are (:mod:`rdkeras.pipeline.cut.partition`). A layer
that computes each row of its batch on its own (a convolution, a Dense layer) splits finer: of each
micro-batch's n rows, the stage before the cut runs it for the first n - k, the stage after for the last k.
The *split model* puts three layers of rdkeras's around the layer L:

    x -> L__rows -> x[:n-k] -> L                            (the earlier stage)
                 -> x[n-k:] -> L__twin  (L itself, under another name: the same weights)
                               L__join  (both parts' rows, in order) -> L's consumers   (the later stage)

so the analyzer sees two cut edges, L's output for n - k rows and its input for k, and the stages are
balanced in every micro-batch (not by turns, as alternation's are); the two stages' partial gradients of L's
weights are summed between them at the step's end. The split model shares every layer, and so every weight,
with the user's model, which it leaves as it is: nothing of it reaches what Keras saves.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rdkeras.keras_internals import functional_of, nodes_in_order, rebuild

ROWS, TWIN, JOIN = "__rows", "__twin", "__join"  # the suffixes of the layers a split adds


def kept_rows(rows: int, moved: int, of: int) -> int:
    """Of a micro-batch's `rows` (at least 2), how many the earlier stage runs the layer for when `moved` of every
    `of` move: each stage keeps at least one."""
    return min(max(rows - rows * moved // of, 1), rows - 1)


def splittable(model: Any, names: list[str]) -> list[bool]:
    """Per layer of `names`: whether its rows may be split between two stages. It must be able to alternate
    (:func:`rdkeras.pipeline.cut.timing.alternable`: called once, no state beside its trainable weights, no model
    output) and its output row i must depend on its input row i alone: a convolution or Dense layer (a layer of another
    kind may mix rows, as a normalisation over the batch does) with one input and one output."""
    import keras

    from rdkeras.pipeline.cut.timing import alternable

    kinds = (
        keras.layers.Conv1D,
        keras.layers.Conv2D,
        keras.layers.Conv3D,
        keras.layers.DepthwiseConv2D,
        keras.layers.SeparableConv2D,
        keras.layers.Dense,
        keras.layers.EinsumDense,
    )
    graph = functional_of(model)
    node = {n.operation.name: n for n in nodes_in_order(graph) if not n.is_input}
    return [
        a is not None
        and type(graph.get_layer(name)) in kinds  # (a subclass may do anything in its call)
        and len(node[name].input_tensors) == 1
        and len(node[name].output_tensors) == 1
        for name, a in zip(names, alternable(model, names), strict=True)
    ]


def split_model(model: Any, splits: Mapping[str, tuple[int, int]]) -> Any:
    """`model` with each layer named in `splits` (name -> (moved, of)) split by rows: the later stage's part
    runs `moved` of every `of` rows of each micro-batch (:func:`kept_rows`)."""
    rows_layer, twin_layer, join_layer = _layer_types()
    graph = functional_of(model)
    made: dict[str, tuple[Any, Any, Any]] = {}

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if layer.name not in splits:
            return layer(*args, **kwargs)
        if layer.name not in made:
            moved, of = splits[layer.name]
            made[layer.name] = (
                rows_layer(moved, of, name=layer.name + ROWS),
                twin_layer(layer, name=layer.name + TWIN),
                join_layer(name=layer.name + JOIN),
            )
        rows, twin, join = made[layer.name]
        first, second = rows(args[0])
        return join([layer(first, *args[1:], **kwargs), twin(second)])

    return rebuild(graph, call, name=f"{graph.name}_split")


def weights_layer(layer: Any) -> Any:
    """The layer whose weights and call a deferred weight gradient is computed with: a ``__twin`` stands for the
    layer it runs (on the later stage's rows); any other layer for itself."""
    twin: Any = _layer_types()[1]
    return layer.layer if isinstance(layer, twin) else layer


def part_rows(model: Any) -> dict[int, tuple[bool, int, int]]:
    """id(tensor) -> (later part?, moved, of) for every tensor of a split model that holds only one part's rows
    (between a ``__rows`` layer and its ``__join``): the analyzer sizes those edges by :func:`kept_rows`."""
    rows_layer, _, join_layer = _layer_types()
    parts: dict[int, tuple[bool, int, int]] = {}
    for n in nodes_in_order(functional_of(model)):
        if n.is_input or isinstance(n.operation, join_layer):
            continue
        if isinstance(n.operation, rows_layer):
            op: Any = n.operation
            for later, t in enumerate(n.output_tensors):
                parts[id(t)] = (bool(later), op.moved, op.of)
            continue
        marks = {parts.get(id(t)) for t in n.input_tensors}
        mark = marks.pop() if len(marks) == 1 else None
        if mark is not None:  # (the rows' layer itself, or a layer after it on those rows)
            for t in n.output_tensors:
                parts[id(t)] = mark
    return parts


def rows_of_part(rows: int, part: tuple[bool, int, int]) -> int:
    later, moved, of = part
    kept = kept_rows(rows, moved, of)
    return rows - kept if later else kept


@functools.cache
def _layer_types() -> tuple[type, type, type]:
    """The three layer classes (defined on first use: importing rdkeras does not import Keras)."""
    import keras
    from keras import ops

    class RowSplit(keras.layers.Layer):
        """x -> (its first rows, its last `moved` of every `of` rows)."""

        def __init__(self, moved: int, of: int, **kwargs: Any):
            super().__init__(**kwargs)
            self.moved, self.of = int(moved), int(of)

        def call(self, x: Any) -> Any:
            import tensorflow as tf

            rows = tf.shape(x)[0]  # (kept_rows, in tensors)
            kept = tf.minimum(tf.maximum(rows - rows * self.moved // self.of, 1), rows - 1)
            # One split, whose gradient is one concatenation: two slices' gradients would each pad a
            # zero tensor of the whole input (measured: 14 ms of a 110 ms step).
            first, second = tf.split(x, tf.stack([kept, rows - kept]), axis=0, num=2)
            return first, second

        def compute_output_shape(self, shape: tuple) -> tuple:
            part = (None, *tuple(shape)[1:])
            return part, part

    class Twin(keras.layers.Layer):
        """Another name for `layer` (called on other rows, by another stage): the same weights."""

        def __init__(self, layer: Any, **kwargs: Any):
            super().__init__(**kwargs)
            self.layer = layer
            self.built = True

        def call(self, x: Any) -> Any:
            return self.layer(x)

        def compute_output_shape(self, shape: tuple) -> Any:
            return self.layer.compute_output_shape(shape)

    class RowJoin(keras.layers.Layer):
        """Both parts' rows, in order."""

        def call(self, parts: list[Any]) -> Any:
            return ops.concatenate(parts, axis=0)

        def compute_output_shape(self, shapes: list[tuple]) -> tuple:
            return (None, *tuple(shapes[0])[1:])

    return RowSplit, Twin, RowJoin
