"""The seam: every use of Keras internals, in one module, for the Keras versions rdkeras is tested with.

Only this module names private Keras attributes, imports ``keras.src`` or patches
a Keras class; what rdkeras *does* with them (fit on every worker, atomic saves,
backups across workers) is its own policy, in :mod:`rdkeras.fitting`. Here:

- :func:`check` names any private hook an installed Keras lacks (the table
  ``_HOOKS`` lists them all), and refuses a non-TensorFlow backend;
- accessors for private state (the Functional graph, the compiled loss, the
  initial epoch, BackupAndRestore's paths, an optimizer's tracked variables);
- overrides of methods on single *instances* (never their classes, so what Keras
  serializes records Keras's own classes), and the names of the private methods
  rdkeras overrides (``BUILD_HOOK``, ``EPOCH_LOGS_HOOK``, the backup's hooks);
- class-level patches, each bounded: ``Model.compile`` while a strategy's
  ``scope()`` is open on this thread (Keras has no per-scope compile hook outside
  tf.distribute's own strategies, which rdkeras is not); ``Model.fit``,
  ``evaluate`` and ``predict`` while a strategy lives, routed to rdkeras's policy
  for its models wherever Keras's own are reached (``model.fit``, or a subclass's
  override through ``super()``, as KerasHub's tasks) and refusing an undistributed
  model's fit in a multi-worker job, which would train each worker alone;
  ``Optimizer.apply`` while ``strategy.run`` runs on this thread (tf.distribute's
  replica context, where ``apply_gradients`` sums over replicas); and the
  backend's random draws and the loss reduction while a data-parallel step (or a
  pipeline's micro-batch) is traced on this thread (:func:`global_batch_step`: a
  draw the size of this replica's rows becomes its rows of the global batch's
  draw, and losses reduce as over the global batch); and while a strategy lives,
  the TensorFlow backend's ``remat`` (keras.remat, keras.RematScope's layers) and
  ``SeedGenerator.next`` (:func:`hold_remat`: a recompute inside a traced step,
  drawing the seeds its forward pass drew).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # Keras and TensorFlow ship no type information: mypy reads these as untyped; a reader, as types
    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TFEpochIterator
    from keras.src.ops.node import Node
    from keras.src.random.seed_generator import SeedGenerator

_R = TypeVar("_R")


def _tested_keras() -> str:
    """The Keras releases the test suite runs against: pyproject.toml's pin, read from the installed metadata."""
    import importlib.metadata

    try:
        requirements = importlib.metadata.requires("rdkeras") or []
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return ""
    for requirement in requirements:
        name, rest = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", requirement).groups()  # type: ignore[union-attr]
        if name.lower() == "keras" and ";" not in rest:
            return ",".join(sorted((part.strip() for part in rest.split(",")), reverse=True))  # >= before <
    return ""


KERAS_TESTED = _tested_keras()

# (object path, attribute) of every private Keras name used here.
_HOOKS = (
    ("keras.Model", "_maybe_symbolic_build"),
    ("keras.Model", "_get_metrics_result_or_logs"),
    ("keras.Model", "_symbolic_build"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_loss_tracker"),
    ("keras.src.backend.common.name_scope.name_scope", "caller"),
    ("keras.src.backend.tensorflow.trainer.TFEpochIterator", "_distributed_dataset"),
    ("keras.Model", "_initial_epoch"),
    ("keras.Sequential", "_functional"),
    ("keras.src.models.functional.Functional", "_standardize_inputs"),
    ("keras.src.models.functional.Functional", "_outputs_struct"),
    ("keras.src.models.functional.Functional", "_inputs_struct"),
    ("keras.src.models.functional.Functional", "_run_through_graph"),
    ("keras.src.models.functional.Functional", "_nodes_by_depth"),
    ("keras.KerasTensor", "_keras_history"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"),
    ("keras.callbacks.BackupAndRestore", "_save_model"),
    ("keras.callbacks.BackupAndRestore", "_load_model"),
    ("keras.callbacks.BackupAndRestore", "_weights_path"),
    ("keras.callbacks.BackupAndRestore", "_training_metadata_path"),
    ("keras.callbacks.BackupAndRestore", "_prev_weights_path"),
    ("keras.callbacks.BackupAndRestore", "_prev_training_metadata_path"),
    ("keras.callbacks.BackupAndRestore", "_current_epoch"),
    ("keras.callbacks.BackupAndRestore", "_last_batch_seen"),
    ("keras.optimizers.LossScaleOptimizer", "inner_optimizer"),
    ("keras.optimizers.Optimizer", "_trainable_variables"),
    ("keras.layers.BatchNormalization", "_moments"),
    ("keras.layers.BatchNormalization", "_reduction_axes"),
    ("keras.Layer", "_flatten_layers"),
    ("keras.src.random.seed_generator", "draw_seed"),
    ("keras.src.backend.tensorflow.random", "_cast_seed"),
    ("keras.src.losses.loss", "reduce_weighted_values"),
    ("keras.src.losses.loss", "squeeze_or_expand_to_same_rank"),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer", "build"),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer", "_use_weight_decay"),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer", "_var_key"),
    ("keras.src.optimizers.base_optimizer.BaseOptimizer", "_learning_rate"),
    ("keras.src.backend.tensorflow.core", "remat"),
    ("keras.src.random.seed_generator.SeedGenerator", "next"),
)
# Attributes that exist only on instances (set in __init__/compile/build).
_INSTANCE_ATTRS = {
    "caller",
    "_distributed_dataset",
    "_compile_loss",
    "_loss_tracker",
    "_initial_epoch",
    "_outputs_struct",
    "_inputs_struct",
    "_functional",
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
    "_current_epoch",
    "_last_batch_seen",
    "inner_optimizer",
    "_trainable_variables",
    "_nodes_by_depth",
    "_keras_history",
    "_reduction_axes",
    "_learning_rate",
}


# -- checks -------------------------------------------------------------------------


def _resolve(path: str) -> object:
    """The module, class or function a dotted path names (None if there is none)."""
    import importlib

    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


def missing_hooks(instances: Mapping[str, object] | None = None) -> list[str]:
    """The private Keras names rdkeras uses that this Keras lacks.

    Names set only on instances are checked on `instances` (object path -> an instance) where given;
    rdkeras itself does not create instances for this, which would shift Keras's automatic layer
    names in the user's program (the tests do).
    """
    missing = []
    for path, attr in _HOOKS:
        owner = _resolve(path)
        if owner is None:
            present = False
        elif attr in _INSTANCE_ATTRS:
            probe = (instances or {}).get(path)
            present = probe is None or hasattr(probe, attr)
        else:
            present = hasattr(owner, attr)
        if not present:
            missing.append(f"{path}.{attr}")
    return missing


def check() -> None:
    """Raises if Keras is not the TensorFlow backend or lacks a hook rdkeras relies on."""
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"rdkeras runs Keras on the TensorFlow backend, but KERAS_BACKEND is {backend!r}: "
            "set KERAS_BACKEND=tensorflow (before importing keras) to train with RDMAStrategy"
        )
    missing = missing_hooks()
    if missing:
        raise RuntimeError(
            f"this Keras ({keras.__version__}) lacks what rdkeras relies on: {', '.join(missing)}. "
            f"rdkeras is tested with keras{KERAS_TESTED}: pip install 'keras{KERAS_TESTED}'"
        )


