"""An elastic job's training step: a lost worker is replaced by a smaller group, inside the same ``fit``.

Keras's ``fit`` calls ``model.train_function(iterator)`` once per step. Under an elastic job
that function takes the step's *global* batch from the iterator itself, eagerly, and runs the
step (every worker takes its rows of it inside ``train_step``, by the rank and world the
parallelism holds in a variable). When the step fails because a worker was lost, the
parallelism's membership re-forms the group (:meth:`rdkeras.elastic.membership.Membership.recover`): every
survivor takes the state of the one that applied the most steps, and the same global batch
is split over the new world. If that survivor had applied this step already, it is done
here too; otherwise it runs again. Either way every survivor ends the step with the state
one process would have: nothing is lost but the time the step took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdkeras._log import logger

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism


def retrying(parallel: Parallelism, model: Any, collective: Callable[[], Any]) -> Any:
    """Runs `collective` (an epoch end's sharing of logs or state); in an elastic job, a worker lost during it
    makes the group re-form and run it again (:meth:`rdkeras.elastic.membership.Membership.retry`)."""
    if parallel.membership is None:
        return collective()
    return parallel.membership.retry(parallel, model, collective)


class ElasticTrainFunction:
    """``model.train_function`` under an elastic job (see the module docstring); with `training` False,
    ``model.test_function`` (fit's validation, evaluate): a step lost there runs again on the new group."""

    def __init__(self, model: Any, parallel: Parallelism, training: bool = True, saves: EpochEndSaves | None = None):
        import tensorflow as tf

        if model.steps_per_execution != 1:
            raise ValueError(
                f"steps_per_execution={model.steps_per_execution}: an elastic job repeats the step a lost worker "
                "interrupted, one step at a time; compile with steps_per_execution=1"
            )
        assert parallel.membership is not None
        self.model, self.parallel, self.training, self.saves = model, parallel, training, saves
        self.membership = parallel.membership

        def step(data: Any) -> Any:
            return model.train_step(data) if training else model.test_step(data)

        self._step = step if model.run_eagerly else tf.function(step, reduce_retracing=True, jit_compile=False)

    def __call__(self, iterator: Any) -> Any:
        next_batch = iterator.get_next_as_optional()
        if not next_batch.has_value():
            raise StopIteration
        data = next_batch.get_value()
        while True:
            counters = self._counters()
            committed = [v.numpy() for v in counters]
            try:
                logs = self._step(data)
            except Exception as e:
                if not self.membership.lost_a_worker(self.parallel, e):
                    raise
                # An update that does not wait for the gradients (the optimizer's step count) may have run.
                for v, value in zip(counters, committed, strict=True):
                    v.assign(value)
                done = self.membership.recover(self.parallel, self.model)
                if self.saves is not None:
                    self.saves.tidy()
                if done and self.training:  # the survivor it now mirrors applied it
                    return self.model.get_metrics_result()
                continue
            self.membership.stepped(self.parallel)
            return logs

    def _counters(self) -> list[Any]:
        """The optimizers' scalar variables (step counts, a loss scale's): TensorFlow orders their updates after
        nothing the exchange produces, so a step that fails in the exchange may still have advanced them."""
        from rdkeras import fitting

        found: list[Any] = []
        if not self.training:
            return found
        for optimizer in fitting.optimizers_of(self.model):
            if optimizer.built:
                found += [v for v in optimizer.variables if len(v.shape) == 0 and all(v is not f for f in found)]
        return found


class EpochEndSaves:
    """What an elastic job's chief saves at an epoch end survives the chief's loss.

    Only the chief runs the chief-only callbacks (ModelCheckpoint, TensorBoard, CSVLogger); the others hold
    them gated (``ReporterGate`` in :mod:`rdkeras.fitting.model`), noting the epoch end they did not run. After
    every callback's ``on_epoch_end``, the workers meet (:meth:`ended`, one allreduce of a scalar): a chief lost
    while it saved makes that meeting fail, the group re-forms, and the new chief runs the epoch end it missed
    -- with the state every survivor holds (gathered before the callbacks: the lost chief's own) and the epoch's
    logs -- and BackupAndRestore saves again on every worker. The new chief first removes the temporary files
    the lost chief's interrupted write left (:meth:`tidy`, also after a loss in the middle of an epoch).
    """

    def __init__(self, model: Any, parallel: Parallelism, callbacks: list[Any], folders: set[str]):
        assert parallel.membership is not None
        self.model, self.parallel, self.callbacks, self.folders = model, parallel, callbacks, folders
        self.membership = parallel.membership
        self.chiefs = self.tidied = self.membership.chiefs_lost

    def began(self) -> None:
        """Where the epoch end's saving callbacks begin (the state gathered)."""
        self.chiefs = self.membership.chiefs_lost

    def ended(self, epoch: int, logs: Any) -> None:
        """After every callback's ``on_epoch_end`` (collective): see the class."""
        import keras

        from rdkeras.fitting.model import reporter_gate_class

        parallel, membership = self.parallel, self.membership
        while True:
            membership.retry(parallel, self.model, lambda: parallel.collectives.mean([0.0]))
            self.tidy()
            if membership.chiefs_lost == self.chiefs:
                return
            self.chiefs = membership.chiefs_lost  # (lost again while the new chief saves: it runs again)
            if parallel.is_reporter:
                logger.warning(f"elastic: the chief was lost in epoch {epoch + 1}'s saves: worker {membership.worker}, "
                               "the new chief, saves that epoch")  # fmt: skip
            gate = reporter_gate_class()
            for c in self.callbacks:
                if isinstance(c, gate):
                    c.catch_up()  # type: ignore[attr-defined]
                elif isinstance(c, keras.callbacks.BackupAndRestore):  # collective: every worker runs it
                    c.on_epoch_end(epoch, logs)

    def tidy(self) -> None:
        """After a re-forming: if this worker became the chief, removes the temporary files the lost chief's
        interrupted save left in the saving callbacks' folders (it is gone: no save of its is running)."""
        lost = self.membership.chiefs_lost
        if lost == self.tidied:
            return
        self.tidied = lost
        if not self.parallel.is_reporter:
            return
        from rdkeras.fitting import saving

        for folder in sorted(self.folders):
            for path in saving.remove_stale_temporaries(folder):
                logger.info(f"elastic: removed {path}, the lost chief's interrupted save")
