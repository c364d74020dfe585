"""Every use of Keras internals, in one module, for the Keras versions rdkeras is tested with.

rdkeras trains the user's own model and optimizer objects. To do so it
overrides a few methods on those *instances* -- never their classes, so what
Keras serializes (``model.save``, ``ModelCheckpoint``, ``to_json``,
``get_config``, ``export``) records Keras's own classes and loads where rdkeras
is not installed -- and it calls a few private Keras functions. All of that
lives here:

- ``fit``/``evaluate``/``predict``: the arguments are bound, the data sharded
  (the parallelism decides how), chief-only callbacks and the progress bar
  dropped on the other workers;
- ``_maybe_symbolic_build`` (Keras's build-before-training hook, a no-op
  without a tf.distribute strategy): builds the model on a first batch;
- ``_get_metrics_result_or_logs`` (called once per epoch and per evaluation):
  epoch logs are shared, so callbacks decide alike on every worker;
- ``save``/``save_weights``: written to a temporary file and renamed, so a kill
  during a write leaves the previous file intact;
- ``optimizer.apply``: the parallelism's gradient exchange before the update;
- ``BackupAndRestore``: the reporter restores and writes backups (atomically);
  every worker then resumes from the reporter's epoch, weights and optimizer state.

:func:`check` names any hook an installed Keras lacks. Undo everything with :func:`undistribute`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

# The Keras releases the test suite has run against (pyproject.toml pins the same range).
KERAS_TESTED = ">=3.13,<3.16"
BACKUP_METADATA_ATTR = "rdkeras_training_metadata"

# (object path, attribute) of every private Keras name used here.
_HOOKS = (
    ("keras.Model", "_maybe_symbolic_build"),
    ("keras.Model", "_get_metrics_result_or_logs"),
    ("keras.Model", "_symbolic_build"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_initial_epoch"),
    ("keras.Sequential", "_functional"),
    ("keras.src.models.functional.Functional", "_standardize_inputs"),
    ("keras.src.models.functional.Functional", "_outputs_struct"),
    ("keras.src.models.functional.Functional", "_nodes_by_depth"),
    ("keras.KerasTensor", "_keras_history"),
    ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"),
    ("keras.callbacks.BackupAndRestore", "_save_model"),
    ("keras.callbacks.BackupAndRestore", "_load_model"),
    ("keras.callbacks.BackupAndRestore", "_weights_path"),
    ("keras.callbacks.BackupAndRestore", "_training_metadata_path"),
    ("keras.callbacks.BackupAndRestore", "_current_epoch"),
    ("keras.optimizers.LossScaleOptimizer", "inner_optimizer"),
    ("keras.optimizers.Optimizer", "_trainable_variables"),
)
# Attributes that exist only on instances (set in __init__/compile/build).
_INSTANCE_ATTRS = {
    "_compile_loss",
    "_loss_tracker",
    "_initial_epoch",
    "_outputs_struct",
    "_functional",
    "_weights_path",
    "_training_metadata_path",
    "_current_epoch",
    "inner_optimizer",
    "_trainable_variables",
    "_nodes_by_depth",
    "_keras_history",
}


class Parallelism(Protocol):
    """What a parallelism provides to the Keras hooks (data, model and hybrid parallelism do)."""

    synced: bool  # whether every worker holds the same model yet (built and shared once)
    restored: bool  # set on the reporter when BackupAndRestore loaded a backup
    fitting: bool  # inside fit (state is shared at on_train_begin, not at build)

    @property
    def is_reporter(self) -> bool: ...  # the worker with the progress bar and chief-only callbacks

    def shard_fit(self, a: dict) -> None: ...
    def shard_evaluate(self, a: dict) -> None: ...
    def shard_predict(self, a: dict) -> int | None: ...  # rows of the output to keep (None: all)
    def sync_state(self, model: Any, restored: bool) -> None: ...
    def gather_state(self, model: Any) -> None: ...
    def share_logs(self, logs: dict) -> dict: ...
    def step_overrides(self) -> dict[str, Callable[..., Any]]: ...
    def check_callbacks(self, callbacks: list[Any]) -> None: ...


# -- checks -------------------------------------------------------------------------


def _resolve(path: str) -> Any:
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


def missing_hooks(instances: dict[str, Any] | None = None) -> list[str]:
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


def bind(method: Any, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to bound `method`, by name, with defaults filled in."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.update(a.pop("kwargs", {}))
    return a


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def functional_of(model: Any) -> Any:
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


def nodes_in_order(graph: Any) -> list[Any]:
    """A Functional graph's nodes, producers before consumers."""
    depths = sorted(graph._nodes_by_depth, reverse=True)
    return [n for d in depths for n in graph._nodes_by_depth[d]]