# -- small accessors ------------------------------------------------------------------


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def functional_of(model: keras.Model) -> keras.Model:
    """The Functional graph of a Functional or Sequential model (ValueError for others)."""
    import keras
    from keras.src.models.functional import Functional

    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise ValueError(
                f"Sequential model {model.name!r} has no input shape yet: give it a keras.Input "
                "(or build it) before placing its layers on workers"
            )
        return graph
    if not isinstance(model, Functional):
        raise ValueError(
            f"model parallelism needs a Functional or Sequential model, whose layer graph can be cut "
            f"between workers; {type(model).__name__} is subclassed (use data parallelism for it)"
        )
    return model


def nodes_in_order(graph: keras.Model) -> list[Node]:
    """A Functional graph's nodes, producers before consumers."""
    depths = sorted(graph._nodes_by_depth, reverse=True)
    return [n for d in depths for n in graph._nodes_by_depth[d]]


def producer_of(tensor: keras.KerasTensor) -> tuple[keras.Operation, int]:
    """(operation, output index) that produced a symbolic KerasTensor."""
    history = tensor._keras_history
    return history.operation, history.tensor_index


def standardize_inputs(graph: keras.Model, x: object) -> list[tf.Tensor]:
    return list(graph._standardize_inputs(x))


def outputs_struct(graph: keras.Model) -> object:
    return graph._outputs_struct


def rebuild(model: keras.Model, call: Callable[..., object], name: str) -> keras.Model:
    """A new Functional model over the same layers (so the same weights) on new inputs, each node of `model`'s
    graph computed by ``call(layer, *args, **kwargs)`` (which may call other layers instead)."""
    import keras

    graph = functional_of(model)
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name), graph._inputs_struct
    )
    return keras.Model(inputs, graph._run_through_graph(inputs, call_fn=call), name=name)


def compiled_loss(model: keras.Model) -> keras.losses.Loss:
    return model._compile_loss


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    return model._loss_tracker


