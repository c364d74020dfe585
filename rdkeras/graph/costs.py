"""What the automatic pipeline cut needs to know about a Keras model: its layers in order, each one's
measured forward+backward time, and the bytes a cut between two of them would send.

The layers are timed one at a time on one synthetic batch (a dry run: no user data is needed at
compile time): each layer becomes a small ``keras.Model`` over its own input tensors, as the
rewriter builds stages, fed with the values the whole model computes for that batch; its forward
and backward run inside a compiled function, as in the training step (eagerly, the per-op
dispatch would weigh on small layers as it never does in training). The pipeline times them at
the batch of its micro-batches: small batches do not cost all layers alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdkeras.keras_internals import functional_of, nodes_in_order, producer_of

DRY_RUN_ROWS = 32  # the dry run's batch (compute and bytes both scale with it, so the balance barely does)
UNKNOWN_DIM = 16  # a dimension only known at run time (a sequence length), for the dry run


@dataclass(frozen=True)
class LayerCosts:
    """The inputs of :func:`rdkeras.parallel.partition.balanced_cut` for one model."""

    names: list[str]  # layers in a topological order (each once, at its first call)
    seconds: list[float]  # per layer: median forward+backward seconds
    cut_bytes: list[int | None]  # per gap: bytes crossing a cut there each step (None: no cut may go there)
    rows: int


def _shape(shape: tuple, rows: int) -> tuple[int, ...]:
    return tuple(rows if i == 0 else UNKNOWN_DIM if d is None else int(d) for i, d in enumerate(shape))


def _nbytes(tensor: Any, rows: int) -> int:
    dtype = np.dtype(str(tensor.dtype)) if str(tensor.dtype) != "bfloat16" else np.dtype(np.float16)
    n = int(np.prod(_shape(tuple(tensor.shape), rows), dtype=np.int64)) * dtype.itemsize
    return 2 * n if dtype.kind == "f" else n  # a float activation's gradient comes back as large


def layer_order(model: Any, rows: int = DRY_RUN_ROWS) -> tuple[list[str], list[int | None], Any]:
    """(layer names in order, bytes per gap -- None inside a layer used on both sides --, the graph)
    for a batch of `rows`."""
    return _order(model, rows)


def _order(model: Any, rows: int) -> tuple[list[str], list[int | None], Any]:
    graph = functional_of(model)
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]
    names: list[str] = []
    for n in nodes:
        if n.operation.name not in names:
            names.append(n.operation.name)
    pos = {name: i for i, name in enumerate(names)}
    count = len(names)
    # A tensor is "made" at its producer's position (-1: a model input) and "used" up to its last
    # consumer's (count: a model output, which travels to the loss stage, the last).
    made: dict[int, tuple[int, Any]] = {}
    used: dict[int, int] = {}
    blocked = [False] * (count + 1)  # blocked[i]: no cut between names[i - 1] and names[i]
    for t in graph.inputs:
        made[id(t)] = (-1, t)
    for n in nodes:
        here = pos[n.operation.name]
        for t in n.output_tensors:
            made.setdefault(id(t), (here, t))
        for t in n.input_tensors:
            op = producer_of(t)[0]
            src = pos.get(op.name, -1)
            used[id(t)] = max(used.get(id(t), -1), here)
            # A shared layer placed before its producer: both must share a stage.
            for i in range(here + 1, src + 1):
                blocked[i] = True
    for t in graph.outputs:
        used[id(t)] = count
    crossing = [0] * (count + 1)
    for tid, (src, t) in made.items():
        last = used.get(tid, src)
        for i in range(max(src + 1, 1), min(last, count - 1) + 1):
            crossing[i] += _nbytes(t, rows)
    cut_bytes: list[int | None] = [None if blocked[i] else crossing[i] for i in range(1, count)]
    return names, cut_bytes, graph


def alternable(model: Any, names: list[str]) -> list[int | None]:
    """Per layer of `names`: the bytes of its trainable weights where it may alternate between two pipeline
    stages by micro-batch (:mod:`rdkeras.parallel.partition`), else None. It may where running it on either
    stage changes nothing but where it runs: it is called once, keeps no state beside its trainable weights
    (no moving statistics, no random seed: two copies would drift apart) and computes no model output (the loss
    stage owns those)."""
    graph = functional_of(model)
    calls: dict[str, list[Any]] = {}
    for n in nodes_in_order(graph):
        if not n.is_input:
            calls.setdefault(n.operation.name, []).append(n)
    outputs = {id(t) for t in graph.outputs}
    out: list[int | None] = []
    for name in names:
        layer, nodes = graph.get_layer(name), calls.get(name, [])
        if len(nodes) != 1 or layer.non_trainable_weights or any(id(t) in outputs for t in nodes[0].output_tensors):
            out.append(None)
            continue
        weights = layer.trainable_weights
        out.append(sum(int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype)).itemsize for v in weights))
    return out


def measure(model: Any, rows: int = DRY_RUN_ROWS, repeats: int = 5) -> LayerCosts:
    """Times every layer's forward and backward (median of `repeats`, after one warm-up) on a synthetic batch."""
    names, cut_bytes, graph = _order(model, rows)
    # The dry run must leave the model as it found it (BatchNormalization statistics, dropout seeds).
    saved = [(v, np.array(v.numpy())) for v in model.variables]
    try:
        return LayerCosts(names, _time_layers(graph, names, rows, repeats), cut_bytes, rows)
    finally:
        for v, value in saved:
            v.assign(value)