def producer_of(tensor: Any) -> tuple[Any, int]:
    """(operation, output index) that produced a symbolic KerasTensor."""
    history = tensor._keras_history
    return history.operation, history.tensor_index


def standardize_inputs(graph: Any, x: Any) -> list[Any]:
    return list(graph._standardize_inputs(x))


def outputs_struct(graph: Any) -> Any:
    return graph._outputs_struct


def compiled_loss(model: Any) -> Any:
    return model._compile_loss


def loss_tracker(model: Any) -> Any:
    return model._loss_tracker


def symbolic_build(model: Any, data_batch: Any) -> None:
    model._symbolic_build(data_batch=data_batch)


def initial_epoch(model: Any) -> int:
    return int(model._initial_epoch or 0)


def set_initial_epoch(model: Any, epoch: int) -> None:
    model._initial_epoch = int(epoch)


def optimizer_slot_references(optimizer: Any, variables: Sequence[Any]) -> list[tuple[Any, int | None]]:
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


def state_variables(model: Any) -> list[Any]:
    """The model's weights, then its optimizer's variables (if built): what a backup restores."""
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return list(model.weights) + extra


def tracked_variables(optimizer: Any) -> list[Any]:
    """The variables a built optimizer updates (what ``apply`` defaults to)."""
    return list(optimizer._trainable_variables)


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer that updates the variables: a LossScaleOptimizer's inner one, else itself."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def parallel_of(model: Any) -> Any:
    """The parallelism a model is distributed with, or None."""
    return model.__dict__.get("_rdkeras") if hasattr(model, "__dict__") else None


# -- instance overrides ------------------------------------------------------------------


def override(obj: Any, name: str, fn: Callable[..., Any]) -> None:
    """Replaces method `name` of this one object by ``fn(obj, *args, **kwargs)``; the class is untouched.
    :func:`original` gives the method it replaced."""
    originals = obj.__dict__.setdefault("_rdkeras_originals", {})
    if name not in originals:
        originals[name] = getattr(obj, name)
    object.__setattr__(obj, name, types.MethodType(fn, obj))


def original(obj: Any, name: str) -> Any:
    return obj.__dict__["_rdkeras_originals"][name]


def restore(obj: Any) -> None:
    """Removes every override from `obj`."""
    for name in obj.__dict__.pop("_rdkeras_originals", {}):
        obj.__dict__.pop(name, None)


# -- class-level hooks (while a strategy lives) -----------------------------------------

_fit_guards: list[Callable[[Any], None]] = []


def _patch_model_method(name: str, make: Callable[[Any], Callable[..., Any]]) -> Callable[[], None]:
    """Replaces method `name` where keras.Model's classes define it (so that checks like Keras's
    ``self.__class__.compile != Trainer.compile`` still hold) by ``make(previous)``; returns the
    function that undoes it."""
    import keras

    owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
    previous = owner.__dict__[name]
    setattr(owner, name, make(previous))

    def undo() -> None:
        setattr(owner, name, previous)

    return undo


