"""Sharded parameters (ZeRO stage 3, arXiv 1910.02054; PyTorch's FSDP): each worker stores only its 1/N of each
layer's trainable weights, and of their optimizer state.

A *unit* is a layer that owns trainable variables; its variables lie end to end in one flat buffer, split into N
equal shards (:meth:`Collectives.shard_elements`), worker p owning shard p. Each variable's storage becomes its
*piece*: a 1-D TensorFlow variable holding the part of it in this worker's shard (possibly none). Then:

1. each call of a unit allgathers its shards into whole values, and runs the layer's own ``call`` on them (a
   ``keras.StatelessScope``); the gather's gradient is a reduce-scatter, so backprop leaves each piece the
   average over the workers of its part of the gradient, layer by layer, as it goes;
2. the compiled optimizer's ``apply`` clips those as Keras clips whole gradients (the pieces' sums of squares
   summed over the workers) and a copy of it, built on the pieces, updates them: nothing is gathered after;
3. whatever reads whole weights outside a step -- ``get_weights``, ``RDMAStrategy.export`` and checkpoints --
   gathers them (collective: every worker calls it).

The weights are laid out when ``fit`` starts, once every worker holds the chief's.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras.fitting.saving import variables_bytes
from rdkeras.parallel.collectives import Collectives, allgather_in_calls, reduce_scatter_in_calls
from rdkeras.parallel.memory import trim_free_lists
from rdkeras.parallel.piece_gradients import (
    clipping,
    elements,
    plain_optimizer,
    slots_by_variable,
    step_copy,
    summed_over_workers,
    unclipped_copy,
    values_of,
)


@dataclasses.dataclass
class _Unit:
    """A layer's trainable variables, end to end, and the piece of each this worker stores."""

    layer: Any
    variables: list[Any]
    sizes: list[int]
    offsets: list[int]
    per: int  # elements of each worker's shard
    owned: list[tuple[int, int]]  # per variable: the [lo, hi) of it in this worker's shard (lo == hi: none)
    pieces: list[Any]  # per variable: a Keras variable sharing its storage, shape [hi - lo]
    dtype: str  # the variables' (read once: a Keras variable's dtype is the compute dtype under autocast)


