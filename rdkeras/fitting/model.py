"""A distributed model: fit, evaluate and predict on every worker, each with its part of the data.

:func:`distribute_model` overrides methods on the user's model *object* (never its
class, through :mod:`rdkeras.keras_internals`):

- ``fit``/``evaluate``/``predict``: where Keras's own methods are reached (by ``model.fit`` or by a
  subclass's override through ``super()``, as KerasHub's tasks do), :func:`route` hands the call to
  the policy here: the arguments are bound to Keras's signature, the data given to the parallelism
  (which splits each global batch), chief-only callbacks and the progress bar dropped on the
  other workers, BackupAndRestore adapted (:mod:`rdkeras.fitting.backup`);
- Keras's build-before-training hook: the model is built from the data's spec, so every
  worker holds the same model before any computes a gradient;
- the per-epoch and per-evaluation logs: the metrics' state merged over the replicas before their
  results are read (:mod:`rdkeras.fitting.global_batch`), so logs are one process's and callbacks
  decide alike everywhere;
- ``save``/``save_weights``: atomic (:mod:`rdkeras.fitting.saving`);
- the parallelism's own steps (``train_step``, ...), where it has any.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rdkeras import errors, keras_internals
from rdkeras.fitting import backup, global_batch, saving
from rdkeras.fitting.elastic import retrying

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism

_PARALLEL_ATTR = "_rdkeras"  # on the model object: the parallelism it is distributed with
_JIT_ATTR = "_rdkeras_jit_compile"  # the user's jit_compile, given back when the model leaves the strategy
_OWN_OPTIMIZERS_ATTR = "_rdkeras_own_optimizers"  # optimizers of the model's own distributed at fit (see below)


def parallel_of(model: Any) -> Parallelism | None:
    """The parallelism a model is distributed with, or None."""
    return keras_internals.untracked(model, _PARALLEL_ATTR)


def distribute_model(model: Any, parallel: Parallelism) -> None:
    """Makes a compiled model's fit/evaluate/predict run distributed with `parallel`."""
    keras_internals.set_untracked(model, _PARALLEL_ATTR, parallel)
    keras_internals.set_untracked(model, _JIT_ATTR, model.jit_compile)
    model.jit_compile = False  # the exchanges are tf.numpy_function ops
    methods: dict[str, Callable[..., Any]] = {
        keras_internals.BUILD_HOOK: _build_before_training,
        keras_internals.EPOCH_LOGS_HOOK: _shared_logs,
        "save": saving.save,
        "save_weights": saving.save_weights,
        **parallel.step_overrides(),
    }
    for name, fn in methods.items():
        keras_internals.override(model, name, fn)
    reset_compiled_functions(model)


def undistribute(model: Any) -> None:
    """Returns `model` (and its optimizer) to plain Keras."""
    if parallel_of(model) is None:
        return
    keras_internals.restore(model)
    model.jit_compile = keras_internals.untracked(model, _JIT_ATTR, model.jit_compile)
    keras_internals.remove_untracked(model, _JIT_ATTR)
    keras_internals.remove_untracked(model, _PARALLEL_ATTR)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        keras_internals.restore(optimizer)
        keras_internals.restore(keras_internals.inner_optimizer(optimizer))
    for own in keras_internals.untracked(model, _OWN_OPTIMIZERS_ATTR, []):
        keras_internals.restore(own)
    keras_internals.remove_untracked(model, _OWN_OPTIMIZERS_ATTR)
    reset_compiled_functions(model)


def undistributed_own_optimizers(model: Any) -> list[Any]:
    """Optimizers the model holds in its attributes besides the compiled one and not distributed yet: those a
    custom ``compile`` keeps for its ``train_step`` (a GAN's ``d_optimizer``/``g_optimizer``)."""
    import keras

    found: list[Any] = []
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and value is not getattr(model, "optimizer", None):
            if not keras_internals.overridden(value) and all(value is not f for f in found):
                found.append(value)
    return found


def optimizers_of(model: Any) -> list[Any]:
    """The model's compiled optimizer and the optimizers of its own distributed at fit."""
    compiled = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    return compiled + list(keras_internals.untracked(model, _OWN_OPTIMIZERS_ATTR, []))


def remember_own_optimizer(model: Any, optimizer: Any) -> None:
    """Notes an optimizer of the model's own that was distributed, so :func:`undistribute` restores it."""
    keras_internals.set_untracked(
        model, _OWN_OPTIMIZERS_ATTR, [*keras_internals.untracked(model, _OWN_OPTIMIZERS_ATTR, []), optimizer]
    )


def reset_compiled_functions(model: Any) -> None:
    """Keras caches its traced steps; they hold the exchanges, so they are traced anew."""
    for attr in ("train_function", "test_function", "predict_function"):
        setattr(model, attr, None)