def stage_seconds(
    model: Any, placement: dict[str, int], stages: int, rows: int, micro_batches: int, repeats: int = 5
) -> list[float]:
    """Per stage of `placement`: the median seconds of its whole sub-model's forward and backward over
    `micro_batches` micro-batches of `rows` rows, gradients of what it receives included (as the stage computes
    them in a step). Layers timed alone miss what a stage's sequence of them costs on a CPU (caches, the small
    ops between them): this is what the automatic cut scales their times to."""
    import keras
    import tensorflow as tf

    from rdkeras.graph.analyzer import analyze
    from rdkeras.graph.rewriter import build_stage

    plan = analyze(model, placement, stages, rows * micro_batches, micro_batches)
    rng = np.random.default_rng(0)
    saved = [(v, np.array(v.numpy())) for v in model.variables]  # BatchNormalization's statistics move
    try:
        seconds = []
        for s in range(stages):
            stage = build_stage(model, plan, s)
            if stage.model is None:
                seconds.append(0.0)
                continue
            sub = stage.model
            feed = []
            for t, f in zip(sub.inputs, stage.feeds, strict=True):
                shape, dtype = _shape(tuple(t.shape), rows), np.dtype(str(t.dtype))
                if f.edge is not None and f.edge.static:  # (a row split's part has fewer rows)
                    shape = tuple(int(d or 0) for d in f.edge.shape)
                value = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
                feed.append(tf.constant(value))
            # What a stage receives with a gradient to send back: the stage computes that gradient too.
            back = [t for t, f in zip(feed, stage.feeds, strict=True) if f.edge is not None and f.edge.needs_grad]

            def passes(*feed: Any, sub: Any = sub, back: list = back) -> Any:
                results = []
                for _ in range(micro_batches):
                    with tf.GradientTape() as tape:
                        tape.watch(back)
                        out = sub(list(feed), training=True)
                        total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in keras.tree.flatten(out)])
                    grads = tape.gradient(total, sub.trainable_variables + back)
                    results += [g for g in grads if g is not None] or [total]
                return results

            step = tf.function(passes, jit_compile=False)
            times = []
            for _ in range(repeats + 2):  # (the first traces)
                start = time.perf_counter()
                _ = [t.numpy() for t in step(*feed)]
                times.append(time.perf_counter() - start)
            seconds.append(statistics.median(times[2:]))
        return seconds
    finally:
        for v, value in saved:
            v.assign(value)


def _time_layers(graph: Any, names: list[str], rows: int, repeats: int) -> list[float]:
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    inputs = []
    for t in graph.inputs:
        shape, dtype = _shape(tuple(t.shape), rows), np.dtype(str(t.dtype))
        inputs.append(
            rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)  # valid ids
        )
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]
    # Every intermediate value of the batch, from one forward pass of the whole model.
    inner = [t for n in nodes for t in n.output_tensors]
    values = keras.Model(graph.inputs, inner, name="rdkeras_dry_run")(inputs)
    value_of = {id(t): v for t, v in zip(inner, values, strict=True)}
    value_of.update({id(t): tf.constant(v) for t, v in zip(graph.inputs, inputs, strict=True)})
    # Each call runs a layer this many times: a call's own cost is shared out, as a step's is over its ops.
    inside = max(1, min(8, DRY_RUN_ROWS * 2 // rows))
    seconds = []
    for i, name in enumerate(names):
        mine = [n for n in nodes if n.operation.name == name]
        ins: list[Any] = []
        for n in mine:
            ins.extend(t for t in n.input_tensors if all(t is not u for u in ins))
        outs = [t for n in mine for t in n.output_tensors]
        sub = keras.Model(ins, outs, name=f"rdkeras_dry_run_{i}")
        feed = [value_of[id(t)] for t in ins]
        weights = list(mine[0].operation.trainable_variables)

        def passes(*feed: Any, sub: Any = sub, weights: list = weights) -> Any:
            floating = [f for f in feed if f.dtype.is_floating]
            results = []
            for _ in range(inside):
                with tf.GradientTape() as tape:
                    tape.watch(floating)
                    out = sub(feed[0] if len(feed) == 1 else list(feed), training=True)
                    total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(out)])
                if not floating + weights:
                    results.append(total)
                    continue
                grads = tape.gradient(total, floating + weights, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                results += [g for g in grads if g is not None]
            return results

        step = tf.function(passes, jit_compile=False)
        times = []
        for _ in range(repeats + 2):  # (the first traces)
            start = time.perf_counter()
            _ = [t.numpy() for t in step(*feed)]  # wait for the device
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times[2:]) / inside)
    return seconds