@contextlib.contextmanager
def on_compile(attach: Callable[[Any], Any]) -> Iterator[None]:
    """While active, every ``Model.compile`` (``load_model`` compiles too) ends with ``attach(model)``."""

    def make(previous: Any) -> Any:
        @functools.wraps(previous)
        def compile(model: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
            result = previous(model, *args, **kwargs)
            attach(model)
            return result

        return compile

    undo = _patch_model_method("compile", make)
    try:
        yield
    finally:
        undo()


_unguard: list[Callable[[], None]] = []


def guard_fit(check: Callable[[Any], None]) -> None:
    """``check(model)`` runs before ``fit`` of any model that is not distributed (it may raise)."""
    if not _fit_guards:

        def make(previous: Any) -> Any:
            @functools.wraps(previous)
            def fit(model: Any, *args: Any, **kwargs: Any) -> Any:
                if parallel_of(model) is None:
                    for guard in list(_fit_guards):
                        guard(model)
                return previous(model, *args, **kwargs)

            return fit

        _unguard.append(_patch_model_method("fit", make))
    _fit_guards.append(check)


def unguard_fit(check: Callable[[Any], None]) -> None:
    if check in _fit_guards:
        _fit_guards.remove(check)
        if not _fit_guards and _unguard:
            _unguard.pop()()


# -- models --------------------------------------------------------------------------


def distribute_model(model: Any, parallel: Parallelism) -> None:
    """Makes a compiled model's fit/evaluate/predict run distributed with `parallel`."""
    object.__setattr__(model, "_rdkeras", parallel)
    model.__dict__["_rdkeras_jit_compile"] = model.jit_compile
    model.jit_compile = False  # the exchanges are tf.numpy_function ops
    methods: dict[str, Callable[..., Any]] = {
        "fit": _fit,
        "evaluate": _evaluate,
        "predict": _predict,
        "_maybe_symbolic_build": _maybe_symbolic_build,
        "_get_metrics_result_or_logs": _get_metrics_result_or_logs,
        "save": _save,
        "save_weights": _save_weights,
        **parallel.step_overrides(),
    }
    for name, fn in methods.items():
        override(model, name, fn)
    reset_compiled_functions(model)


def undistribute(model: Any) -> None:
    """Returns `model` (and its optimizer) to plain Keras."""
    if parallel_of(model) is None:
        return
    restore(model)
    model.jit_compile = model.__dict__.pop("_rdkeras_jit_compile", model.jit_compile)
    model.__dict__.pop("_rdkeras", None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        restore(optimizer)
        restore(inner_optimizer(optimizer))
    reset_compiled_functions(model)


def reset_compiled_functions(model: Any) -> None:
    """Keras caches its traced steps; they hold the exchanges, so they are traced anew."""
    for attr in ("train_function", "test_function", "predict_function"):
        setattr(model, attr, None)


def _fit(model: Any, *args: Any, **kwargs: Any) -> Any:
    parallel = parallel_of(model)
    fit = original(model, "fit")
    a = bind(fit, args, kwargs)
    parallel.check_callbacks(list(a["callbacks"] or []))
    parallel.shard_fit(a)
    callbacks, a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    a["callbacks"] = [_state_callback(parallel, "gather"), *callbacks, _state_callback(parallel, "sync")]
    parallel.fitting = True
    try:
        return fit(**a)
    finally:
        parallel.fitting = False


def _evaluate(model: Any, *args: Any, **kwargs: Any) -> Any:
    evaluate = original(model, "evaluate")
    if kwargs.get("_use_cached_eval_dataset"):  # fit's validation: sharded by fit
        return evaluate(*args, **kwargs)
    parallel = parallel_of(model)
    a = bind(evaluate, args, kwargs)
    parallel.shard_evaluate(a)
    a["callbacks"], a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    return evaluate(**a)


def _predict(model: Any, *args: Any, **kwargs: Any) -> Any:
    parallel = parallel_of(model)
    predict = original(model, "predict")
    a = bind(predict, args, kwargs)
    rows = parallel.shard_predict(a)
    a["callbacks"], a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    out = predict(**a)
    if rows is None:
        return out
    import keras

    return keras.tree.map_structure(lambda o: o[:rows], out)


def _maybe_symbolic_build(model: Any, iterator: Any = None, data_batch: Any = None) -> None:
    # Keras builds lazily on the first traced step when no tf.distribute strategy is set;
    # build now, so that every worker holds the same model before any computes a gradient.
    parallel = parallel_of(model)
    if iterator is not None and data_batch is None:
        for _, _, it in iterator:
            data_batch = next(it)
            break
    if data_batch is not None:
        symbolic_build(model, data_batch)
    if not parallel.synced and not parallel.fitting:  # fit shares state at on_train_begin
        parallel.sync_state(model, restored=False)
    original(model, "_maybe_symbolic_build")(iterator=iterator, data_batch=data_batch)


def _get_metrics_result_or_logs(model: Any, logs: Any) -> Any:
    return parallel_of(model).share_logs(original(model, "_get_metrics_result_or_logs")(logs))


# -- saving ----------------------------------------------------------------------------


def _atomic_path(filepath: Any, suffixes: tuple[str, ...]) -> Path | None:
    """`filepath` as a local Path when Keras writes it as one file with one of `suffixes`."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    text = os.fspath(filepath)
    if "://" in text or not text.endswith(suffixes):
        return None
    return Path(text)


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` for a temporary path beside `path` (same suffix), then renames it over
    `path`: readers see the old file or the new one, never a part."""
    suffix = ".weights.h5" if path.name.endswith(".weights.h5") else path.suffix
    stem = path.name[: -len(suffix)] if suffix else path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)  # Keras refuses to overwrite silently in some paths; let it create the file
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _save(model: Any, filepath: Any, overwrite: bool = True, zipped: Any = None, **kwargs: Any) -> Any:
    save = original(model, "save")
    path = _atomic_path(filepath, (".keras",))
    if path is None or zipped is False or (not overwrite and path.exists()):
        return save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
    write_atomically(path, lambda tmp: save(tmp, overwrite=True, zipped=zipped, **kwargs))
    return None


def _save_weights(model: Any, filepath: Any, overwrite: bool = True, max_shard_size: Any = None) -> Any:
    save_weights = original(model, "save_weights")
    path = _atomic_path(filepath, (".weights.h5",))
    if path is None or max_shard_size is not None or (not overwrite and path.exists()):
        return save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)
    write_atomically(path, lambda tmp: save_weights(tmp, overwrite=True))
    return None


