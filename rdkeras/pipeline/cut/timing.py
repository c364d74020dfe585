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
    """The inputs of :func:`rdkeras.pipeline.cut.partition.balanced_cut` for one model."""

    names: list[str]  # layers in a topological order (each once, at its first call)
    seconds: list[float]  # per layer: median forward+backward seconds
    cut_bytes: list[int | None]  # per gap: bytes crossing a cut there each step (None: no cut may go there)
    rows: int


def _shape(shape: tuple, rows: int) -> tuple[int, ...]:
    return tuple(rows if i == 0 else UNKNOWN_DIM if d is None else int(d) for i, d in enumerate(shape))


def _synthetic(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A dry run's value of `shape`: normal floats, or zeros (valid ids for an embedding)."""
    dtype = np.dtype(str(dtype))
    return rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)


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
    stages by micro-batch (:mod:`rdkeras.pipeline.cut.partition`), else None. It may where running it on either
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
    model: Any,
    placement: dict[str, int],
    stages: int,
    rows: int,
    micro_batches: int,
    repeats: int = 5,
    defer: bool = False,
) -> list[float]:
    """Per stage of `placement`: the median seconds of its whole sub-model's forward and backward over
    `micro_batches` micro-batches of `rows` rows, as :func:`stage_compute` times them (with `defer`, the layers
    that may compute their weight gradients once a step do). Layers timed alone miss what a stage's sequence of
    them costs on a CPU (caches, the small ops between them): this is what the automatic cut scales their times
    to."""
    from rdkeras.pipeline.planner import make_plan
    from rdkeras.pipeline.rewriter import build_stage

    plan = make_plan(model, placement, stages, rows * micro_batches, micro_batches, defer_weight_gradients=defer)
    saved = [(v, np.array(v.numpy())) for v in model.variables]  # BatchNormalization's statistics move
    try:
        seconds = []
        for s in range(stages):
            stage = build_stage(model, plan, s)
            seconds.append(sum(stage_compute(stage, rows, micro_batches, repeats)) if stage.model is not None else 0.0)
        return seconds
    finally:
        for v, value in saved:
            v.assign(value)


def stage_compute(stage: Any, rows: int, micro_batches: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds of a :class:`~rdkeras.pipeline.Stage`'s compute in a training step, alone, as the step runs it
    (:mod:`rdkeras.pipeline.passes`), medians of `repeats`: (its `micro_batches` forward and backward passes of
    `rows` rows, gradients of what it receives included; the deferred layers' weight gradients once over every
    micro-batch's rows, 0.0 where none waits)."""
    import tensorflow as tf

    from rdkeras.pipeline import passes

    rng = np.random.default_rng(0)
    feed = []
    for t, f in zip(stage.model.inputs, stage.feeds, strict=True):
        shape = _shape(tuple(t.shape), rows)
        if f.edge is not None and f.edge.static:  # (a row split's part has fewer rows)
            shape = tuple(int(d or 0) for d in f.edge.shape)
        feed.append(tf.constant(_synthetic(rng, shape, t.dtype)))
    # What a stage receives with a gradient to send back: the stage computes that gradient too.
    back = [i for i, f in enumerate(stage.feeds) if f.edge is not None and f.edge.needs_grad]
    variables = stage.trainable_variables

    def micro_batches_passes(*inputs: Any) -> Any:
        results, kept = [], []
        for _ in range(micro_batches):
            sent_back = [inputs[i] for i in back]
            with tf.GradientTape() as tape:
                tape.watch(sent_back)
                outs, taps = passes.run_stage_model(stage, list(inputs), training=True)
                objective = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in outs])
            grads, input_grads, later = passes.pass_gradients(
                stage, tape, [objective], [tf.ones_like(objective)], variables, sent_back, taps
            )
            results += [g for g in grads + input_grads if g is not None] or [objective]
            kept.append(later)
        return results, kept

    def deferred(kept: Any) -> Any:
        summed: list[Any] = [None] * len(variables)
        passes.deferred_weight_gradients([(stage, later) for later in kept], variables, summed)
        return [g for g in summed if g is not None]

    step = tf.function(micro_batches_passes, jit_compile=False)
    seconds = median_seconds(step, feed, repeats)
    if not stage.deferred:
        return seconds, 0.0
    return seconds, median_seconds(tf.function(deferred, jit_compile=False), [step(*feed)[1]], repeats)


def _time_layers(graph: Any, names: list[str], rows: int, repeats: int) -> list[float]:
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    inputs = [_synthetic(rng, _shape(tuple(t.shape), rows), t.dtype) for t in graph.inputs]
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]
    # Every intermediate value of the batch, from one forward pass of the whole model.
    inner = [t for n in nodes for t in n.output_tensors]
    values = keras.Model(graph.inputs, inner, name="rdkeras_dry_run")(inputs)
    value_of = {id(t): v for t, v in zip(inner, values, strict=True)}
    value_of.update({id(t): tf.constant(v) for t, v in zip(graph.inputs, inputs, strict=True)})
    # Each call runs a layer this many times: a call's own cost is shared out, as a step's is over its ops.
    inside = max(1, min(8, DRY_RUN_ROWS * 2 // rows))
    steps, feeds = [], []
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

        steps.append(tf.function(passes, jit_compile=False))
        feeds.append(feed)
    return [t / inside for t in interleaved_medians(steps, feeds, repeats)]


def interleaved_medians(steps: list[Any], feeds: list[list[Any]], repeats: int) -> list[float]:
    """Per compiled step, the median seconds of `repeats` calls on its feed, after two (the first traces). The
    calls go round the steps in turn, so a slow spell of the machine (this VM's speed moves ±15% between
    runs) costs every step a sample or two, not a run of neighbouring layers all of theirs -- which once
    moved the automatic cut by a whole layer (the VGG-style convnet's stages measured 53.5 against 28.7 ms)."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats + 2):
        for step, feed, samples in zip(steps, feeds, times, strict=True):
            samples.append(_call_seconds(step, feed))
    return [statistics.median(samples[2:]) for samples in times]


def _call_seconds(step: Any, feed: list[Any]) -> float:
    import tensorflow as tf

    start = time.perf_counter()
    _ = [np.asarray(t) for t in tf.nest.flatten(step(*feed))]  # wait for the device
    return time.perf_counter() - start


def median_seconds(step: Any, feed: list[Any], repeats: int) -> float:
    """The median seconds of `repeats` calls of the compiled `step` on `feed`, after two (the first traces)."""
    return interleaved_medians([step], [feed], repeats)[0]
