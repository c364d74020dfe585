"""The one interface a parallelism implements: what the strategy, the Keras hooks and the schedules use.

A parallelism spreads compiled Keras models over the job's workers. The
strategy creates one, hands it every model compiled in its scope
(:meth:`Parallelism.attach`) and asks it for the plan; rdkeras's Keras policy
(:mod:`rdkeras.fitting`) calls the hooks below from the model's ``fit``,
``evaluate`` and ``predict`` and from its callbacks. Data, model (pipeline) and
hybrid parallelism implement it (:mod:`rdkeras.parallel.data_parallel`,
:mod:`rdkeras.parallel.model_parallel`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rdkeras._log import logger
from rdkeras.fitting.saving import kept_bytes

if TYPE_CHECKING:
    from rdkeras.elastic.membership import Membership
    from rdkeras.engine import Engine
    from rdkeras.parallel.collectives import Collectives
    from rdkeras.parallel.sharding import Sharding


class Parallelism(abc.ABC):
    """How compiled Keras models are spread over the job's workers.

    Attributes set by the implementation: `engine`, `collectives` (every worker's), `sharding` (how a
    global batch is split over the data-parallel replicas) and `global_batch_size` (of the last fit,
    when known). The Keras hooks keep a count of the steps run (`steps_run`) and three flags here: `synced`
    (every worker holds the same model yet), `restored` (BackupAndRestore loaded a backup on the reporter) and
    `fitting` (inside fit). In an elastic job, `membership` (:class:`rdkeras.elastic.membership.Membership`) is
    what fitting and the custom-loop API ask about a lost worker, a step's end and an epoch end; after a change
    it calls :meth:`rebind`.
    """

    engine: Engine
    collectives: Collectives
    sharding: Sharding
    membership: Membership | None = None  # an elastic job's membership (rdkeras.elastic.membership), or None
    global_batch_size: int | None = None
    synced: bool = False
    restored: bool = False
    backup_folder: Any = None  # BackupAndRestore's folder, where a sharded optimizer's state lies beside the backup
    fitting: bool = False
    steps_run: int = 0  # training steps (batches) fit has run under this parallelism, counted by its callbacks

    # -- where this worker sits ------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.engine.world_size

    @property
    @abc.abstractmethod
    def replicas(self) -> int:
        """Data-parallel replicas each global batch is split over."""

    @property
    @abc.abstractmethod
    def reporter_rank(self) -> int:
        """The worker with the loss, the progress bar and the chief-only callbacks."""

    @property
    def is_reporter(self) -> bool:
        return self.engine.rank == self.reporter_rank

    # -- models ---------------------------------------------------------------------------

    @abc.abstractmethod
    def attach(self, model: Any) -> Any:
        """Makes `model` (compiled) train distributed; returns it. Idempotent."""

    @property
    @abc.abstractmethod
    def models(self) -> list[Any]:
        """The models attached so far."""

    def detach_all(self) -> None:
        """Returns every attached model to plain Keras."""
        from rdkeras import fitting

        for model in self.models:
            fitting.undistribute(model)
        self._forget_models()

    def _forget_models(self) -> None:  # noqa: B027 (optional: implementations that keep models drop them)
        """Drops the attached models (after :meth:`detach_all` returned them to Keras)."""

    def _check_attachable(self, model: Any) -> bool:
        """False if `model` is attached here already; raises if it cannot be attached."""
        from rdkeras import fitting

        owner = fitting.parallel_of(model)
        if owner is self:
            return False
        if owner is not None:
            raise ValueError(f"model {model.name!r} is already distributed by another RDMAStrategy")
        if model.optimizer is None:
            raise ValueError("compile the model (with an optimizer) before distributing it")
        return True

    @property
    @abc.abstractmethod
    def plan(self) -> Any:
        """What crosses the wire each step (an object with ``text()``), or None before there is one."""

    def whole_optimizer_state(self, model: Any) -> list[Any] | None:
        """Collective: the variables a file of `model` holds of its optimizer, whole, where this parallelism keeps
        them in parts (sharded); None where the optimizer's own variables are whole already."""
        return None

    def whole_weights(self, model: Any) -> contextlib.AbstractContextManager[None]:
        """Collective: while in it, `model`'s variables hold their whole values, where this parallelism stores
        them sharded (``shard="parameters"``)."""
        return contextlib.nullcontext()

    def optimizer_saved_as(self, model: Any, variables: Sequence[Any]) -> contextlib.AbstractContextManager[None]:
        """While in it, a file Keras writes of `model` holds `variables` as its optimizer's (a sharded optimizer's
        whole state, or its own variables beside its shards), unwarned."""
        return contextlib.nullcontext()

    def save_optimizer_shards(self, model: Any, folder: Any) -> Any:
        """Collective, for a backup: where this parallelism shards `model`'s optimizer state, writes it as a sharded
        checkpoint in `folder` (named by its iteration) and returns that path; else None."""
        return None

    def save_checkpoint(self, model: Any, directory: Any) -> None:
        raise NotImplementedError(
            f"save_checkpoint with {type(self).__name__}: data parallelism only; save with model.save on the chief"
        )

    def load_checkpoint(self, model: Any, directory: Any) -> None:
        raise NotImplementedError(f"load_checkpoint with {type(self).__name__}: data parallelism only")

    def state_bytes(self, model: Any) -> dict[str, int]:
        """What training `model` keeps on this worker, in bytes: ``parameters`` (its weights) and ``optimizer``
        (its optimizer's variables), counted from the variables."""
        return kept_bytes(model)

    def plan_text(self) -> str:
        """The plan as Markdown ('' when there is none yet)."""
        plan = self.plan
        return plan.text() if plan is not None else ""

    # -- hooks rdkeras.fitting calls from fit/evaluate/predict --------------------------

    def prepare_fit(self, model: Any) -> None:  # noqa: B027 (optional: most parallelisms need nothing here)
        """Before fit traces its step: anything the model acquired since it was attached (its own optimizers)."""

    @abc.abstractmethod
    def shard_fit(self, a: dict) -> None:
        """Gives this worker its part of fit's data, in place in fit's bound arguments `a`."""

    @abc.abstractmethod
    def shard_evaluate(self, a: dict) -> None: ...

    @abc.abstractmethod
    def shard_predict(self, a: dict) -> int | None:
        """As shard_fit for predict; returns the rows of the output to keep (None: all)."""

    @abc.abstractmethod
    def step_overrides(self) -> dict[str, Callable[..., Any]]:
        """Model methods (``train_step``, ...) to replace on the attached model: name -> fn(model, ...)."""

    def check_callbacks(self, callbacks: list[Any]) -> None:
        """Raises for callbacks this parallelism cannot honour (before any worker starts fit)."""
        import keras

        if not self._partial_state_between_epochs:
            return
        for c in callbacks:
            if isinstance(c, keras.callbacks.ModelCheckpoint) and c.save_freq != "epoch":
                raise ValueError(
                    f"ModelCheckpoint(save_freq={c.save_freq!r}) with {self._partial_state_between_epochs}: between "
                    "epoch ends each worker holds only part of the training state, so a mid-epoch checkpoint would "
                    "be incomplete; use save_freq='epoch' (or BackupAndRestore(save_freq=N), which gathers the state "
                    "first)"
                )

    @property
    def _partial_state_between_epochs(self) -> str:
        """Names the setting under which workers hold parts of the state between epoch ends ('' if none)."""
        return ""

    @abc.abstractmethod
    def sync_state(self, model: Any, restored: bool) -> None:
        """At the start of fit (collective): every worker gets the same model (after a restore, the reporter's)."""

    @abc.abstractmethod
    def gather_state(self, model: Any) -> None:
        """At epoch ends and before backups (collective): every worker gets the whole training state."""

    @abc.abstractmethod
    def share_logs(self, logs: dict) -> dict:
        """Epoch and evaluation logs, identical on every worker (so callbacks decide alike)."""

    def epoch_logs(self, model: Any, logs: Any) -> Any:
        """The logs of an epoch's end or of ``evaluate`` (Keras's: the metrics' results, or a custom step's logs),
        identical on every worker (collective)."""
        from rdkeras import keras_internals

        return self.share_logs(keras_internals.original(model, keras_internals.EPOCH_LOGS_HOOK)(logs))

    # -- an elastic job (rdkeras.elastic; data parallelism only) -------------------------------------

    def rebind(self, engine: Engine) -> None:
        """Runs on `engine` from now on (an elastic group's next, whose rank and world `membership` yielded):
        the one call after a membership change; nothing of the old engine's is kept."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its members")

    def _share_restore(self, model: Any, restored: bool, root: int) -> bool:
        """Broadcasts from `root` whether it restored a backup, and its epoch (set here too); returns it."""
        from rdkeras import keras_internals

        (flags,) = self.collectives.broadcast(
            [np.asarray([float(restored), keras_internals.initial_epoch(model)], np.float64)], root=root
        )
        if flags[0]:
            keras_internals.set_initial_epoch(model, int(flags[1]))
            if self.is_reporter:
                logger.info(
                    f"resumed from BackupAndRestore's backup: {int(flags[1])} epoch(s) done, training on from epoch "
                    f"{int(flags[1]) + 1} (weights and optimizer state as they were then, on every worker)"
                )
        return bool(flags[0])