# -- callbacks ----------------------------------------------------------------------------


def chief_only_callback_types() -> tuple[type, ...]:
    """Callbacks that write files or draw progress: they run on the reporting worker only."""
    import keras

    return (keras.callbacks.ModelCheckpoint, keras.callbacks.TensorBoard, keras.callbacks.CSVLogger,
            keras.callbacks.ProgbarLogger)  # fmt: skip


def worker_callbacks(parallel: Parallelism, callbacks: Any, verbose: Any) -> tuple[list, Any]:
    """(callbacks, verbose) for this worker: the reporter keeps all and the progress bar; the others
    drop the chief-only callbacks (by type, subclasses included). BackupAndRestore runs everywhere."""
    import keras

    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks, verbose  # Keras passing its own list on (fit's validation)
    kept = []
    for c in callbacks or []:
        if isinstance(c, keras.callbacks.BackupAndRestore):
            _adapt_backup(c, parallel)
        elif isinstance(c, chief_only_callback_types()) and not parallel.is_reporter:
            continue
        kept.append(c)
    return kept, (verbose if parallel.is_reporter else 0)


def _state_callback(parallel: Parallelism, role: str) -> Any:
    """Shares the training state across workers: "sync" at the start of fit (the reporter's
    restored backup, else the parallelism's initial sharing), "gather" at every epoch end and at
    the end of fit (each variable from its owner to everyone, so any worker can save the model)."""
    callback = _state_callback_class()()
    callback.parallel, callback.role = parallel, role
    return callback


@functools.cache
def _state_callback_class() -> type:
    import keras

    class StateCallback(keras.callbacks.Callback):
        parallel: Parallelism
        role: str

        def on_train_begin(self, logs: Any = None) -> None:
            if self.role == "sync":
                self.parallel.sync_state(self.model, restored=self.parallel.restored)
                self.parallel.restored = False

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self.role == "gather":
                self.parallel.gather_state(self.model)

        def on_train_end(self, logs: Any = None) -> None:
            if self.role == "gather":
                self.parallel.gather_state(self.model)

    return StateCallback


