"""Keras callbacks: what training moved over the wire, in TensorBoard."""

from __future__ import annotations

import time
from typing import Any

import keras

from rdkeras import fitting


def plan_text(model: Any) -> str:
    """What each step of `model` sends where, as Markdown (TensorBoard's text tab renders it):
    the data-parallel gradient exchange, or the model-parallel placement and cut edges."""
    parallel = fitting.parallel_of(model)
    if parallel is None:
        return "single process: nothing crosses a worker boundary"
    return parallel.plan_text()


class TrainingStats(keras.callbacks.Callback):
    """Writes throughput and communication per step as TensorBoard scalars (chief only).

    Scalars, under ``<log_dir>/rdkeras``: ``throughput/batches_per_s``,
    ``throughput/examples_per_s`` (examples of the global batch, the whole job, when its size is known),
    ``comm/bytes_sent``, ``comm/bytes_received`` (per step, this worker),
    ``comm/wait_ms`` (time blocked on peers per step), ``tracker/registrations``
    (cumulative; flat in a steady state); and, once, the text ``plan``: how the
    model is split and what crosses the wire each step (:func:`plan_text`).

    What happens between epochs (validation, checkpoints, the epoch-end gathering of
    state, the train function's first call of the next epoch being prepared) is not a
    step's: it goes to ``epoch_boundary/seconds`` and ``epoch_boundary/wait_ms`` (time
    blocked on peers in it; a peer that is slower through its boundary shows here),
    written at the first step of each later epoch, and the steps' scalars start afresh.

    Args:
        log_dir: The TensorBoard log folder (the same one as keras.callbacks.TensorBoard's is fine).
        update_freq: Write every this many steps.
    """

    def __init__(self, log_dir: str, update_freq: int = 1):
        super().__init__()
        self.log_dir, self.update_freq = log_dir, max(1, int(update_freq))
        self._writer: Any = None
        self._step = 0  # steps of this fit so far
        self._since = 0  # steps since the last sample
        self._engine_seen: Any = None  # an elastic job's group changes engines
        self._changes_seen = 0

    def _engine(self) -> Any:
        parallel = fitting.parallel_of(self.model)
        return parallel.engine if parallel is not None else None

    def _changes(self) -> list[dict[str, Any]]:
        """An elastic job's membership changes so far (none outside one)."""
        parallel = fitting.parallel_of(self.model)
        membership = getattr(parallel, "membership", None)
        return membership.changes if membership is not None else []

    def on_train_begin(self, logs: Any = None) -> None:
        self._engine_seen = self._engine()
        self._changes_seen = len(self._changes())
        self._open()

    def _open(self) -> None:
        """The chief writes (after a change in an elastic job, the new chief, into the same folder)."""
        import tensorflow as tf

        engine = self._engine()
        if engine is not None and engine.rank != 0:
            return
        self._writer = tf.summary.create_file_writer(f"{self.log_dir}/rdkeras")
        with self._writer.as_default():
            tf.summary.text("plan", plan_text(self.model), step=self._step)
        self._last = self._sample()

    def _membership_changed(self) -> None:
        """An elastic job's group re-formed: counters start afresh on the new engine; each change is an event
        (``elastic/workers``, ``elastic/reform_seconds`` and a line of text: who left or joined, at which step)."""
        import tensorflow as tf

        self._engine_seen = self._engine()
        if self._writer is None:
            self._open()
            if self._writer is None:
                return
        self._last, self._since = self._sample(), 0
        changes = self._changes()
        with self._writer.as_default():
            for change in changes[self._changes_seen :]:
                who = (f"worker {', '.join(map(str, change['joined']))} joined" if change["joined"]
                       else f"lost worker {', '.join(map(str, change['lost']))}")  # fmt: skip
                tf.summary.scalar("elastic/workers", change["workers"], step=self._step)
                tf.summary.scalar("elastic/reform_seconds", change["seconds"], step=self._step)
                tf.summary.text("elastic", f"step {change['step']}: {who}; {change['workers']} workers went on "
                                f"(re-formed in {change['seconds']:.2f} s)", step=self._step)  # fmt: skip
        self._changes_seen = len(changes)

    def _sample(self) -> dict:
        engine = self._engine()
        sample: dict[str, float] = {"time": time.perf_counter()}
        if engine is not None:
            sample.update(engine.traffic())
            sample["registrations"] = engine.counters()["registrations"]
        return sample

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._writer is None or self._step == 0:
            return
        import tensorflow as tf

        now, last = self._sample(), self._last
        scalars = {"epoch_boundary/seconds": now["time"] - last["time"]}
        if "wait_seconds" in now:
            scalars["epoch_boundary/wait_ms"] = (now["wait_seconds"] - last["wait_seconds"]) * 1e3
        with self._writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=self._step)
        self._last = now
        self._since = 0  # the next step's scalars cover that step only

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1  # (counted on every worker: a new chief goes on with the same numbers)
        if self._engine() is not self._engine_seen:
            self._membership_changed()
        if self._writer is None:
            return
        self._since += 1
        if self._step % self.update_freq:
            return
        import tensorflow as tf

        now, last = self._sample(), self._last
        steps, self._since = self._since, 0
        seconds = max(now["time"] - last["time"], 1e-9)
        scalars = {"throughput/batches_per_s": steps / seconds}
        batch_size = getattr(fitting.parallel_of(self.model), "global_batch_size", None)
        if batch_size:
            scalars["throughput/examples_per_s"] = steps * batch_size / seconds
        if "bytes_written" in now:
            scalars["comm/bytes_sent"] = (now["bytes_written"] - last["bytes_written"]) / steps
            scalars["comm/bytes_received"] = (now["bytes_received"] - last["bytes_received"]) / steps
            scalars["comm/wait_ms"] = (now["wait_seconds"] - last["wait_seconds"]) * 1e3 / steps
            scalars["tracker/registrations"] = now["registrations"]
        with self._writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=self._step)
        self._last = now

    def on_train_end(self, logs: Any = None) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
