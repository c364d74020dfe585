"""Keras's arithmetic on gradients, reproduced for pieces of variables (rdkeras.parallel.sharded_optimizer): a
clip by norm in Keras's order of operations, the elements of an IndexedSlices gradient that a piece holds, the
values Keras squares for a norm; clipping and moving averages as Keras computes them; and an optimizer's
per-variable state, by variable and slot name."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdkeras import keras_internals


def clip_by_norm(t: Any, clipnorm: float, denominator: Any) -> Any:
    """Keras's ``_clip_by_norm`` arithmetic: ``t * clipnorm / max(norm, clipnorm)``, in that order."""
    import tensorflow as tf

    return t * clipnorm / tf.cast(denominator, t.dtype)


def clipping(optimizer: Any, present: list[bool], squared_norms: Callable[[], list]) -> list:
    """Per variable, what the compiled optimizer's clipping does to its gradient (Keras's arithmetic, from the
    whole gradients' norms, which `squared_norms` gives where needed): a function of a tensor."""
    import tensorflow as tf

    o = optimizer
    same: list[Callable[[Any], Any]] = [lambda t: t] * len(present)
    if o.clipnorm and o.clipnorm > 0:
        squares = squared_norms()
        out: list[Callable[[Any], Any]] = []
        for i, g in enumerate(present):
            if not g:
                out.append(same[i])
                continue
            l2sum = squares[i]
            l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, tf.ones_like(l2sum))), l2sum)
            denominator = tf.maximum(l2norm, tf.cast(o.clipnorm, l2norm.dtype))
            out.append(functools.partial(clip_by_norm, clipnorm=o.clipnorm, denominator=denominator))
        return out
    if o.global_clipnorm and o.global_clipnorm > 0:
        squares = squared_norms()
        norm = tf.sqrt(tf.reduce_sum(tf.stack([squares[i] for i, g in enumerate(present) if g])))
        scale = o.global_clipnorm * tf.minimum(1.0 / norm, 1.0 / o.global_clipnorm)
        scale = scale + (norm - norm)
        return [lambda t: t * tf.cast(scale, t.dtype)] * len(present)
    if o.clipvalue and o.clipvalue > 0:
        return [lambda t: tf.clip_by_value(t, -o.clipvalue, o.clipvalue)] * len(present)
    return same


def moving_average(optimizer: Any, pieces: list, averages: list) -> Any:
    """Keras's ``use_ema`` arithmetic on pieces: each piece's moving average (`averages`) updated every call;
    whether they were written into the pieces (every ``ema_overwrite_frequency`` calls; a tensor)."""
    import tensorflow as tf

    momentum = tf.cast(tf.not_equal(optimizer.iterations, 0), pieces[0].dtype) * optimizer.ema_momentum
    for piece, average in zip(pieces, averages, strict=True):
        average.assign(momentum * average + (1 - momentum) * piece)
    frequency = optimizer.ema_overwrite_frequency
    if not frequency:
        return tf.constant(False)

    def overwrite() -> Any:
        for piece, average in zip(pieces, averages, strict=True):
            piece.assign(average)
        return tf.constant(True)

    return tf.cond(tf.equal((optimizer.iterations + 1) % frequency, 0), overwrite, lambda: tf.constant(False))


def elements(gradient: Any, lo: int, hi: int, transform: Any) -> Any:
    """The IndexedSlices of elements [lo, hi) of a flattened variable that `gradient` (an IndexedSlices of its
    rows) touches, one per row and element as Keras would apply them (duplicates unsummed), values transformed."""
    import tensorflow as tf

    row = int(np.prod(gradient.values.shape[1:]))
    rows = tf.cast(gradient.indices, tf.int64)[:, None] * row + tf.range(row, dtype=tf.int64)[None, :]
    flat, values = tf.reshape(rows, [-1]), tf.reshape(gradient.values, [-1])
    keep = (flat >= lo) & (flat < hi)
    kept = tf.boolean_mask(values, keep)
    return tf.IndexedSlices(transform(kept), tf.boolean_mask(flat, keep) - lo, tf.constant([hi - lo], tf.int64))


def values_of(gradient: Any) -> Any:
    """A dense gradient, or an IndexedSlices' rows (what Keras squares and sums)."""
    import tensorflow as tf

    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def slots_by_variable(optimizer: Any, variables: Sequence[Any]) -> dict[tuple[int, str], Any]:
    """`optimizer`'s per-variable state: (index into `variables`, slot name, e.g. "momentum") -> its variable."""
    slots = {}
    for slot, index in keras_internals.optimizer_slot_references(optimizer, variables):
        if index is not None:
            prefix = variables[index].path.replace("/", "_") + "_"
            slots[(index, slot.name[len(prefix) :])] = slot
    return slots


# -- the optimizers a sharded update keeps beside the compiled one -------------------------------------------


def unclipped_copy(optimizer: Any) -> Any:
    """A new optimizer of `optimizer`'s class and config, without its clipping (the sharded update clips whole
    gradients first), named ``NAME_shard``."""
    config = {**optimizer.get_config(), "clipnorm": None, "global_clipnorm": None, "clipvalue": None}
    return type(optimizer).from_config({**config, "name": f"{optimizer.name}_shard"})


def step_copy(copy: Any, optimizer: Any, grads: list, variables: list) -> None:
    """`copy`'s update of `variables`, at `optimizer`'s update count and learning rate (a callback's too)."""
    import tensorflow as tf

    copy.iterations.assign(optimizer.iterations)  # (the updates so far: a copy does not accumulate)
    if keras_internals.settable_learning_rate(optimizer):  # (a value: a variable would be tracked as the copy's)
        copy.learning_rate = tf.convert_to_tensor(optimizer.learning_rate)
    copy.apply(grads, variables)


def plain_optimizer(optimizer: Any, variables: Sequence[Any]) -> Any:
    """An optimizer of `optimizer`'s class and config built on `variables`, at its call count and learning rate
    (its slots initial): what a file written whole holds, once the shards fill the slots."""
    full = type(optimizer).from_config(optimizer.get_config())
    full.build(list(variables))
    keras_internals.iteration_counter(full).assign(keras_internals.iteration_counter(optimizer))
    if keras_internals.settable_learning_rate(optimizer):
        full.learning_rate = np.asarray(optimizer.learning_rate)
    return full


def summed_over_workers(collectives: Any, partial: list) -> Any:
    """The float64 scalar tensors `partial`, each summed over the workers of `collectives` (one allreduce)."""
    import tensorflow as tf

    def total(values: np.ndarray) -> np.ndarray:
        (summed,) = collectives.allreduce([values], average=False, purpose="norms")
        return np.array(summed)

    summed = tf.numpy_function(total, [tf.stack(partial)], tf.float64, stateful=True, name="rdkeras_norms")
    summed.set_shape([len(partial)])
    return summed
