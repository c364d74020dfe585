"""Sharded data parallelism (ZeRO stages 1 and 2, arXiv 1910.02054): each worker keeps the optimizer state of
its 1/N of the parameters only.

The trainable variables of one dtype lie end to end in one flat buffer, split into N equal shards
(:meth:`Collectives.shard_elements`); worker p owns shard p. A copy of the compiled optimizer, built on *pieces*
(1-D variables holding the owned part of each variable the shard touches), updates only those. A step:

1. the gradients are averaged whole (``shard="optimizer"``: today's allreduce, overlapped with backprop) or
   reduce-scattered, so that a worker receives only its shard of the average (``shard="gradients"``);
2. they are clipped as Keras clips: ``clipnorm`` per variable and ``global_clipnorm`` by the norms of whole
   gradients (with sharded gradients, the pieces' sums of squares summed over the workers), ``clipvalue``
   element-wise;
3. the pieces take their variables' current values (the model's variables stay the truth: ``set_weights``, a
   restored checkpoint), and the copy applies its update to them, at the compiled optimizer's iteration and
   learning rate (weight decay as the compiled optimizer decides per variable);
4. the updated shards are allgathered into every worker's variables; constraints apply to whole variables.

The compiled optimizer builds none of its per-variable state (:func:`keras_internals.build_without_slots`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras._log import logger
from rdkeras.parallel.collectives import Collectives, GradientAllreduce

SHARDS = ("none", "optimizer", "gradients")


@dataclasses.dataclass
class _Group:
    """The variables of one dtype, end to end: where each starts, and the pieces of them this worker owns."""

    dtype: str
    indices: list[int]  # into the variables `apply` updates
    offsets: list[int]  # flat start of each
    sizes: list[int]
    per: int  # elements of each worker's shard
    start: int  # this worker's shard: [start, start + per)
    owned: list[tuple[int, int, int]]  # (index into the variables, lo, hi): the part of it in this shard
    pieces: list[Any]  # a 1-D variable per owned part


class ShardedUpdate:
    """The compiled `optimizer`'s ``apply`` as a sharded update over `collectives` (see the module).

    Args:
        collectives: The data-parallel workers' collectives.
        optimizer: The optimizer that updates the variables (a LossScaleOptimizer's inner one: its finite check
            and unscaling come first, see ``DataParallel._shard_optimizer``).
        mode: "optimizer" (the optimizer state sharded) or "gradients" (the gradients too).
        average: "optimizer": the allreduce that averages whole gradients.
    """

    def __init__(self, collectives: Collectives, optimizer: Any, mode: str, average: GradientAllreduce | None):
        refused = {
            "gradient_accumulation_steps": getattr(optimizer, "gradient_accumulation_steps", None),
            "use_ema": getattr(optimizer, "use_ema", False),
            "loss_scale_factor": getattr(optimizer, "loss_scale_factor", None),
        }
        given = [name for name, value in refused.items() if value]
        if keras_internals.inner_optimizer(optimizer) is not optimizer:
            raise TypeError("a sharded update takes a LossScaleOptimizer's inner optimizer")
        if given:
            raise NotImplementedError(
                f"shard={mode!r} does not run with {', '.join(given)} yet: use shard='none' for this optimizer"
            )
        if mode not in SHARDS[1:]:
            raise ValueError(f"a sharded update shards 'optimizer' or 'gradients', got {mode!r}")
        self.collectives, self.optimizer, self.mode, self.average = collectives, optimizer, mode, average
        self._groups: list[_Group] = []
        self._planned: tuple[int, ...] = ()
        self._copy: Any = None
        self._variables: list[Any] = []
        keras_internals.build_without_slots(optimizer)
        keras_internals.before_saving(optimizer, self._saved_in_part)
        self._warned = False

    def _saved_in_part(self) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                f"shard={self.mode!r}: a file saved by Keras on one worker holds the optimizer's iteration and "
                "learning rate, not its sharded state; RDMAStrategy.export(model, path) on every worker writes it whole"
            )

    # -- the plan: layout, pieces and the optimizer's copy, made once per set of variables -----------------

    def _plan(self, variables: Sequence[Any]) -> None:
        key = tuple(id(v) for v in variables)
        if key == self._planned:
            return
        import keras
        import tensorflow as tf

        with tf.init_scope():  # eagerly, also while fit traces its step
            by_dtype: dict[str, list[int]] = {}
            for i, v in enumerate(variables):
                by_dtype.setdefault(np.dtype(v.dtype).name, []).append(i)
            groups, decisions = [], []
            for dtype, indices in by_dtype.items():
                if dtype not in ("float32", "float64"):
                    raise TypeError(f"shard={self.mode!r}: variable {variables[indices[0]].path} is {dtype}")
                sizes = [int(np.prod(variables[i].shape)) for i in indices]
                offsets = list(np.cumsum([0, *sizes[:-1]]))
                per = self.collectives.shard_elements(sum(sizes), dtype)
                start = self.collectives.position * per
                owned, pieces = [], []
                for i, at, size in zip(indices, offsets, sizes, strict=True):
                    lo, hi = max(start, at) - at, min(start + per, at + size) - at
                    if lo >= hi:
                        continue
                    v = variables[i]
                    # Named by the variable's path, so the copy's slots name the variable they belong to.
                    value = np.reshape(np.asarray(v.numpy()), -1)[lo:hi]
                    piece = keras.Variable(value, dtype=dtype, name=v.path.replace("/", "_"))
                    owned.append((i, int(lo), int(hi)))
                    pieces.append(piece)
                    decisions.append((piece, keras_internals.uses_weight_decay(self.optimizer, v)))
                groups.append(_Group(dtype, indices, [int(o) for o in offsets], sizes, per, start, owned, pieces))
            config = {**self.optimizer.get_config(), "clipnorm": None, "global_clipnorm": None, "clipvalue": None}
            copy = type(self.optimizer).from_config({**config, "name": f"{self.optimizer.name}_shard"})
            keras_internals.decide_weight_decay(copy, decisions)
            copy.build([p for g in groups for p in g.pieces])
        self._groups, self._copy, self._planned, self._variables = groups, copy, key, list(variables)

    def consolidated(self) -> Any:
        """Collective: a plain optimizer of the compiled one's class and config, built on the variables it updates,
        holding the whole state the workers' shards hold between them -- what one process's optimizer would hold.
        For a file written whole (``RDMAStrategy.export``); every worker gets it."""
        optimizer, variables = self.optimizer, self._variables
        full = type(optimizer).from_config(optimizer.get_config())
        full.build(variables)
        full.iterations.assign(optimizer.iterations)
        if keras_internals.settable_learning_rate(optimizer):
            full.learning_rate = np.asarray(optimizer.learning_rate)
        if self._copy is None:
            return full  # (never stepped: the state is the initial one)
        slots = _slots_by_variable(full, variables)
        pieces = [p for g in self._groups for p in g.pieces]
        mine = _slots_by_variable(self._copy, pieces)
        names = sorted({name for _, name in slots})
        first = 0  # the group's first piece
        for group in self._groups:
            for name in names:
                shard = np.zeros(group.per, group.dtype)
                at = 0
                for k in range(len(group.pieces)):
                    values = np.reshape(np.asarray(mine[(first + k, name)].numpy()), -1)
                    shard[at : at + values.size] = values
                    at += values.size
                whole = self.collectives.allgather(shard, purpose="export")
                for i, offset, size in zip(group.indices, group.offsets, group.sizes, strict=True):
                    if (i, name) in slots:
                        slots[(i, name)].assign(np.reshape(whole[offset : offset + size], variables[i].shape))
            first += len(group.pieces)
        return full

    def state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds (its copy's variables)."""
        if self._copy is None:
            return 0
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in self._copy.variables)

    # -- a step ------------------------------------------------------------------------------

    def apply(self, optimizer: Any, base: Any, grads: list, variables: Any) -> None:
        import tensorflow as tf

        variables = list(variables) if variables is not None else keras_internals.tracked_variables(optimizer)
        if not optimizer.built:
            optimizer.build(variables)
        if self.average is not None:
            grads = self.average(grads)
        self._plan(variables)
        exchanged = grads  # averaged (an Embedding's as the IndexedSlices one process has), or this worker's own
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # (an Embedding's rows: dense)
        piece_grads = self._piece_gradients(grads)
        piece_grads = self._clip(exchanged, piece_grads)
        pieces = [p for g in self._groups for p in g.pieces]
        for group in self._groups:
            for (i, lo, hi), piece in zip(group.owned, group.pieces, strict=True):
                piece.assign(tf.reshape(variables[i], [-1])[lo:hi])
        copy = self._copy
        copy.iterations.assign(optimizer.iterations)
        if keras_internals.settable_learning_rate(optimizer):  # (a value: a variable would be tracked as the copy's)
            copy.learning_rate = tf.convert_to_tensor(optimizer.learning_rate)
        copy.apply(piece_grads, pieces)
        for group in self._groups:
            self._gather(group, variables, grads)
        for v, g in zip(variables, grads, strict=True):
            if g is not None and v.constraint is not None:
                v.assign(v.constraint(v))
        optimizer.iterations.assign_add(1)

    def _piece_gradients(self, grads: list) -> list:
        """Each piece's gradient (None where its variable has none): sliced from the whole averaged gradient, or
        from this worker's reduce-scattered shard of them."""
        import tensorflow as tf

        out: list = []
        for group in self._groups:
            if self.mode == "optimizer":
                out += [None if grads[i] is None else tf.reshape(grads[i], [-1])[lo:hi] for i, lo, hi in group.owned]
                continue
            shard = self._reduce_scatter(group, grads)
            for i, lo, hi in group.owned:
                at = group.offsets[group.indices.index(i)] - group.start
                out.append(None if grads[i] is None else shard[at + lo : at + hi])
        return out

    def _reduce_scatter(self, group: _Group, grads: list) -> Any:
        import tensorflow as tf

        dtype = tf.as_dtype(group.dtype)
        flat = [tf.reshape(grads[i], [-1]) if grads[i] is not None else tf.zeros([size], dtype)
                for i, size in zip(group.indices, group.sizes, strict=True)]  # fmt: skip
        size = self.collectives.size * group.per
        padded = tf.concat([*flat, tf.zeros([size - sum(group.sizes)], dtype)], 0)

        def scatter(whole: np.ndarray) -> np.ndarray:
            return np.array(self.collectives.reduce_scatter(whole, average=True))

        shard = tf.numpy_function(scatter, [padded], dtype, stateful=True, name="rdkeras_reduce_scatter")
        shard.set_shape([group.per])
        return shard

    def _clip(self, grads: list, piece_grads: list) -> list:
        """`piece_grads` clipped as the compiled optimizer clips whole gradients (Keras's arithmetic); `grads`:
        the averaged gradients ("optimizer") or this worker's own ("gradients")."""
        import tensorflow as tf

        o = self.optimizer
        if o.clipvalue and o.clipvalue > 0 and not (o.clipnorm or o.global_clipnorm):
            return [None if g is None else tf.clip_by_value(g, -o.clipvalue, o.clipvalue) for g in piece_grads]
        if not ((o.clipnorm and o.clipnorm > 0) or (o.global_clipnorm and o.global_clipnorm > 0)):
            return piece_grads
        squares = self._squared_norms(grads, piece_grads)  # per variable
        owners = [i for group in self._groups for i, _, _ in group.owned]
        if o.clipnorm and o.clipnorm > 0:
            out: list = []
            for g, i in zip(piece_grads, owners, strict=True):
                if g is None:
                    out.append(None)
                    continue
                l2sum = tf.cast(squares[i], g.dtype)
                l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, tf.ones_like(l2sum))), l2sum)
                out.append(g * o.clipnorm / tf.maximum(l2norm, tf.cast(o.clipnorm, g.dtype)))
            return out
        present = [squares[i] for i, g in enumerate(grads) if g is not None]
        norm = tf.sqrt(tf.reduce_sum(tf.stack(present)))
        scale = o.global_clipnorm * tf.minimum(1.0 / norm, 1.0 / o.global_clipnorm)
        scale = scale + (norm - norm)
        return [None if g is None else g * tf.cast(scale, g.dtype) for g in piece_grads]

    def _squared_norms(self, grads: list, piece_grads: list) -> list:
        """Each variable's gradient's sum of squares as Keras takes it -- of an IndexedSlices' rows, duplicates
        unsummed: from the averaged gradients, or summed over the workers' pieces and rows (in float64)."""
        import tensorflow as tf

        if self.mode == "optimizer":
            return [None if g is None else tf.reduce_sum(tf.square(_values(g))) for g in grads]
        partial = [tf.zeros([], tf.float64) for _ in grads]
        owners = [i for group in self._groups for i, _, _ in group.owned]
        sparse = {i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
        for g, i in zip(piece_grads, owners, strict=True):
            if g is not None and i not in sparse:
                partial[i] = partial[i] + tf.cast(tf.reduce_sum(tf.square(g)), tf.float64)
        for i in sparse:  # this worker's rows of the global batch's IndexedSlices (averaged: / N)
            rows = grads[i].values / tf.cast(self.collectives.size, grads[i].values.dtype)
            partial[i] = tf.cast(tf.reduce_sum(tf.square(rows)), tf.float64)

        def total(values: np.ndarray) -> np.ndarray:
            (summed,) = self.collectives.allreduce([values], average=False, purpose="norms")
            return np.array(summed)

        summed = tf.numpy_function(total, [tf.stack(partial)], tf.float64, stateful=True, name="rdkeras_norms")
        summed.set_shape([len(grads)])
        return [tf.cast(summed[i], g.dtype) if g is not None else None for i, g in enumerate(grads)]

    def _gather(self, group: _Group, variables: list, grads: list) -> None:
        """Every worker's updated shard into the variables of `group` (those with a gradient)."""
        import tensorflow as tf

        dtype = tf.as_dtype(group.dtype)
        mine = [tf.reshape(p, [-1]) for p in group.pieces]
        used = sum(hi - lo for _, lo, hi in group.owned)
        shard = tf.concat([*mine, tf.zeros([group.per - used], dtype)], 0)

        def gather(values: np.ndarray) -> np.ndarray:
            return np.array(self.collectives.allgather(values))

        whole = tf.numpy_function(gather, [shard], dtype, stateful=True, name="rdkeras_allgather")
        whole.set_shape([self.collectives.size * group.per])
        for i, at, size in zip(group.indices, group.offsets, group.sizes, strict=True):
            if grads[i] is not None:
                variables[i].assign(tf.reshape(whole[at : at + size], variables[i].shape))


def _values(gradient: Any) -> Any:
    """A dense gradient, or an IndexedSlices' rows (what Keras squares and sums)."""
    import tensorflow as tf

    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _slots_by_variable(optimizer: Any, variables: Sequence[Any]) -> dict[tuple[int, str], Any]:
    """`optimizer`'s per-variable state: (index into `variables`, slot name, e.g. "momentum") -> its variable."""
    slots = {}
    for slot, index in keras_internals.optimizer_slot_references(optimizer, variables):
        if index is not None:
            prefix = variables[index].path.replace("/", "_") + "_"
            slots[(index, slot.name[len(prefix) :])] = slot
    return slots