def same_rank(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Keras's loss reduction's alignment of values and weights (a trailing dimension of 1 squeezed or added)."""
    from keras.src.losses.loss import squeeze_or_expand_to_same_rank

    return squeeze_or_expand_to_same_rank(x, y)


def loss_trackers(model: keras.Model) -> list[keras.metrics.Metric]:
    """The Mean metrics Keras's steps update with a loss and the batch's rows as weight: the model's loss tracker
    and, once the compiled loss is built, its per-output loss trackers."""
    compiled = getattr(model, "_compile_loss", None)
    return [model._loss_tracker, *(getattr(compiled, "metrics", None) or [])]


def data_spec(iterator: TFEpochIterator) -> tf.TypeSpec:
    """The structure of TensorSpecs of the batches a Keras epoch iterator yields (its dataset's element spec)."""
    return iterator._distributed_dataset.element_spec


def metric_creating_variable() -> keras.metrics.Metric | None:
    """The keras.metrics.Metric whose ``add_variable`` is running on this thread, if any (Keras opens a name scope
    with the metric as its caller around it)."""
    import keras
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    caller = stack[-1].caller if stack else None
    return caller if isinstance(caller, keras.metrics.Metric) else None


def symbolic_build(model: keras.Model, data_batch: object) -> None:
    model._symbolic_build(data_batch=data_batch)


def has_own_call(model: keras.Model) -> bool:
    """Whether the model defines ``call`` (Keras's own raises NotImplementedError: only its train_step runs)."""
    import keras

    return type(model).call is not keras.Model.call


def initial_epoch(model: keras.Model) -> int:
    return int(model._initial_epoch or 0)


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    model._initial_epoch = int(epoch)


def optimizer_slot_references(
    optimizer: keras.optimizers.Optimizer, variables: Sequence[keras.Variable]
) -> list[tuple[keras.Variable, int | None]]:
    """Each optimizer variable with the index in `variables` of the model variable it belongs to
    (None for the optimizer's own: iterations, learning rate, loss scale). Keras names a slot
    ``{reference path with '/' -> '_'}_{slot}``; the longest matching prefix wins."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", i) for i, v in enumerate(variables)), key=lambda p: -len(p[0]))
    out = []
    for ov in optimizer.variables:
        ref = next((i for prefix, i in prefixes if ov.name.startswith(prefix)), None)
        if ref is not None and tuple(ov.shape) != tuple(variables[ref].shape):
            ref = None
        out.append((ov, ref))
    return out


def state_variables(model: keras.Model) -> list[keras.Variable]:
    """The model's weights, then its optimizer's variables (if built): what a backup restores."""
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return list(model.weights) + extra


def iteration_counter(optimizer: keras.optimizers.Optimizer) -> keras.Variable:
    """The variable counting `optimizer`'s ``apply`` calls: ``iterations`` is a tensor, the updates so far, under
    gradient accumulation."""
    return optimizer._iterations


def layers_owning_variables(model: keras.Model) -> list[keras.Layer]:
    """`model` and every layer inside it, each once (a layer's own variables: :func:`own_trainable_variables`)."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def own_trainable_variables(layer: keras.Layer) -> list[keras.Variable]:
    """The trainable variables `layer` itself created (not its sublayers')."""
    return list(layer._trainable_variables)


def storage(variable: keras.Variable) -> tf.Variable:
    """The TensorFlow variable behind a Keras variable."""
    return variable._value


def set_storage(variable: keras.Variable, value: tf.Variable) -> None:
    """`variable` is stored in the TensorFlow variable `value` from now on (any shape: a sharded piece)."""
    variable._value = value


def only_own_trainable_state(layer: keras.Layer) -> bool:
    """Whether `layer`'s call can read and write no variable but its own trainable ones: no sublayer's, no
    moving statistic, no seed (a recomputation of the call then changes nothing)."""
    import keras

    own = own_trainable_variables(layer)
    return bool(own) and len(layer.variables) == len(own) and not isinstance(layer, keras.layers.Embedding)


def call_with_values(
    layer: keras.Layer,
    variables: Sequence[keras.Variable],
    values: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    recompute: bool = False,
) -> None:
    """Each call of `layer` reads `variables` as the tensors ``values(inputs)`` gives then (a
    ``keras.StatelessScope``, inside those of outer calls; `inputs` are the call's tensors, which the values may
    wait for); what the call assigns to other variables (a seed, a moving mean) is assigned to them after. With
    `recompute` (for a layer of :func:`only_own_trainable_state`), nothing of the call is kept for backprop but
    its inputs: the backward pass asks for the values again and reruns the call (:func:`remat`). Undone by
    :func:`restore`."""
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

    call = _tied_logits_in_place(layer, original(layer, "call"))

    def call_on_values(self: keras.Layer, *args: object, **kwargs: object) -> object:
        if recompute:
            return remat(functools.partial(call_in_scope, self))(*args, **kwargs)
        return call_in_scope(self, *args, **kwargs)

    def call_in_scope(self: keras.Layer, *args: object, **kwargs: object) -> object:
        outer = get_stateless_scope()
        inputs = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor)]
        scope = StatelessScope(list(zip(variables, values(inputs), strict=True)), collect_losses=True)
        if outer is not None:
            scope.state_mapping = {**outer.state_mapping, **scope.state_mapping}
        entry = dict(scope.state_mapping)
        with scope:
            out = call(*args, **kwargs)
        if scope.losses:
            raise NotImplementedError(
                f"shard='parameters': layer {self.name} adds losses in its call (an activity regularizer), which "
                "are not carried yet: use shard='gradients'"
            )
        for v in self.variables:
            new = scope.state_mapping.get(id(v))
            if new is not None and new is not entry.get(id(v)):
                v.assign(new)
        return out

    override(layer, "call", call_on_values)


def _tied_logits_in_place(layer: keras.Layer, call: Callable[..., object]) -> Callable[..., object]:
    """`layer`'s own `call`, but where `layer` is a ``keras.layers.ReversibleEmbedding`` with tied weights (as in
    KerasHub's language models), its reverse call is one matmul that reads the table transposed in place
    (``transpose_b``). Keras's makes a transposed copy of the table, and the gradient its matmul gives is the
    table's transpose, transposed back: two tables more at the peak of a step that gathers the table (62 MB each
    at a vocabulary of 16k by 1024). The same math, on every worker."""
    import keras
    import tensorflow as tf

    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    if reversible is None or not isinstance(layer, reversible) or not layer.tie_weights:
        return call

    def tied(inputs: Any, reverse: bool = False) -> object:
        if not reverse or layer.reverse_dtype is not None:
            return call(inputs, reverse=reverse)
        table = keras.ops.convert_to_tensor(layer.embeddings)
        if tf.as_dtype(inputs.dtype) != table.dtype:
            return call(inputs, reverse=reverse)
        flat = tf.reshape(inputs, [-1, table.shape[-1]])
        logits = tf.reshape(tf.matmul(flat, table, transpose_b=True),
                            tf.concat([tf.shape(inputs)[:-1], tf.shape(table)[:1]], 0))  # fmt: skip
        logits.set_shape(inputs.shape[:-1].concatenate(table.shape[:1]))
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
        return logits

    return tied


def tracked_variables(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The variables a built optimizer updates (what ``apply`` defaults to)."""
    return list(optimizer._trainable_variables)


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the variables: a LossScaleOptimizer's inner one, else itself."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def build_without_slots(optimizer: keras.optimizers.Optimizer) -> None:
    """From now on `optimizer` builds only what every optimizer has (iterations, learning rate): not its
    per-variable state, which a sharded update keeps elsewhere (rdkeras.parallel.sharded_optimizer)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    def build(self: keras.optimizers.Optimizer, variables: Sequence[keras.Variable]) -> None:
        if self.built:
            return
        per_variable = self.use_ema, self.gradient_accumulation_steps  # (moving averages, accumulators)
        self.use_ema, self.gradient_accumulation_steps = False, None
        try:
            BaseOptimizer.build(self, list(variables))
        finally:
            self.use_ema, self.gradient_accumulation_steps = per_variable

    override(optimizer, "build", build)


def saves_own_variables(
    optimizer: keras.optimizers.Optimizer, variables: Callable[[], Sequence[keras.Variable]]
) -> None:
    """From now on Keras saves ``variables()`` as `optimizer`'s own (``save_own_variables``: what a .keras or
    .weights.h5 file holds of it), e.g. a sharded optimizer's whole state, gathered. Undone by :func:`restore`."""

    def save_own_variables(self: keras.optimizers.Optimizer, store: dict[str, object]) -> None:
        for i, variable in enumerate(variables()):
            store[str(i)] = variable.numpy()

    override(optimizer, "save_own_variables", save_own_variables)


def uses_weight_decay(optimizer: keras.optimizers.Optimizer, variable: keras.Variable) -> bool:
    """Whether `optimizer` decays `variable` (its ``exclude_from_weight_decay`` lists and patterns), asked as
    Keras's TensorFlow optimizer asks: of the backend variable (whose name is TensorFlow's)."""
    return bool(optimizer._use_weight_decay(getattr(variable, "value", variable)))


def decide_weight_decay(
    optimizer: keras.optimizers.Optimizer, decisions: Sequence[tuple[keras.Variable, bool]]
) -> None:
    """`optimizer` decays each variable of `decisions` as said (the copy of a sharded update follows the
    compiled optimizer's choice for the variable a piece comes from)."""
    cache = getattr(optimizer, "_exclude_from_weight_decay_cache", None)  # (Keras makes it on first use)
    if cache is None:
        cache = {}
        object.__setattr__(optimizer, "_exclude_from_weight_decay_cache", cache)
    for variable, decays in decisions:
        cache[optimizer._var_key(variable)] = bool(decays)


def settable_learning_rate(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `optimizer`'s learning rate is a variable (callbacks may set it), not a schedule or callable."""
    import keras

    return isinstance(optimizer._learning_rate, keras.Variable)


def is_fit_validation(evaluate_kwargs: dict) -> bool:
    """Whether a call of ``evaluate`` is fit's own validation (its data already sharded by fit)."""
    return bool(evaluate_kwargs.get("_use_cached_eval_dataset"))


def backup_paths(callback: keras.callbacks.BackupAndRestore) -> tuple[Path, Path, Path, Path]:
    """BackupAndRestore's (weights, metadata, previous weights, previous metadata) files."""
    return (
        Path(callback._weights_path),
        Path(callback._training_metadata_path),
        Path(callback._prev_weights_path),
        Path(callback._prev_training_metadata_path),
    )


def backup_position(callback: keras.callbacks.BackupAndRestore) -> tuple[int, int]:
    """(epoch, batch) a BackupAndRestore callback is at: what its backup records."""
    return callback._current_epoch, callback._last_batch_seen


# Private methods rdkeras overrides on instances (rdkeras.fitting): Keras's build-before-training hook
# (a no-op without a tf.distribute strategy), its per-epoch and per-evaluation logs, and
# BackupAndRestore's save and load.
BUILD_HOOK = "_maybe_symbolic_build"
EPOCH_LOGS_HOOK = "_get_metrics_result_or_logs"
BACKUP_SAVE_HOOK = "_save_model"
BACKUP_LOAD_HOOK = "_load_model"


# -- instance overrides ------------------------------------------------------------------


def set_untracked(obj: object, name: str, value: object) -> None:
    """Sets attribute `name` on a Keras object past Keras's attribute tracking (a Layer tracks what is set on
    it: variables, sublayers, what it serializes), so the value is never saved or serialized."""
    object.__setattr__(obj, name, value)


def untracked(obj: object, name: str, default: Any = None) -> Any:
    """An attribute :func:`set_untracked` set on this very object (not its class), or `default`."""
    return obj.__dict__.get(name, default) if hasattr(obj, "__dict__") else default


def remove_untracked(obj: object, name: str) -> None:
    obj.__dict__.pop(name, None)


def override(obj: object, name: str, fn: Callable[..., object]) -> None:
    """Replaces method `name` of this one object by ``fn(obj, *args, **kwargs)``; the class is untouched.
    :func:`original` gives the method it replaced."""
    originals = obj.__dict__.setdefault("_rdkeras_originals", {})
    if name not in originals:
        originals[name] = getattr(obj, name)
    object.__setattr__(obj, name, types.MethodType(fn, obj))


def original(obj: object, name: str) -> Callable[..., Any]:
    """Method `name` of `obj` as it was before :func:`override` (as it is, if not overridden)."""
    replaced = obj.__dict__.get("_rdkeras_originals", {})
    return replaced[name] if name in replaced else getattr(obj, name)


def overridden(obj: object) -> bool:
    """Whether :func:`override` replaced any method of `obj`."""
    return "_rdkeras_originals" in obj.__dict__


def restore_method(obj: object, name: str) -> None:
    """Removes the override of method `name` from `obj` (its others stay)."""
    originals = obj.__dict__.get("_rdkeras_originals", {})
    if originals.pop(name, None) is not None:
        obj.__dict__.pop(name, None)
    if not originals:
        obj.__dict__.pop("_rdkeras_originals", None)


def restore(obj: object) -> None:
    """Removes every override from `obj`."""
    for name in obj.__dict__.pop("_rdkeras_originals", {}):
        obj.__dict__.pop(name, None)


# -- the patch table: class- and module-level replacements, each undone on the way out ----------------

_RANDOM_DRAW = "global_batch_step: a traced data-parallel step's draw is its rows of the global batch's draw"
# Every attribute of Keras's that rdkeras replaces for a while (a strategy's life, a scope, a traced step), and
# why: :func:`_replace` refuses any other, and :func:`active_patches` names those in effect.
PATCH_TABLE = {
    "Model.compile": "on_compile: models compiled in a strategy's scope (load_model's too) train distributed",
    "Model.fit": "route_trainer_methods: Keras's own fit, reached by a subclass's super().fit (KerasHub) too",
    "Model.evaluate": "route_trainer_methods: as fit",
    "Model.predict": "route_trainer_methods: as fit",
    "Optimizer.apply": "on_apply: apply_gradients in a custom loop's replica context sums the replicas' gradients",
    "random.normal": _RANDOM_DRAW,
    "random.uniform": _RANDOM_DRAW,
    "random.truncated_normal": _RANDOM_DRAW,
    "random.randint": _RANDOM_DRAW,
    "random.dropout": "global_batch_step: Dropout's keep mask, its rows of the global batch's mask",
    "losses.reduce_weighted_values": "global_batch_step: a loss reduces as one process's over the global batch",
    "backend.remat": "hold_remat: keras.remat/RematScope in a traced step (tf.recompute_grad refuses keywords there)",
    "SeedGenerator.next": "hold_remat: a rematerialized call's recompute draws the seeds its forward pass drew",
}
# (site, owner, attribute, the value it replaced), in order
_active: list[tuple[str, type | types.ModuleType, str, object]] = []


def _replace(site: str, owner: type | types.ModuleType, name: str, value: object) -> Callable[[], None]:
    """Sets attribute `name` of `owner` (a class or a module of Keras's) to `value` for the table's `site`;
    returns the function that puts the previous value back."""
    if site not in PATCH_TABLE:
        raise KeyError(f"{site!r} is not in keras_internals.PATCH_TABLE: add it there, with its reason")
    previous = vars(owner)[name]
    setattr(owner, name, value)
    entry = (site, owner, name, previous)
    _active.append(entry)

    def undo() -> None:
        setattr(owner, name, previous)
        _active.remove(entry)

    return undo


def active_patches() -> list[str]:
    """The replacements in effect, as "site (owner.attribute)": none once every strategy is closed."""
    return [f"{site} ({getattr(owner, '__name__', owner)}.{name})" for site, owner, name, _ in _active]


def _patch_model_method(name: str, make: Callable[[types.FunctionType], Callable[..., object]]) -> Callable[[], None]:
    """Replaces method `name` where keras.Model's classes define it (so that checks like Keras's
    ``self.__class__.compile != Trainer.compile`` still hold) by ``make(previous)``; returns the
    function that undoes it."""
    import keras

    owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
    return _replace(f"Model.{name}", owner, name, make(owner.__dict__[name]))


@contextlib.contextmanager
def on_compile(attach: Callable[[keras.Model], object]) -> Iterator[None]:
    """While active, every ``Model.compile`` on this thread (``load_model`` compiles too) ends with
    ``attach(model)``; other threads compile as plain Keras does."""
    thread = threading.get_ident()

    def make(previous: types.FunctionType) -> Callable[..., object]:
        @functools.wraps(previous)
        def compile(model: keras.Model, *args: object, **kwargs: object) -> object:  # noqa: A001
            result = previous(model, *args, **kwargs)
            if threading.get_ident() == thread:
                attach(model)
            return result

        return compile

    undo = _patch_model_method("compile", make)
    try:
        yield
    finally:
        undo()


# Keras's own methods rdkeras's policy takes over for distributed models: reached by ``model.fit(...)`` and by a
# subclass's own ``fit`` through ``super().fit`` (KerasHub's tasks preprocess their data there first).
ROUTED_METHODS = ("fit", "evaluate", "predict")
_routers: list[Callable[[keras.Model, str], Callable[..., object] | None]] = []
_unroute: list[Callable[[], None]] = []


def route_trainer_methods(router: Callable[[keras.Model, str], Callable[..., object] | None]) -> None:
    """Until :func:`unroute_trainer_methods`, Keras's own ``Model.fit``/``evaluate``/``predict`` ask
    ``router(model, name)`` first: None leaves the call to Keras; a handler is called as ``handler(keras_method,
    *args, **kwargs)``, `keras_method` being Keras's own method bound to the model (its signature is Keras's,
    whatever a subclass's override looks like). Routers are asked in the order they were added."""
    if not _routers:
        for name in ROUTED_METHODS:

            def make(previous: types.FunctionType) -> Callable[..., object]:
                @functools.wraps(previous)
                def routed(model: keras.Model, *args: object, **kwargs: object) -> object:
                    for route in list(_routers):
                        handler = route(model, previous.__name__)
                        if handler is not None:
                            return handler(types.MethodType(previous, model), *args, **kwargs)
                    return previous(model, *args, **kwargs)

                return routed

            _unroute.append(_patch_model_method(name, make))
    _routers.append(router)


def unroute_trainer_methods(router: Callable[[keras.Model, str], Callable[..., object] | None]) -> None:
    if router in _routers:
        _routers.remove(router)
        if not _routers:
            while _unroute:
                _unroute.pop()()


_apply_state = threading.local()


@contextlib.contextmanager
def on_apply(hook: Callable[[keras.optimizers.Optimizer, list], list]) -> Iterator[None]:
    """While active, ``Optimizer.apply`` on this thread (so ``apply_gradients`` too) of an optimizer rdkeras
    has not overridden on its instance first passes the gradients through ``hook(optimizer, grads)``; once per
    call, however the optimizers nest (a LossScaleOptimizer's inner one)."""
    import keras

    thread = threading.get_ident()
    found = {c for k in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer)
             for c in k.__mro__ if "apply" in c.__dict__}  # fmt: skip
    owners = sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")  # the same order in every process
    undo = []
    for owner in owners:
        previous = owner.__dict__["apply"]

        def apply(
            optimizer: keras.optimizers.Optimizer,
            grads: Sequence[tf.Tensor],
            trainable_variables: Sequence[keras.Variable] | None = None,
            previous: Callable[..., object] = previous,
        ) -> object:
            if threading.get_ident() != thread or getattr(_apply_state, "inside", False):
                return previous(optimizer, grads, trainable_variables)
            _apply_state.inside = True
            try:
                return previous(optimizer, hook(optimizer, list(grads)), trainable_variables)
            finally:
                _apply_state.inside = False

        undo.append(_replace("Optimizer.apply", owner, "apply", functools.wraps(previous)(apply)))
    try:
        yield
    finally:
        for put_back in reversed(undo):
            put_back()


# keras.random's draws whose first dimension may be the batch's (the TensorFlow backend's, which keras.random,
# keras.ops.random and the layers -- Dropout, GaussianNoise, the augmentation layers -- all call).
_DRAWS = ("normal", "uniform", "truncated_normal", "randint")
_step = threading.local()


class StepBatch(Protocol):
    """What :func:`global_batch_step` reads of the batch a step is traced for (``rdkeras.fitting.GlobalBatch``)."""

    @property
    def start(self) -> int | tf.Tensor: ...  # this replica's first row in the global batch
    @property
    def rows(self) -> int | tf.Tensor: ...  # this replica's rows
    @property
    def total(self) -> int | tf.Tensor: ...  # the global batch's rows
    @property
    def draws(self) -> dict | None: ...  # the draws a pipeline step's micro-batches share

    def reduce_loss(
        self,
        keras_reduce: Callable[..., tf.Tensor],
        values: tf.Tensor,
        sample_weight: tf.Tensor | None = None,
        mask: tf.Tensor | None = None,
        reduction: str | None = "sum_over_batch_size",
        dtype: str | None = None,
    ) -> tf.Tensor: ...


def current_global_batch() -> Any:
    """The `batch` of the :func:`global_batch_step` active on this thread, or None (the caller's own object, a
    :class:`StepBatch` and whatever more the caller gave it)."""
    return getattr(_step, "batch", None)


@contextlib.contextmanager
def global_batch_step(batch: StepBatch) -> Iterator[None]:
    """While a data-parallel step is traced on this thread, its random draws and its losses are the global batch's.

    `batch` gives ``start``, ``rows`` and ``total`` (this replica's first row in the global batch, its rows, the
    global batch's rows: ints or scalar tensors), ``reduce_loss(keras_reduce, values, sample_weight, mask,
    reduction, dtype)`` and ``draws`` (None, or a dict the micro-batches of one pipeline step share: each draw's
    seed is then the one the first micro-batch drew at the same place):

    - a draw of keras.random (or the backend's, which layers call) whose first dimension is `rows` draws `total`
      rows with the same seed and returns rows ``start:start + rows``: what one process, drawing for the whole
      batch, gives these rows. Dropout's mask too (``backend.random.dropout``, which Dropout, SpatialDropout and
      the recurrent layers' dropout call). The seed generator advances once, as in one process.
    - every ``keras.losses.Loss`` reduces its values through ``batch.reduce_loss`` (given Keras's own
      ``reduce_weighted_values``).
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow import random as backend_random
    from keras.src.losses import loss as loss_module
    from keras.src.random import seed_generator

    thread = threading.get_ident()
    start, rows, total = batch.start, batch.rows, batch.total
    shared = getattr(batch, "draws", None)  # a pipeline's micro-batches: the step's draws, made once
    made: dict[int, int] = {}  # draws made here so far, by seed generator

    def draw_seed(seed: SeedGenerator | int | None) -> tf.Tensor:
        """The seed of a draw: the generator's next one; in a pipeline's micro-batch, the seed the step's first
        micro-batch drew at the same place (the generator advances once a step, as in one process)."""
        if shared is None or not isinstance(seed, seed_generator.SeedGenerator):
            return seed_generator.draw_seed(seed)
        key = (id(seed), made.get(id(seed), 0))
        made[id(seed)] = key[1] + 1
        if key not in shared:
            shared[key] = seed_generator.draw_seed(seed)
        return shared[key]

    class _Drawn(seed_generator.SeedGenerator):  # a seed already drawn, handed to Keras's own function
        def __init__(self, seed: tf.Tensor) -> None:  # no state variable: nothing to track
            self._drawn = seed

        def next(self, ordered: bool = True) -> tf.Tensor:
            return self._drawn

    def of_global(
        first: int | tf.Tensor, replica: Callable[[], tf.Tensor], whole: Callable[[], tf.Tensor]
    ) -> tf.Tensor:
        """``whole()[start:start + rows]`` where `first` (a draw's first dimension) is this replica's rows."""
        if isinstance(first, int) and isinstance(rows, int):
            return whole()[start : start + rows] if first == rows else replica()
        return tf.cond(tf.equal(tf.cast(first, tf.int64), tf.cast(rows, tf.int64)),
                       lambda: whole()[start : start + rows], replica)  # fmt: skip

    def make(previous: Callable[..., tf.Tensor]) -> Callable[..., tf.Tensor]:
        @functools.wraps(previous)
        def draw(
            shape: Sequence[int | tf.Tensor] | tf.Tensor, *args: object, seed: object = None, **kwargs: object
        ) -> tf.Tensor:
            if threading.get_ident() != thread:
                return previous(shape, *args, seed=seed, **kwargs)
            drawn = _Drawn(draw_seed(seed))  # the generator advances once, as in one process
            dims = list(shape) if isinstance(shape, (tuple, list)) else None
            if not dims:  # no rows (RandomCrop's offsets): the one draw of the step, as one process's
                return previous(shape, *args, seed=drawn, **kwargs)
            return of_global(
                dims[0],
                lambda: previous(shape, *args, seed=drawn, **kwargs),
                lambda: previous((total, *dims[1:]), *args, seed=drawn, **kwargs),
            )

        return draw

    keras_dropout = backend_random.dropout

    @functools.wraps(keras_dropout)
    def dropout(
        inputs: tf.Tensor, rate: float | tf.Tensor, noise_shape: Sequence[int | None] | None = None, seed: object = None
    ) -> tf.Tensor:
        if threading.get_ident() != thread or not isinstance(rate, (int, float)) or rate in (0.0, 1.0):
            return keras_dropout(inputs, rate, noise_shape=noise_shape, seed=seed)
        inputs = tf.convert_to_tensor(inputs)
        dims = list(inputs.shape) if noise_shape is None else list(noise_shape)  # (Dropout fills in the batch's)
        dims = [tf.shape(inputs)[i] if d is None else d for i, d in enumerate(dims)]
        drawn = backend_random._cast_seed(draw_seed(seed))  # as Keras's own dropout casts it

        def keep(first: int | tf.Tensor) -> tf.Tensor:
            # TensorFlow's own stateless dropout of ones: the keep mask it draws for this shape and seed.
            shape = tf.stack([tf.cast(d, tf.int32) for d in (first, *dims[1:])])
            return tf.nn.experimental.stateless_dropout(tf.ones(shape, inputs.dtype), rate=rate, seed=drawn) > 0

        mask = of_global(dims[0], lambda: keep(dims[0]), lambda: keep(total))
        scale = tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)  # as TensorFlow's dropout scales
        return tf.where(mask, inputs * scale, tf.zeros([], inputs.dtype))

    keras_reduce = loss_module.reduce_weighted_values

    def reduce_weighted_values(values: tf.Tensor, *args: Any, **kwargs: Any) -> tf.Tensor:
        if threading.get_ident() != thread:
            return keras_reduce(values, *args, **kwargs)
        return batch.reduce_loss(keras_reduce, values, *args, **kwargs)

    undo = [_replace(f"random.{name}", backend_random, name, make(getattr(backend_random, name))) for name in _DRAWS]
    undo.append(_replace("random.dropout", backend_random, "dropout", dropout))
    undo.append(
        _replace("losses.reduce_weighted_values", loss_module, "reduce_weighted_values", reduce_weighted_values)
    )
    _step.batch = batch
    try:
        yield
    finally:
        _step.batch = None
        for put_back in reversed(undo):
            put_back()


def synchronized_batch_norms(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """The model's BatchNormalization layers built with ``synchronized=True`` (nested models included)."""
    import keras

    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized
    ]


# BatchNormalization's batch statistics; rdkeras overrides it on synchronized layers (their moments over every
# replica's part of the batch), and reads the axes it reduces over.
MOMENTS_HOOK = "_moments"


def reduction_axes(batch_norm: keras.layers.BatchNormalization) -> list[int]:
    return list(batch_norm._reduction_axes)


# -- rematerialization: keras.remat and keras.RematScope on the TensorFlow backend -----------------------------

_remat = threading.local()  # .frames: the rematerialized calls traced on this thread now, innermost last
_remat_holders: list[Callable[[], None]] = []  # the undo of hold_remat's patches, while any holder is left
_remat_count = [0]


class _RematFrame:
    """One rematerialized call on this thread: the seeds its forward pass drew, by generator (recording), or
    those it hands out again (the recompute, replaying)."""

    def __init__(self, seeds: dict[int, list[tf.Tensor]], replay: bool):
        self.seeds, self.replay = seeds, replay
        self.taken: dict[int, int] = {}


def _remat_frames() -> list[_RematFrame]:
    if not hasattr(_remat, "frames"):
        _remat.frames = []
    return _remat.frames  # type: ignore[no-any-return]


def remat(f: Callable[..., _R]) -> Callable[..., _R]:
    """Keras's TensorFlow ``remat`` (``tf.recompute_grad(f)``), as rdkeras runs it (:func:`hold_remat`): `f`'s
    floating-point tensor arguments, positional or keyword, are the recomputed function's inputs and the rest
    (``training=True``, masks, None) is closed over -- ``tf.recompute_grad`` refuses keywords in a traced step,
    which is where ``fit`` runs, so Keras's own fails for every mode but "activations" --; the recompute draws
    the random seeds the forward pass drew (Dropout's mask is the forward's, so the gradient is the forward's
    function's), and runs under the forward's :func:`global_batch_step` (a pipeline's micro-batch: its rows of
    the global batch's draws) and autocast scope (mixed precision's compute dtype), wherever the backward pass is
    traced."""
    import tensorflow as tf
    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

    @functools.wraps(f)
    def call(*args: object, **kwargs: object) -> _R:
        autocast = get_autocast_scope()
        flat = tf.nest.flatten((args, kwargs))
        moving = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor) and v.dtype.is_floating]
        if not moving:  # nothing to differentiate by: no activation to keep either
            return f(*args, **kwargs)
        seeds: dict[int, list[tf.Tensor]] = {}
        batch = current_global_batch()
        runs = [0]

        def body(*tensors: tf.Tensor) -> _R:
            leaves = list(flat)
            for i, t in zip(moving, tensors, strict=True):
                leaves[i] = t
            a, kw = tf.nest.pack_sequence_as((args, kwargs), leaves)
            frame = _RematFrame(seeds, replay=runs[0] > 0)
            runs[0] += 1
            again = frame.replay and batch is not None and current_global_batch() is not batch
            frames = _remat_frames()
            frames.append(frame)
            try:
                with (
                    global_batch_step(batch) if again else contextlib.nullcontext(),
                    AutocastScope(autocast.dtype) if autocast is not None else contextlib.nullcontext(),
                ):
                    return f(*a, **kw)
            finally:
                frames.remove(frame)

        return tf.recompute_grad(body)(*[flat[i] for i in moving])

    return call