def route(model: Any, name: str) -> Callable[..., Any] | None:
    """The handler of Keras's own ``fit``/``evaluate``/``predict`` for `model` (None: Keras's own, undistributed):
    ``handler(keras_method, *args, **kwargs)`` (:func:`rdkeras.keras_internals.route_trainer_methods`)."""
    if parallel_of(model) is None:
        return None
    return {"fit": _fit, "evaluate": _evaluate, "predict": _predict}[name]


def _parallel(model: Any) -> Parallelism:
    parallel = parallel_of(model)
    assert parallel is not None  # (only distributed models have these overrides)
    return parallel


def bind(method: Any, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call to bound `method`, by name, with defaults filled in."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.update(a.pop("kwargs", {}))
    return a


def _fit(fit: Any, *args: Any, **kwargs: Any) -> Any:
    model = fit.__self__
    parallel = _parallel(model)
    a = bind(fit, args, kwargs)
    parallel.check_callbacks(list(a["callbacks"] or []))
    folders = _save_folders(a["callbacks"])
    if parallel.is_reporter:  # the worker that saves: what a killed save of an earlier run left behind goes
        for folder in folders:
            saving.remove_stale_temporaries(folder)
    parallel.prepare_fit(model)
    parallel.shard_fit(a)
    callbacks, a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    saves = None
    if parallel.membership is not None:  # the step takes its global batch itself, and repeats after a loss
        from rdkeras.fitting.elastic import ElasticTrainFunction, EpochEndSaves

        saves = EpochEndSaves(model, parallel, callbacks, folders)  # (a chief lost in a save: the next one saves)
        model.train_function = ElasticTrainFunction(model, parallel, saves=saves)
        model.test_function = ElasticTrainFunction(model, parallel, training=False, saves=saves)
    a["callbacks"] = [_state_callback(parallel, "gather", saves), *callbacks, _state_callback(parallel, "sync", saves)]
    parallel.fitting = True
    try:
        with _warnings_on_the_reporter(parallel), _peer_errors_unwrapped(parallel):
            return fit(**a)
    finally:
        parallel.fitting = False


def _save_folders(callbacks: Any) -> set[str]:
    """The folders the saving callbacks among `callbacks` write into."""
    import keras

    folders = set()
    for c in callbacks or []:
        if isinstance(c, keras.callbacks.ModelCheckpoint):
            folders.add(os.path.dirname(os.path.abspath(os.fspath(c.filepath))))
        elif isinstance(c, keras.callbacks.BackupAndRestore):
            folders.add(str(keras_internals.backup_paths(c)[0].parent))
    return folders


def _evaluate(evaluate: Any, *args: Any, **kwargs: Any) -> Any:
    if keras_internals.is_fit_validation(kwargs):  # given to the parallelism by fit already
        return evaluate(*args, **kwargs)
    parallel = _parallel(evaluate.__self__)
    a = bind(evaluate, args, kwargs)
    parallel.shard_evaluate(a)
    a["callbacks"], a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    with _warnings_on_the_reporter(parallel), _peer_errors_unwrapped(parallel):
        return evaluate(**a)


def _predict(predict: Any, *args: Any, **kwargs: Any) -> Any:
    parallel = _parallel(predict.__self__)
    a = bind(predict, args, kwargs)
    rows = parallel.shard_predict(a)
    a["callbacks"], a["verbose"] = worker_callbacks(parallel, a["callbacks"], a["verbose"])
    with _warnings_on_the_reporter(parallel), _peer_errors_unwrapped(parallel):
        out = predict(**a)
    if rows is None:
        return out
    import keras

    return keras.tree.map_structure(lambda o: o[:rows], out)


@contextlib.contextmanager
def _warnings_on_the_reporter(parallel: Parallelism) -> Iterator[None]:
    """Keras's warnings about the program ("your input ran out of data", an ignored ``shuffle``) come from the
    reporter alone, as its progress does; every other worker would only repeat them."""
    if parallel.is_reporter:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"keras(\.|$)")
        yield


@contextlib.contextmanager
def _peer_errors_unwrapped(parallel: Parallelism) -> Iterator[None]:
    """A PeerError raised inside a traced step reaches the caller as TensorFlow's error (``UnknownError``), without
    its ``.rank``: it is raised again as rdkeras's PeerError, its rank and message restored, chained from
    TensorFlow's."""
    try:
        yield
    except Exception as e:
        found = errors.unwrapped(e, parallel.engine.backend.failure, parallel.engine.rank)
        if found is None:
            raise
        raise found from e


