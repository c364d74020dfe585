"""An elastic job's training step: a lost worker is replaced by a smaller group, inside the same ``fit``.

Keras's ``fit`` calls ``model.train_function(iterator)`` once per step. Under an elastic job
that function takes the step's *global* batch from the iterator itself, eagerly, and runs the
step (every worker takes its rows of it inside ``train_step``, by the rank and world the
parallelism holds in a variable). When the step fails because a worker was lost, the
parallelism re-forms the group (:meth:`rdkeras.parallel.base.Parallelism.recover`): every
survivor takes the state of the one that applied the most steps, and the same global batch
is split over the new world. If that survivor had applied this step already, it is done
here too; otherwise it runs again. Either way every survivor ends the step with the state
one process would have: nothing is lost but the time the step took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism


class ElasticTrainFunction:
    """``model.train_function`` under an elastic job (see the module docstring); with `training` False,
    ``model.test_function`` (fit's validation, evaluate): a step lost there runs again on the new group."""

    def __init__(self, model: Any, parallel: Parallelism, training: bool = True):
        import tensorflow as tf

        if model.steps_per_execution != 1:
            raise ValueError(
                f"steps_per_execution={model.steps_per_execution}: an elastic job repeats the step a lost worker "
                "interrupted, one step at a time; compile with steps_per_execution=1"
            )
        self.model, self.parallel, self.training = model, parallel, training

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
                if not self.parallel.lost_a_worker(e):
                    raise
                # An update that does not wait for the gradients (the optimizer's step count) may have run.
                for v, value in zip(counters, committed, strict=True):
                    v.assign(value)
                if self.parallel.recover(self.model) and self.training:  # the survivor it now mirrors applied it
                    return self.model.get_metrics_result()
                continue
            self.parallel.stepped()
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