def _adapt_backup(callback: Any, parallel: Parallelism) -> None:
    """BackupAndRestore across workers: the reporter loads and writes the backup (atomically, with
    the epoch inside the weights file); every worker takes part in gathering the state first."""
    if "_rdkeras_originals" in callback.__dict__:
        return

    def save(cb: Any) -> None:
        parallel.gather_state(cb.model)  # collective: every worker saves at the same batches
        if parallel.is_reporter:
            _write_backup(cb)

    def load(cb: Any) -> None:
        if parallel.is_reporter and _load_backup(cb):
            parallel.restored = True

    def keep(cb: Any, logs: Any = None) -> None:
        if parallel.is_reporter:
            original(cb, "on_train_end")(logs)

    override(callback, "_save_model", save)
    override(callback, "_load_model", load)
    override(callback, "on_train_end", keep)


def _write_backup(cb: Any) -> None:
    import shutil

    import h5py

    weights, metadata = Path(cb._weights_path), Path(cb._training_metadata_path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    if cb.double_checkpoint:
        for src, dst in ((weights, Path(cb._prev_weights_path)), (metadata, Path(cb._prev_training_metadata_path))):
            if src.exists():

                def copy(tmp: str, src: Path = src) -> None:
                    shutil.copyfile(src, tmp)

                write_atomically(dst, copy)
    meta = json.dumps({"epoch": cb._current_epoch, "batch": cb._last_batch_seen})
    save_weights = original(cb.model, "save_weights") if parallel_of(cb.model) else cb.model.save_weights

    def write_weights(tmp: str) -> None:
        save_weights(tmp, overwrite=True)
        with h5py.File(tmp, "a") as f:  # the epoch travels with the weights: one rename commits both
            f.attrs[BACKUP_METADATA_ATTR] = meta

    write_atomically(weights, write_weights)

    def write_metadata(tmp: str) -> None:
        Path(tmp).write_text(meta)

    write_atomically(metadata, write_metadata)


def _load_backup(cb: Any) -> bool:
    """Keras's restore, reading the epoch from the weights file when it carries one."""
    import h5py

    model = cb.model
    if not model.built:
        raise ValueError(
            "To use the BackupAndRestore callback, your model must be built before you call `fit()`: "
            "call it on a batch of data (or give it an Input)"
        )
    weights, metadata = Path(cb._weights_path), Path(cb._training_metadata_path)
    meta = None
    if weights.exists():
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(str(weights))
        with h5py.File(weights, "r") as f:
            stamped = f.attrs.get(BACKUP_METADATA_ATTR)
        meta = json.loads(stamped) if stamped is not None else None
    if meta is None and metadata.exists():
        meta = json.loads(metadata.read_text())
    if meta is None:
        return False
    set_initial_epoch(model, meta["epoch"])
    return True


# -- optimizers --------------------------------------------------------------------------


def distribute_optimizer(optimizer: Any, apply: Callable[..., Any]) -> None:
    """``optimizer.apply(grads, variables)`` becomes ``apply(optimizer, original_apply, grads, variables)``."""

    def hooked(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        return apply(self, original(self, "apply"), list(grads), trainable_variables)

    override(optimizer, "apply", hooked)


def agree_on_finite_gradients(optimizer: Any, all_finite: Callable[[Any], Any]) -> None:
    """For a LossScaleOptimizer whose workers update different variables (parameter servers): every
    worker skips a step (and lowers the loss scale) when any worker's gradients are not finite.
    ``all_finite(local_finite)`` returns the job-wide verdict as a boolean tensor."""
    import keras
    import tensorflow as tf

    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return

    def apply(self: Any, base: Any, grads: list, variables: Any) -> Any:
        present = [g for g in grads if g is not None]
        if not present:
            return base(grads, variables)
        verdict = all_finite(self.check_finite(present))
        # A NaN in one gradient makes this worker's own check fail too; + 0 changes nothing otherwise.
        i = next(i for i, g in enumerate(grads) if g is not None)
        poison = tf.where(verdict, tf.constant(0.0, grads[i].dtype), tf.constant(float("nan"), grads[i].dtype))
        grads = [*grads[:i], grads[i] + poison, *grads[i + 1 :]]
        return base(grads, variables)

    distribute_optimizer(optimizer, apply)
