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
