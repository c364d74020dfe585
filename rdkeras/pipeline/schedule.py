"""The pipeline schedules: one stage's train, test and predict steps, with micro-batches.

Per step, on each stage, for every micro-batch m:

    forward F(m):   recv activations -> stage model -> send activations
    backward B(m):  recv output gradients -> tape.gradient(outputs, output_gradients=...)
                    -> send input gradients
    then: sum over micro-batches (average over replicas) -> optimizer.apply

in the order of the schedule (:func:`passes_in_order`): "gpipe" runs every forward, then
every backward (M micro-batches' activations stashed at once); "1f1b" (PipeDream-Flush, as
Megatron) runs a few forwards to fill the pipeline, then alternates one forward and one
backward, so a stage keeps at most as many micro-batches' activations as there are stages
after it, itself included -- the same gradients, summed in another order.

Every transfer of a step is issued here (the reader's data, activations, gradients,
predictions), each chained after the previous one by control dependencies, in an
order each worker derives from the same plan, so the blocking receives cannot deadlock.
The step's state comes in as arguments: the :class:`~rdkeras.pipeline.stages.Pipeline`
made current for this data, never looked up through the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from rdkeras import keras_internals
from rdkeras.ops import rdma_recv, rdma_recv_all, rdma_send, rdma_send_all
from rdkeras.parallel import SCHEDULES
from rdkeras.parallel.sharding import unpack
from rdkeras.pipeline import Stage
from rdkeras.pipeline.feeds import Feeds
from rdkeras.pipeline.passes import deferred_weight_gradients, pass_gradients, run_stage_model
from rdkeras.pipeline.stages import Pipeline


def passes_in_order(
    schedule: str, position: int, stages: int, micro_batches: int, group: int = 1
) -> list[tuple[str, int]]:
    """The forward ("F", m) and backward ("B", m) passes of the stage at `position` in a pipeline of
    `stages` (0: the first), in the order it runs them. 1F1B in `group`s of micro-batches alternates a group's
    forwards with a group's backwards (where a layer alternates between two stages by micro-batch, each group
    holds its share of both, so that neither stage waits on the other's turn)."""
    m_all = range(micro_batches)
    if schedule == "gpipe":
        return [("F", m) for m in m_all] + [("B", m) for m in reversed(m_all)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    units = -(-micro_batches // group)
    warmup = min(stages - 1 - position, units)  # forwards in flight before the first backward
    order = [("F", u) for u in range(warmup)]
    for u in range(units - warmup):
        order += [("F", warmup + u), ("B", u)]
    order += [("B", u) for u in range(units - warmup, units)]
    return [(kind, m) for kind, u in order for m in range(u * group, min((u + 1) * group, micro_batches))]


def most_stashed(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and backward did not yet, at once (their activations are kept)."""
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def _forward(
    run: Pipeline, feeds: Feeds, chain: list[Any], training: bool, with_loss: bool = True
) -> tuple[list, Any, list]:
    """Every micro-batch's forward pass on this stage, in order: (passes, summed loss, chain)."""
    passes, total_loss = [], None
    for m in range(run.plan.micro_batches):
        one, loss, chain = _forward_one(run, feeds, m, chain, training, with_loss)
        passes.append(one)
        total_loss = _sum(total_loss, loss)
    return passes, total_loss, chain


def _forward_one(
    run: Pipeline, feeds: Feeds, m: int, chain: list[Any], training: bool, with_loss: bool = True
) -> tuple[tuple, Any, list]:
    """Micro-batch m's forward pass on this stage: ((tape, outputs, received, objective, taps), its loss, chain);
    taps: the inputs and outputs of the layers whose weight gradients wait for the step's end (``stage.deferred``).

    The tape records only when `training`; the loss stage computes the loss `with_loss` (not for predictions).
    """
    import tensorflow as tf

    stage, plan = run.stage_for(m), run.plan
    loss = None
    chain = _send_data(run, feeds, m, chain)
    received, chain = _receive(run, feeds, m, chain)
    tape = tf.GradientTape() if training else None
    with tape or contextlib.nullcontext():
        if tape is not None:
            for e in stage.received:
                if e.needs_grad:
                    tape.watch(received[e.name])
        outs, taps = _run_stage(stage, feeds, m, received, chain, training=training)
        objective = _regularization(stage, plan.micro_batches) if training else None
        if stage.is_loss and with_loss:
            loss = feeds.loss(m, outs, received, training=training)
            if loss is not None:
                objective = loss if objective is None else objective + loss
    chain = _send_outputs(run, stage, m, outs, chain)
    if training:
        # The next receive waits until this micro-batch is computed: a receive blocks
        # TensorFlow's (one) thread, which must not idle while work is ready.
        chain = [*chain, _computed(outs, objective)]
    return (tape, outs, received, objective, taps), loss, chain


def train_step(
    model: Any, run: Pipeline, data: Any, average: Callable[[list], list] | None, schedule: str = "1f1b"
) -> Any:
    """One training step of this stage in `schedule`'s order; `average` averages its summed gradients over
    the replicas (hybrid parallelism; None for one pipeline)."""
    import tensorflow as tf

    stage, plan = run.stage, run.plan
    feeds = Feeds(model, run, *unpack(data))
    chain = feeds.after_data()
    variables = run.trainable_variables
    summed: list[Any] = [None] * len(variables)
    passes: dict[int, tuple] = {}
    kept: dict[int, tuple] = {}  # micro-batch -> (its stage, the inputs and pre-activation gradients it deferred)
    total_loss = None
    position = plan.stage_order.index(stage.index)
    for kind, m in passes_in_order(schedule, position, plan.stages, plan.micro_batches, plan.group):
        if kind == "F":
            passes[m], loss, chain = _forward_one(run, feeds, m, chain, training=True)
            total_loss = _sum(total_loss, loss)
        else:
            chain, later = _backward_one(run, m, passes.pop(m), variables, summed, chain)
            kept[m] = (run.stage_for(m), later)
    if any(s.deferred for s in run.stages):
        # After the step's last input-gradient is sent, while the neighbours drain the pipeline.
        with tf.control_dependencies(chain):
            deferred_weight_gradients([kept[m] for m in sorted(kept)], variables, summed)
        chain = [*chain, _computed(summed)]
    for pair_sum, members in run.shared:
        # A layer alternating with a neighbour stage: the two partial sums become the whole, on both, in cut
        # order (a middle stage's first pair, then its second), after every transfer of the step.
        with tf.control_dependencies(chain):
            whole = pair_sum([_or_zeros(summed[i], variables[i]) for i in members])
        for i, g in zip(members, whole, strict=True):
            summed[i] = g
        chain = [*chain, _computed(whole)]
    if average is not None and variables:
        summed = average(summed)
    pairs = [(g, v) for g, v in zip(summed, variables, strict=True) if g is not None]
    with tf.control_dependencies(chain):
        if pairs:
            model.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        else:  # a stage without trained weights still counts the step, so every worker's agrees
            keras_internals.inner_optimizer(model.optimizer).iterations.assign_add(1)
    if stage.is_loss:
        feeds.update_metrics(total_loss)
    return model.get_metrics_result()


def _backward_one(
    run: Pipeline, m: int, forward: tuple, variables: list, summed: list, chain: list[Any]
) -> tuple[list, tuple]:
    """Micro-batch m's backward pass on this stage: its weights' gradients added to `summed`, but for the deferred
    layers', whose inputs and pre-activation gradients it returns instead; returns (chain, those)."""
    import tensorflow as tf

    stage = run.stage_for(m)
    tape, outs, received, objective, taps = forward
    targets, output_grads = [], []
    back_edges = [e for edges in stage.sends for e in edges if e.needs_grad]
    arrived = rdma_recv_all(
        [run.bwd[(e.name, m)] for e in back_edges], [(e.shape, e.dtype) for e in back_edges], f"{m}/grads", chain
    ) if back_edges else []  # fmt: skip
    chain = arrived[-1:] or chain
    grad_of = dict(zip([e.name for e in back_edges], arrived, strict=True))
    for pos, edges in enumerate(stage.sends):
        grads_in = [grad_of[e.name] for e in edges if e.needs_grad]
        if grads_in:
            targets.append(outs[pos])
            output_grads.append(tf.add_n(grads_in) if len(grads_in) > 1 else grads_in[0])
    if objective is not None:
        targets.append(objective)
        output_grads.append(tf.ones_like(objective))
    back = [received[e.name] for e in stage.received if e.needs_grad]
    weight_grads, input_grads, later = pass_gradients(stage, tape, targets, output_grads, variables, back, taps, chain)
    sent_back = [e for e in stage.received if e.needs_grad]
    if sent_back:
        values = [
            tf.zeros_like(received[e.name]) if g is None else g for e, g in zip(sent_back, input_grads, strict=True)
        ]
        chain = [rdma_send_all([run.bwd[(e.name, m)] for e in sent_back], values, f"{m}/grads", chain)]
    chain = [*chain, _computed(weight_grads, input_grads, later)]
    for i, g in enumerate(weight_grads):
        if g is not None:
            summed[i] = g if summed[i] is None else _add_gradients(summed[i], g)
    return chain, later


def _add_gradients(a: Any, b: Any) -> Any:
    """Two micro-batches' gradients added; an Embedding's IndexedSlices stay sparse (their rows and indices, in
    micro-batch order: the IndexedSlices one process computes for the batch, which Adam applies differently from
    a dense gradient)."""
    import tensorflow as tf

    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return a + b


def test_step(model: Any, run: Pipeline, data: Any) -> Any:
    feeds = Feeds(model, run, *unpack(data))
    _, total_loss, _ = _forward(run, feeds, feeds.after_data(), training=False)
    if run.stage.is_loss:
        feeds.update_metrics(total_loss)
    return model.get_metrics_result()


def predict_step(model: Any, run: Pipeline, data: Any) -> Any:
    import keras
    import tensorflow as tf

    stage = run.stage
    x, _, _ = unpack(data)
    feeds = Feeds(model, run, x, None, None)
    passes, _, chain = _forward(run, feeds, feeds.after_data(), training=False, with_loss=False)
    _, outs, received, _, _ = passes[0]
    graph = keras_internals.functional_of(model)
    if stage.is_loss:
        flat = feeds.model_outputs(outs, received)
        for s, ch in sorted(run.predict_out.items()):
            for i, t in enumerate(flat):
                chain = [rdma_send(ch, t, f"predict/{s}/{i}", chain)]
    else:
        # Dynamic channels: each received tensor owns its buffer (Keras keeps predictions).
        flat = []
        for i, t in enumerate(graph.outputs):
            r = rdma_recv(run.predict_out[stage.index], t.shape, t.dtype, f"predict/{i}", chain)
            chain = [r]
            flat.append(r)
    with tf.control_dependencies(chain):
        flat = [tf.identity(t) for t in flat]
    return keras.tree.pack_sequence_as(keras_internals.outputs_struct(graph), flat)


def _run_stage(
    stage: Stage, feeds: Feeds, m: int, received: dict[str, Any], chain: list[Any], training: bool
) -> tuple[list[Any], list[Any]]:
    """The stage model's outputs for micro-batch m, and in training the deferred layers' inputs and outputs."""
    import tensorflow as tf

    if stage.model is None:
        return [], []
    inputs = [received[f.edge.name] if f.edge is not None else feeds.inputs[f.input_index or 0][m] for f in stage.feeds]
    # Micro-batch m computes only once m-1's activations are on their way: with one thread,
    # TensorFlow would otherwise run every micro-batch's forward before the first send, and
    # the next stage could not overlap with this one.
    with tf.control_dependencies(chain):
        if not training or feeds.plan.micro_batches == 1:
            return run_stage_model(stage, inputs, training)
        with keras_internals.global_batch_step(feeds.global_batch(m)):  # a Dropout mask: m's rows of the batch's
            return run_stage_model(stage, inputs, training)


def _send_data(run: Pipeline, feeds: Feeds, m: int, chain: list[Any]) -> list[Any]:
    """Reader: micro-batch m's model inputs to the stages that consume them, labels to the loss worker."""
    import tensorflow as tf

    stage = run.stage_for(m)
    if not stage.is_reader:
        return chain
    for pos, e in stage.data_edges:
        t = tf.cast(feeds.inputs[pos][m], e.dtype)
        chain = [rdma_send(run.fwd[(e.name, m)], t, f"{e.name}/{m}", chain)]
    for e in stage.label_edges if m == 0 else ():  # the whole batch's, once a step
        whole = feeds.whole_labels if e.kind == "labels" else feeds.whole_weights
        t = tf.cast(whole[int(e.producer.split("[")[1].rstrip("]"))], e.dtype)
        chain = [rdma_send(run.fwd[(e.name, 0)], t, e.name, chain)]
    return chain


def _receive(run: Pipeline, feeds: Feeds, m: int, chain: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Micro-batch m's activations (and data, labels) from the other stages. Labels and sample weights come once
    a step, the whole batch's, at the first micro-batch; each micro-batch takes its rows of them."""
    received: dict[str, Any] = {}
    run_of: list[Any] = []  # consecutive edges with a transfer per micro-batch: received in one hop

    def flush(chain: list[Any]) -> list[Any]:
        if run_of:
            specs = [(e.shape, e.dtype) for e in run_of]
            outs = rdma_recv_all([run.fwd[(e.name, m)] for e in run_of], specs, f"{run_of[0].name}/{m}", chain)
            received.update(zip([e.name for e in run_of], outs, strict=True))
            chain = outs[-1:]
            run_of.clear()
        return chain

    for e in run.stage_for(m).received:
        if e.transfers == 1 and run.plan.micro_batches > 1:
            chain = flush(chain)
            if m == 0:
                t = rdma_recv(run.fwd[(e.name, 0)], e.shape, e.dtype, e.name, chain)
                feeds.split_received[e.name] = feeds.split(t)
                chain = [t]
            received[e.name] = feeds.split_received[e.name][m]
            continue
        run_of.append(e)
    return received, flush(chain)


def _send_outputs(run: Pipeline, stage: Stage, m: int, outs: list[Any], chain: list[Any]) -> list[Any]:
    """Micro-batch m's activations (and outputs) to the stages that consume them, in one hop."""
    sent = [(e, outs[pos]) for pos, edges in enumerate(stage.sends) for e in edges]
    if not sent:
        return chain
    senders = [run.fwd[(e.name, m)] for e, _ in sent]
    return [rdma_send_all(senders, [t for _, t in sent], f"{sent[0][0].name}/{m}", chain)]


def _or_zeros(gradient: Any, variable: Any) -> Any:
    """A summed gradient, or zeros where no micro-batch of this worker's reached the variable."""
    import tensorflow as tf

    if gradient is None:
        return tf.zeros(variable.shape, variable.dtype)
    return tf.convert_to_tensor(gradient)  # (an IndexedSlices made dense: the pair's sum is)


def _sum(total: Any, loss: Any) -> Any:
    """A running sum of micro-batches' losses (None: none yet; a stage without the loss adds None)."""
    return loss if total is None else total if loss is None else total + loss


def _computed(*tensors: Any) -> Any:
    """An op that runs once all of `tensors` (nested lists, Nones skipped) exist."""
    import keras
    import tensorflow as tf

    flat = [t for t in keras.tree.flatten(list(tensors)) if t is not None]
    return tf.group(*[t.values if isinstance(t, tf.IndexedSlices) else t for t in flat])


def _regularization(stage: Stage, micro_batches: int) -> Any:
    import tensorflow as tf

    if stage.model is None or not stage.model.losses:
        return None
    return tf.add_n(stage.model.losses) / micro_batches
