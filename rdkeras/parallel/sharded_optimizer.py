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
from rdkeras.fitting.saving import variables_bytes
from rdkeras.parallel.collectives import Collectives, GradientAllreduce
from rdkeras.parallel.piece_gradients import (
    clipping,
    elements,
    moving_average,
    slots_by_variable,
    step_copy,
    summed_over_workers,
    unclipped_copy,
    values_of,
)

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
        sparse_as_dense: An Embedding's gradient exchanged and applied as a dense tensor (Horovod's switch).
    """

    def __init__(
        self,
        collectives: Collectives,
        optimizer: Any,
        mode: str,
        average: GradientAllreduce | None,
        sparse_as_dense: bool = False,
    ):
        if keras_internals.inner_optimizer(optimizer) is not optimizer:
            raise TypeError("a sharded update takes a LossScaleOptimizer's inner optimizer")
        if getattr(optimizer, "loss_scale_factor", None):
            raise NotImplementedError(
                f"shard={mode!r} does not run with loss_scale_factor yet: use shard='none' for this optimizer, or "
                "mixed precision's LossScaleOptimizer"
            )
        if mode not in SHARDS[1:]:
            raise ValueError(f"a sharded update shards 'optimizer' or 'gradients', got {mode!r}")
        self.collectives, self.optimizer, self.mode, self.average = collectives, optimizer, mode, average
        self.sparse_as_dense = sparse_as_dense
        self._rows = GradientAllreduce(collectives)  # "gradients": an Embedding's rows, gathered
        self._groups: list[_Group] = []
        self._planned: tuple[int, ...] = ()
        self._copy: Any = None
        self._variables: list[Any] = []
        self._accumulators: list[Any] = []  # per piece: its gradient_accumulator (gradient_accumulation_steps)
        self._averages: list[Any] = []  # per piece: its moving average (use_ema)
        keras_internals.build_without_slots(optimizer)
        keras_internals.override(optimizer, "finalize_variable_values", lambda _o, _variables: self.finalize())

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
            copy = unclipped_copy(self.optimizer)
            keras_internals.decide_weight_decay(copy, decisions)
            pieces = [p for g in groups for p in g.pieces]
            copy.build(pieces)
            # Built with the accumulators and moving averages Keras would make (named as its, for files), which
            # `apply` drives itself: Keras clips the accumulated gradient, by whole variables' norms.
            copy.gradient_accumulation_steps, copy.use_ema = None, False
            slots = slots_by_variable(copy, pieces)
            self._accumulators = [slots.get((k, "gradient_accumulator")) for k in range(len(pieces))]
            self._averages = [slots.get((k, "average")) for k in range(len(pieces))]
        self._groups, self._copy, self._planned, self._variables = groups, copy, key, list(variables)

    @property
    def groups(self) -> list[_Group]:
        return self._groups

    @property
    def variables(self) -> list[Any]:
        """The variables the update was planned for (none before its first step or :meth:`plan`)."""
        return self._variables

    def plan(self, variables: Sequence[Any]) -> None:
        """Lays out and builds the shards for `variables` now (the first step would; a restore needs them)."""
        self._plan(variables)

    @property
    def copy(self) -> Any:
        """The optimizer that updates this worker's pieces (None before the first step or :meth:`plan`)."""
        return self._copy

    def shard_slots(self) -> dict[tuple[int, str], np.ndarray]:
        """This worker's shard of each per-variable slot ("momentum", ...), by (dtype group, slot name): the
        slot's values of the pieces it owns, end to end, padded to the shard's length."""
        pieces = [p for g in self._groups for p in g.pieces]
        mine = slots_by_variable(self._copy, pieces) if self._copy is not None else {}
        out, first = {}, 0  # first: the group's first piece
        for g, group in enumerate(self._groups):
            for name in sorted({name for _, name in mine}):
                shard, at = np.zeros(group.per, group.dtype), 0
                for k in range(len(group.pieces)):
                    values = np.reshape(np.asarray(mine[(first + k, name)].numpy()), -1)
                    shard[at : at + values.size] = values
                    at += values.size
                out[(g, name)] = shard
            first += len(group.pieces)
        return out

    def restore(self, read: Any) -> None:
        """Sets each slot of the pieces this worker owns to ``read(variable position, lo, hi, slot name)``: the
        values of elements [lo, hi) of that variable's slot (a checkpoint's, whatever its layout)."""
        pieces = [p for g in self._groups for p in g.pieces]
        owned = [(i, lo, hi) for g in self._groups for i, lo, hi in g.owned]
        for (k, name), slot in slots_by_variable(self._copy, pieces).items():
            i, lo, hi = owned[k]
            slot.assign(np.asarray(read(i, lo, hi, name), slot.dtype))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this worker holds (its copy's variables)."""
        if self._copy is None:
            return 0
        return variables_bytes(self._copy.variables)

    # -- a step ------------------------------------------------------------------------------

    def apply(self, optimizer: Any, base: Any, grads: list, variables: Any) -> None:
        import tensorflow as tf

        variables = list(variables) if variables is not None else keras_internals.tracked_variables(optimizer)
        if not optimizer.built:
            optimizer.build(variables)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if self.average is not None:
            grads = self.average(grads)  # whole: dense averaged, an Embedding's rows gathered
        else:  # an Embedding's rows gathered (small: the rows a batch touched); the dense ones reduce-scattered below
            rows = self._rows([g if isinstance(g, tf.IndexedSlices) else None for g in grads])
            grads = [r if isinstance(g, tf.IndexedSlices) else g for g, r in zip(grads, rows, strict=True)]
        self._plan(variables)
        shards = {} if self.mode == "optimizer" else {id(g): self._reduce_scatter(g, grads) for g in self._groups}
        for group in self._groups:
            for (i, lo, hi), piece in zip(group.owned, group.pieces, strict=True):
                piece.assign(tf.reshape(variables[i], [-1])[lo:hi])
        present = [g is not None for g in grads]
        steps = self.optimizer.gradient_accumulation_steps
        if steps:
            self._accumulated(optimizer, self._piece_gradients(grads, shards, [None] * len(grads)), present)
        else:
            transform = clipping(self.optimizer, present, lambda: self._squared_norms(grads, shards))
            self._step(optimizer, self._piece_gradients(grads, shards, transform))
        if self._ema():
            moving_average(optimizer, self._pieces(), self._averages)
        # Every piece holds its variable's value, updated or not (or its moving average, written into it): those
        # with a gradient are gathered, or all where something but the update may have changed them.
        which = [True] * len(present) if steps or self._ema() else present
        for group in self._groups:
            self._gather(group, variables, which)
        for v, g in zip(variables, grads, strict=True):
            if g is not None and v.constraint is not None:
                v.assign(v.constraint(v))
        keras_internals.iteration_counter(optimizer).assign_add(1)

    def _ema(self) -> bool:
        return any(a is not None for a in self._averages)

    def _pieces(self) -> list[Any]:
        return [p for g in self._groups for p in g.pieces]

    def _accumulated(self, optimizer: Any, raw: list, present: list[bool]) -> Any:
        """Keras's gradient accumulation on the pieces' gradients `raw`: every ``gradient_accumulation_steps``
        calls, their accumulated mean is clipped (by whole variables' norms) and applied; otherwise accumulated.
        Whether this call updated (a tensor)."""
        import tensorflow as tf

        steps = optimizer.gradient_accumulation_steps
        owners = [i for g in self._groups for i, _, _ in g.owned]
        pairs = list(zip(raw, self._accumulators, strict=True))

        def update() -> Any:
            mean = [None if r is None else (tf.convert_to_tensor(r) + a) / steps for r, a in pairs]
            transform = clipping(self.optimizer, present, lambda: self._piece_squares(mean, present))
            self._step(optimizer, [None if m is None else transform[i](m) for i, m in zip(owners, mean, strict=True)])
            for a in self._accumulators:
                a.assign(tf.zeros_like(a))
            return tf.constant(True)

        def accumulate() -> Any:
            for r, a in pairs:
                if r is not None:
                    a.assign_add(tf.convert_to_tensor(r))
            return tf.constant(False)

        calls = keras_internals.iteration_counter(optimizer)
        return tf.cond(tf.equal((calls + 1) % steps, 0), update, accumulate)

    def _step(self, optimizer: Any, piece_grads: list) -> None:
        """The copy's update of the pieces, at the compiled optimizer's iteration and learning rate."""

        step_copy(self._copy, optimizer, piece_grads, self._pieces())

    def finalize(self) -> None:
        """Collective, at the end of ``fit`` (Keras's ``finalize_variable_values``): with ``use_ema``, every
        variable takes its moving average."""
        if self._copy is None or not self._ema():
            return
        for piece, average in zip(self._pieces(), self._averages, strict=True):
            piece.assign(average)
        for group in self._groups:
            self._gather(group, self._variables, [True] * len(self._variables))

    def _piece_gradients(self, grads: list, shards: dict, transform: list) -> list:
        """Each piece's gradient (None where its variable has none), clipped (`transform`, per variable; None: as it
        is): sliced
        from the whole averaged gradient, or from this worker's reduce-scattered shard of them; an Embedding's as
        the IndexedSlices of the piece's elements Keras would apply (duplicates unsummed), unless Keras's clipping
        by the global norm would have made it dense."""
        import tensorflow as tf

        out: list = []
        for group in self._groups:
            for i, lo, hi in group.owned:
                g, clip = grads[i], transform[i] or (lambda t: t)
                if g is None:
                    out.append(None)
                elif isinstance(g, tf.IndexedSlices) and not self._densified():
                    out.append(elements(g, lo, hi, clip))
                elif id(group) in shards and not isinstance(g, tf.IndexedSlices):
                    at = group.offsets[group.indices.index(i)] - group.start
                    out.append(clip(shards[id(group)][at + lo : at + hi]))
                else:
                    out.append(clip(tf.reshape(tf.convert_to_tensor(g), [-1])[lo:hi]))
        return out

    def _densified(self) -> bool:
        """Whether Keras's own clipping turns an IndexedSlices gradient dense (``global_clipnorm`` multiplies it by
        a tensor) before the update sees it."""
        return bool(self.optimizer.global_clipnorm and self.optimizer.global_clipnorm > 0)

    def _reduce_scatter(self, group: _Group, grads: list) -> Any:
        """This worker's shard of the averaged dense gradients of `group` (an Embedding's rows: zeros here)."""
        import tensorflow as tf

        dtype = tf.as_dtype(group.dtype)
        flat = [tf.reshape(grads[i], [-1]) if grads[i] is not None and not isinstance(grads[i], tf.IndexedSlices)
                else tf.zeros([size], dtype) for i, size in zip(group.indices, group.sizes, strict=True)]  # fmt: skip
        size = self.collectives.size * group.per
        parts = [*flat, tf.zeros([size - sum(group.sizes)], dtype)]  # (the buffer's parts: no copy into one first)

        def scatter(*whole: np.ndarray) -> np.ndarray:
            return np.array(self.collectives.reduce_scatter(whole, average=True))

        shard = tf.numpy_function(scatter, parts, dtype, stateful=True, name="rdkeras_reduce_scatter")
        shard.set_shape([group.per])
        return shard

    def _squared_norms(self, grads: list, shards: dict) -> list:
        """Each variable's gradient's sum of squares as Keras takes it -- of an IndexedSlices' rows, duplicates
        unsummed: from the whole gradients, and for the reduce-scattered ones summed over the workers' shards."""
        import tensorflow as tf

        squares = [None if g is None else tf.reduce_sum(tf.square(values_of(g))) for g in grads]
        if not shards:
            return squares
        partial = [tf.zeros([], tf.float64) for _ in grads]
        scattered = set()
        for group in self._groups:
            for i, lo, hi in group.owned:
                if grads[i] is None or isinstance(grads[i], tf.IndexedSlices):
                    continue
                at = group.offsets[group.indices.index(i)] - group.start
                piece = shards[id(group)][at + lo : at + hi]
                partial[i] = partial[i] + tf.cast(tf.reduce_sum(tf.square(piece)), tf.float64)
            scattered |= {
                i for i in group.indices if grads[i] is not None and not isinstance(grads[i], tf.IndexedSlices)
            }

        summed = summed_over_workers(self.collectives, partial)
        return [tf.cast(summed[i], grads[i].dtype) if i in scattered else squares[i] for i in range(len(grads))]

    def _piece_squares(self, piece_grads: list, present: list[bool]) -> list:
        """Each variable's sum of squares from its pieces' (dense) gradients, summed over the workers."""
        import tensorflow as tf

        partial = [tf.zeros([], tf.float64) for _ in present]
        owners = [i for g in self._groups for i, _, _ in g.owned]
        for i, g in zip(owners, piece_grads, strict=True):
            if g is not None:
                partial[i] = partial[i] + tf.cast(tf.reduce_sum(tf.square(g)), tf.float64)
        summed = summed_over_workers(self.collectives, partial)
        return [tf.cast(summed[i], self._variables[i].dtype) if p else None for i, p in enumerate(present)]

    def _gather(self, group: _Group, variables: list, which: list[bool]) -> None:
        """Every worker's updated shard into the variables of `group` (those `which` says)."""
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
            if which[i]:
                variables[i].assign(tf.reshape(whole[at : at + size], variables[i].shape))