def _build_before_training(model: Any, iterator: Any = None, data_batch: Any = None) -> None:
    # Keras builds lazily on the first traced step when no tf.distribute strategy is set; build now, so that every
    # worker holds the same model before any computes a gradient. From the batches' spec: taking a batch would
    # start an iterator of the data that one process never starts (a seeded shuffle would then differ).
    parallel = _parallel(model)
    if iterator is not None and data_batch is None:
        data_batch = keras_internals.data_spec(iterator)
    if data_batch is not None and keras_internals.has_own_call(model):
        # A model without call() (a GAN's train_step drives its parts) is not built, as in plain Keras.
        keras_internals.symbolic_build(model, data_batch)
    global_batch.weigh_loss_trackers(model)  # (built now: a recompile makes new ones)
    if not parallel.synced and not parallel.fitting:  # fit shares state at on_train_begin
        parallel.sync_state(model, restored=False)


def _shared_logs(model: Any, logs: Any) -> Any:
    parallel = _parallel(model)
    return retrying(parallel, model, lambda: parallel.epoch_logs(model, logs))


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
            backup.adapt(c, parallel)
        elif isinstance(c, chief_only_callback_types()) and not parallel.is_reporter:
            if parallel.membership is not None:  # this worker may become the chief when the chief is lost
                kept.append(reporter_gate_class()(c, parallel))
            continue
        kept.append(c)
    return kept, (verbose if parallel.is_reporter else 0)


@functools.cache
def reporter_gate_class() -> type:
    import keras

    class ReporterGate(keras.callbacks.Callback):
        """A chief-only callback on another worker of an elastic job: silent until this worker becomes the chief
        (the chief was lost), then started where training stands (``on_train_begin``, ``on_epoch_begin``) and
        given every call from there on -- checkpoints and TensorBoard go on in the same folders. An epoch end it
        held back is run by :meth:`catch_up` when the chief was lost during that epoch end's saves."""

        def __init__(self, inner: Any, parallel: Parallelism):
            super().__init__()
            self.inner, self.parallel, self.started, self.epoch = inner, parallel, False, 0
            self.pending: tuple[int, dict] | None = None  # (epoch, logs) of the epoch end not run here

        def _live(self) -> bool:
            """Whether to forward calls: once this worker is the chief (started first, where training stands;
            the callback sees the model only then: TensorBoard's would write its graph at once)."""
            if self.parallel.is_reporter and not self.started:
                self.started = True
                self.inner.set_params(self.params)
                self.inner.set_model(self.model)
                self.inner.on_train_begin()
                self.inner.on_epoch_begin(self.epoch)
            return self.started

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch, started, self.pending = epoch, self.started, None
            if self._live() and started:
                self.inner.on_epoch_begin(epoch, logs)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self._live():
                self.inner.on_epoch_end(epoch, logs)
            else:
                self.pending = (epoch, dict(logs or {}))

        def catch_up(self) -> None:
            """The chief was lost during this epoch end's saves: on its successor, the epoch end it held back."""
            pending, self.pending = self.pending, None
            if pending is not None and self._live():
                self.inner.on_epoch_end(*pending)

    def forward(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> None:
            if self._live():
                getattr(self.inner, name)(*args, **kwargs)

        return hook

    for name in ("on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
                 "on_test_batch_begin", "on_test_batch_end", "on_train_end"):  # fmt: skip
        setattr(ReporterGate, name, forward(name))
    return ReporterGate


def _state_callback(parallel: Parallelism, role: str, saves: Any = None) -> Any:
    """Shares the training state across workers: "sync" at the start of fit (the reporter's
    restored backup, else the parallelism's initial sharing), "gather" at every epoch end and at
    the end of fit (each variable from its owner to everyone, so any worker can save the model).
    In an elastic job, the epoch end's saves lie between the two (`saves`: rdkeras.fitting.elastic's)."""
    callback = _state_callback_class()()
    callback.parallel, callback.role, callback.saves = parallel, role, saves
    return callback


@functools.cache
def _state_callback_class() -> type:
    import keras

    class StateCallback(keras.callbacks.Callback):
        parallel: Parallelism
        role: str
        saves: Any

        def on_train_begin(self, logs: Any = None) -> None:
            if self.role == "sync":
                self.parallel.sync_state(self.model, restored=self.parallel.restored)
                self.parallel.restored = False

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if self.role == "gather":
                self.parallel.steps_run += 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if self.role == "gather":
                retrying(self.parallel, self.model, lambda: self.parallel.gather_state(self.model))
                if self.saves is not None:
                    self.saves.began()
                return
            if self.saves is not None:  # "sync", after every callback's epoch end
                self.saves.ended(epoch, logs)
            parallel, membership = self.parallel, self.parallel.membership
            if membership is not None and epoch + 1 < self.params.get("epochs", 0):  # replacements join where an
                # epoch begins (the callbacks done: a replacement starts at the next epoch, and takes what they
                # changed, a learning rate)
                membership.retry(parallel, self.model, lambda: membership.admit(parallel, self.model, epoch + 1))

        def on_train_end(self, logs: Any = None) -> None:
            if self.role == "gather":
                retrying(self.parallel, self.model, lambda: self.parallel.gather_state(self.model))

    return StateCallback