def _replaying_next(
    previous: Callable[[SeedGenerator, bool], tf.Tensor],
) -> Callable[[SeedGenerator, bool], tf.Tensor]:
    """``SeedGenerator.next`` inside rematerialized calls: a recompute hands out the seeds its forward drew (the
    generator does not advance again), and every forward records what it draws for the recomputes around it."""

    @functools.wraps(previous)
    def next_seed(generator: SeedGenerator, ordered: bool = True) -> tf.Tensor:
        frames = _remat_frames()
        if not frames:
            return previous(generator, ordered)
        source = max((i for i, frame in enumerate(frames) if frame.replay), default=-1)
        value = None
        if source >= 0:
            frame = frames[source]
            drawn, at = frame.seeds.get(id(generator), []), frame.taken.get(id(generator), 0)
            if at < len(drawn):
                value, frame.taken[id(generator)] = drawn[at], at + 1
        if value is None:
            value = previous(generator, ordered)
        for frame in frames[source + 1 :]:
            frame.seeds.setdefault(id(generator), []).append(value)
        return value

    return next_seed


def hold_remat() -> None:
    """Until as many :func:`release_remat`, Keras's TensorFlow backend rematerializes with :func:`remat`
    (``keras.remat``, and the layers a ``keras.RematScope`` made: their mode is fixed when they are created)."""
    from keras.src.backend.tensorflow import core
    from keras.src.random import seed_generator

    if _remat_count[0] == 0:
        owner = seed_generator.SeedGenerator
        _remat_holders.append(_replace("SeedGenerator.next", owner, "next", _replaying_next(owner.__dict__["next"])))
        _remat_holders.append(_replace("backend.remat", core, "remat", remat))
    _remat_count[0] += 1


def release_remat() -> None:
    _remat_count[0] -= 1
    if _remat_count[0] == 0:
        while _remat_holders:
            _remat_holders.pop()()