class ShardedParameters:
    """The sharded weights and update of one model (see the module).

    Args:
        collectives: The data-parallel workers' collectives.
        model: The compiled model; its optimizer (a LossScaleOptimizer's inner one) is the one whose ``apply`` this
            runs.
    """

    def __init__(self, collectives: Collectives, model: Any):
        optimizer = keras_internals.inner_optimizer(model.optimizer)  # (a LossScaleOptimizer checks, then calls it)
        refused = [name for name in ("gradient_accumulation_steps", "use_ema", "loss_scale_factor")
                   if getattr(optimizer, name, None)]  # fmt: skip
        for v in model.trainable_variables:
            if v.constraint is not None or getattr(v, "regularizer", None) is not None:
                refused.append(f"a constraint or regularizer ({v.path})")
                break
        if refused:
            raise NotImplementedError(
                f"shard='parameters' does not run with {', '.join(refused)} yet: use shard='gradients'"
            )
        self.collectives, self.model, self.optimizer = collectives, model, optimizer
        self.units: list[_Unit] = []
        self._copy: Any = None
        self._whole = False
        self._ticket: Any = None  # the last gather's or scatter's ticket (:meth:`_in_line`)
        keras_internals.build_without_slots(optimizer)

    @property
    def sharded(self) -> bool:
        """Whether the variables hold only this worker's pieces now (not before fit lays them out, nor inside
        :meth:`whole`)."""
        return bool(self.units) and not self._whole

    def is_sharded(self, variable: Any) -> bool:
        return any(variable is v for unit in self.units for v in unit.variables)

    # -- laying the weights out: once, when every worker holds the chief's --------------------------------

    def shard(self) -> None:
        """Each unit's variables stored as this worker's pieces from now on, its calls gathering them."""
        if self.units:
            return
        import keras
        import tensorflow as tf

        trainable = {id(v) for v in self.model.trainable_variables}
        position, decisions = self.collectives.position, []
        # Garbage in reference cycles (graphs traced before) holds the whole variables: collected now, each one is
        # freed as its piece replaces it. Else a worker held the whole model beside its pieces and their slots
        # until a later collection (1.2 GB at 168 M parameters), and oneDNN's allocator keeps what it touched.
        gc.collect()
        with tf.init_scope():
            for layer in keras_internals.layers_owning_variables(self.model):
                variables = [v for v in keras_internals.own_trainable_variables(layer) if id(v) in trainable]
                if not variables:
                    continue
                if len({np.dtype(v.dtype).name for v in variables}) > 1 or np.dtype(variables[0].dtype).name not in (
                    "float32", "float64"):  # fmt: skip
                    raise TypeError(f"shard='parameters': layer {layer.name} holds variables of several dtypes")
                sizes = [int(np.prod(v.shape)) for v in variables]
                offsets = [int(o) for o in np.cumsum([0, *sizes[:-1]])]
                per = self.collectives.shard_elements(sum(sizes), variables[0].dtype)
                start = position * per
                owned, pieces = [], []
                for v, at, size in zip(variables, offsets, sizes, strict=True):
                    lo, hi = max(start, at) - at, min(start + per, at + size) - at
                    lo, hi = (lo, hi) if lo < hi else (0, 0)
                    storage = tf.Variable(_part(v.numpy(), lo, hi), trainable=True, name=v.name)
                    keras_internals.set_storage(v, storage)
                    piece = keras.Variable(storage, name=v.path.replace("/", "_"))
                    owned.append((int(lo), int(hi)))
                    pieces.append(piece)
                    decisions.append((piece, keras_internals.uses_weight_decay(self.optimizer, v)))
                unit = _Unit(layer, variables, sizes, offsets, per, owned, pieces, np.dtype(variables[0].dtype).name)
                # A gathered unit kept for its backward would hold the whole model by the end of the forward
                # pass: where a rerun changes nothing, the backward pass gathers it again (FSDP's reshard).
                gather = functools.partial(self._gather, unit)
                recompute = keras_internals.only_own_trainable_state(layer)
                keras_internals.call_with_values(layer, variables, gather, recompute=recompute)
                self.units.append(unit)
            self._copy = unclipped_copy(self.optimizer)
            keras_internals.decide_weight_decay(self._copy, decisions)
            self._copy.build(self._pieces())

    def _pieces(self) -> list[Any]:
        return [p for unit in self.units for p in unit.pieces]

    def _gather(self, unit: _Unit, inputs: list[Any]) -> list[Any]:
        """The unit's whole values (tensors), gathered from every worker's shard once its call's `inputs` are
        computed; their gradient is reduce-scattered back into the pieces' gradients."""
        import tensorflow as tf

        dtype, n = tf.as_dtype(unit.dtype), self.collectives.size
        padding = np.zeros(unit.per - sum(hi - lo for lo, hi in unit.owned), unit.dtype)  # (made once, read only)

        @tf.custom_gradient
        def gathered(*pieces: Any) -> Any:
            def allgather(*parts: np.ndarray) -> np.ndarray:  # (a fresh array: backprop reads the values again)
                # The shard is read from the pieces here, where they lie, not put together as a tensor: the
                # executor would compute every unit's as soon as the step starts and keep them all until their turns.
                return allgather_in_calls(self.collectives, [*parts, padding], "parameters")

            # Not before the call's inputs: a gather needs only the pieces, so a traced step would otherwise run
            # every unit's at its start and hold the whole model until each unit computes.
            whole = self._in_line(allgather, list(pieces), "rdkeras_gather_parameters", after=inputs, returns=1)
            whole.set_shape([n * unit.per])
            values = [tf.reshape(whole[at : at + size], v.shape)
                      for v, at, size in zip(unit.variables, unit.offsets, unit.sizes, strict=True)]  # fmt: skip

            def scatter(*upstream: Any) -> list[Any]:
                if len(upstream) == 1 and isinstance(upstream[0], tf.IndexedSlices):  # an Embedding's lookup
                    return self._rows_in_piece(upstream[0], *unit.owned[0])
                flat = [tf.zeros([size], dtype) if g is None else tf.reshape(tf.convert_to_tensor(g), [-1])
                        for g, size in zip(upstream, unit.sizes, strict=True)]  # fmt: skip
                padding = tf.zeros([n * unit.per - sum(unit.sizes)], dtype)

                def reduce_scatter(*parts: np.ndarray) -> np.ndarray:  # (read where they lie: no padded copy)
                    return reduce_scatter_in_calls(self.collectives, parts, "parameter-grads")

                mine = self._in_line(reduce_scatter, [*flat, padding], "rdkeras_scatter_grads", returns=1)
                mine.set_shape([unit.per])
                out, at = [], 0
                for lo, hi in unit.owned:
                    out.append(mine[at : at + hi - lo])
                    at += hi - lo
                return out

            return values, scatter

        return list(gathered(*[tf.convert_to_tensor(keras_internals.storage(v)) for v in unit.variables]))

    def _rows_in_piece(self, rows: Any, lo: int, hi: int) -> list[Any]:
        """An Embedding's gradient as one process's optimizer gets it: every worker's rows gathered (duplicates
        unsummed, which Adam's moments see), as the IndexedSlices of the elements in this worker's piece."""
        import tensorflow as tf

        n = self.collectives.size

        def gather(values: np.ndarray, indices: np.ndarray) -> list[np.ndarray]:
            values, indices = self.collectives.gather_rows_many([values, indices])
            return [values / values.dtype.type(n), indices]

        values, indices = self._in_line(gather, [rows.values, tf.cast(rows.indices, tf.int64)], "rdkeras_gather_rows")
        values.set_shape([None, *rows.values.shape[1:]])
        indices.set_shape([None])
        gathered = tf.IndexedSlices(values, tf.cast(indices, rows.indices.dtype), rows.dense_shape)
        return [elements(gathered, lo, hi, lambda t: t)]

    def _in_line(
        self, collective: Any, values: Any, name: str, after: Sequence[Any] = (), returns: int | None = None
    ) -> Any:
        """``collective(values)`` (a gather or a scatter; `values` a tensor, or a list the collective takes and
        returns as many of, or `returns` of the first's dtype) as a TensorFlow op run after the previous one made
        in this graph, and after the tensors `after`: every worker runs them in the order they were made. The
        order is a data dependency (a ticket output, the next one's input): Grappler's dependency optimizer
        rewired control dependencies around a unit recomputed in backprop until workers ran different
        collectives."""
        import tensorflow as tf

        inputs = values if isinstance(values, list) else [values]
        dtypes = [v.dtype for v in inputs] if returns is None else [inputs[0].dtype] * returns
        many = len(dtypes) > 1 or (returns is None and isinstance(values, list))

        first = not tf.executing_eagerly() and not self._previous_ticket()  # a traced step's first collective

        def run(*arrays: np.ndarray) -> list[np.ndarray]:
            nonlocal first
            if first:  # its first run: what tracing the step left in malloc's free lists goes back
                first = False
                trim_free_lists()
            out = collective(*arrays[: len(inputs)])
            return [*(out if many else [out]), np.zeros([], np.int32)]

        if tf.executing_eagerly():
            *outs, _ = tf.numpy_function(run, inputs, [*dtypes, tf.int32], stateful=True, name=name)
            return outs if many else outs[0]
        graph = inputs[0].graph
        with tf.control_dependencies([t for t in after if getattr(t, "graph", None) is graph]):
            *outs, ticket = tf.numpy_function(run, [*inputs, *self._previous_ticket()], [*dtypes, tf.int32],
                                              stateful=True, name=name)  # fmt: skip
        self._ticket = ticket
        return outs if many else outs[0]

    def _previous_ticket(self) -> list[Any]:
        """The last :meth:`_in_line` op's ticket, if it was made in the current graph."""
        import tensorflow as tf

        here = self._ticket is not None and self._ticket.graph is tf.compat.v1.get_default_graph()
        return [self._ticket] if here else []

    # -- a step -----------------------------------------------------------------------------------

    def apply(self, optimizer: Any, base: Any, grads: list, variables: Any) -> None:
        """The compiled optimizer's ``apply``: `grads` are the pieces' averaged gradients (the gathers' own)."""
        import tensorflow as tf

        variables = list(variables) if variables is not None else keras_internals.tracked_variables(optimizer)
        if not optimizer.built:
            optimizer.build(variables)
        piece_of = {id(v): p for unit in self.units for v, p in zip(unit.variables, unit.pieces, strict=True)}
        missing = [v.path for v in variables if id(v) not in piece_of]
        if missing:
            raise RuntimeError(f"shard='parameters': {missing[0]} is not laid out (fit lays the weights out first)")
        if self.optimizer.global_clipnorm:  # (Keras's own clipping by the global norm makes an Embedding's dense)
            grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        present = [g is not None for g in grads]
        transform = clipping(self.optimizer, present, lambda: self._squared_norms(grads))
        clipped = [None if g is None else _transformed(g, transform[i]) for i, g in enumerate(grads)]
        step_copy(self._copy, optimizer, clipped, [piece_of[id(v)] for v in variables])
        keras_internals.iteration_counter(optimizer).assign_add(1)

    def _squared_norms(self, grads: list) -> list:
        """Each variable's gradient's sum of squares, its pieces' summed over the workers."""
        import tensorflow as tf

        partial = [tf.zeros([], tf.float64) for _ in grads]
        for i, g in enumerate(grads):
            if g is not None:
                partial[i] = tf.cast(tf.reduce_sum(tf.square(values_of(g))), tf.float64)
        summed = summed_over_workers(self.collectives, partial)
        return [None if g is None else tf.cast(summed[i], g.dtype) for i, g in enumerate(grads)]

    # -- whole weights, for what reads them outside a step (collective) ---------------------------------

    def whole_values(self) -> dict[int, np.ndarray]:
        """id(variable) -> its whole value, for every sharded variable (collective)."""
        out = {}
        for unit in self.units:
            shard = shard_of(unit, [keras_internals.storage(v) for v in unit.variables])
            whole = allgather_in_calls(self.collectives, shard, "whole-parameters")
            for v, at, size in zip(unit.variables, unit.offsets, unit.sizes, strict=True):
                out[id(v)] = np.reshape(whole[at : at + size], v.shape).copy()
        self.collectives.release("whole-parameters")
        return out

    def set_whole(self, variable: Any, value: np.ndarray) -> None:
        """Sets a sharded variable from its whole value (each worker keeps its piece)."""
        for unit in self.units:
            for v, (lo, hi) in zip(unit.variables, unit.owned, strict=True):
                if v is variable:
                    keras_internals.storage(v).assign(_part(np.asarray(value, unit.dtype), lo, hi))
                    return
        raise KeyError(variable.path)

    @contextmanager
    def whole(self) -> Iterator[None]:
        """While in it, every sharded variable holds its whole value (collective): for files and checks that read
        the variables; the pieces take back what was assigned meanwhile."""
        import tensorflow as tf

        values = self.whole_values()
        pieces = {id(v): keras_internals.storage(v) for unit in self.units for v in unit.variables}
        for unit in self.units:
            for v in unit.variables:
                keras_internals.set_storage(v, tf.Variable(values[id(v)], trainable=True, name=v.name))
        self._whole = True
        try:
            yield
        finally:
            self._whole = False
            for unit in self.units:
                for v, (lo, hi) in zip(unit.variables, unit.owned, strict=True):
                    whole = keras_internals.storage(v).numpy()
                    keras_internals.set_storage(v, pieces[id(v)])
                    pieces[id(v)].assign(_part(whole, lo, hi))

    def consolidated(self) -> Any:
        """Collective: a plain optimizer of the compiled one's class and config, built on the model's trainable
        variables, holding the whole state the workers' pieces hold between them (for ``RDMAStrategy.export``)."""
        optimizer, variables = self.optimizer, list(self.model.trainable_variables)
        full = plain_optimizer(optimizer, variables)
        position = {id(v): i for i, v in enumerate(variables)}
        whole_slots = slots_by_variable(full, variables)
        for unit, slots in zip(self.units, self.slots_of_units(), strict=True):
            for name, pieces in slots.items():
                whole = allgather_in_calls(self.collectives, shard_of(unit, pieces), "whole-parameters")
                for v, offset, size in zip(unit.variables, unit.offsets, unit.sizes, strict=True):
                    slot = whole_slots.get((position[id(v)], name))
                    if slot is not None:
                        slot.assign(np.reshape(whole[offset : offset + size], v.shape))
        self.collectives.release("whole-parameters")
        return full

    def unshard(self) -> None:
        """Every sharded variable whole again, its layer calling as it did (collective: at the strategy's close)."""
        import tensorflow as tf

        if not self.units:
            return
        values = self.whole_values()
        for unit in self.units:
            keras_internals.restore_method(unit.layer, "call")
            for v in unit.variables:
                keras_internals.set_storage(v, tf.Variable(values[id(v)], trainable=True, name=v.name))
        self.units = []

    def slots_of_units(self) -> list[dict[str, list[Any]]]:
        """Per unit, in order: slot name (e.g. "momentum") -> the copy's slot of each of the unit's pieces."""
        mine, out, first = slots_by_variable(self._copy, self._pieces()), [], 0
        names = sorted({name for _, name in mine})
        for unit in self.units:
            out.append({name: [mine[(first + k, name)] for k in range(len(unit.pieces))] for name in names})
            first += len(unit.pieces)
        return out

    def state_bytes(self) -> dict[str, int]:
        """Bytes this worker stores: its pieces (parameters) and its copy's variables (optimizer)."""
        return {"parameters": variables_bytes(self._pieces()),
                "optimizer": variables_bytes(self._copy.variables) if self._copy is not None else 0}  # fmt: skip

    def variables_in(self, variables: Sequence[Any]) -> list[Any]:
        """`variables` less the sharded ones (what replica checks and broadcasts may read whole)."""
        return [v for v in variables if not self.is_sharded(v)]


def shard_of(unit: _Unit, pieces: Sequence[Any]) -> np.ndarray:
    """This worker's shard of `unit`: `pieces` (a variable each, in the unit's order: its storage, or a slot of it)
    end to end, padded to the shard's length."""
    shard, at = np.zeros(unit.per, unit.dtype), 0
    for piece, (lo, hi) in zip(pieces, unit.owned, strict=True):
        shard[at : at + hi - lo] = np.reshape(piece.numpy(), -1)
        at += hi - lo
    return shard


def _part(value: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of `value` flattened, in an array of their own: TensorFlow adopts an aligned array it is
    given as a tensor's buffer, and a view would keep the whole variable's alive beside its piece."""
    return np.array(np.reshape(value, -1)[lo:hi])


def _transformed(gradient: Any, transform: Any) -> Any:
    """`transform` (a clipping) applied to a gradient's values: an IndexedSlices stays one."""
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(transform(gradient.values), gradient.indices, gradient.dense_shape)
    return transform(gradient)
