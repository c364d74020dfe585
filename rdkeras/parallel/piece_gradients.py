"""Keras's arithmetic on gradients, reproduced for pieces of variables (rdkeras.parallel.sharded_optimizer): a
clip by norm in Keras's order of operations, the elements of an IndexedSlices gradient that a piece holds, the
values Keras squares for a norm; and an optimizer's per-variable state, by variable and slot name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras import keras_internals


def clip_by_norm(t: Any, clipnorm: float, denominator: Any) -> Any:
    """Keras's ``_clip_by_norm`` arithmetic: ``t * clipnorm / max(norm, clipnorm)``, in that order."""
    import tensorflow as tf

    return t * clipnorm / tf.cast(denominator, t.dtype)


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
