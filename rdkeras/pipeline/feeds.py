"""What one pipeline step feeds each stage: the reader's slices, the labels, the loss and metrics.

Data only: the schedule (:mod:`rdkeras.pipeline.schedule`) issues every transfer.

The reader (stage 0 of a replica) uses the batch Keras hands it: model inputs
consumed elsewhere go straight to their consumers, labels and sample weights
straight to the loss worker. Every other stage iterates the same batches only
to keep Keras's loop in step and to know the batch's row count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rdkeras import keras_internals
from rdkeras.fitting.global_batch import GlobalBatch
from rdkeras.parallel.sharding import unpack


def data_specs(x: Any, y: Any, sample_weight: Any, batch_size: int | None, full_batches: bool = False) -> tuple:
    """(rows per batch when every batch has them, label specs, sample-weight specs); with `full_batches`, those
    of the batches before a partial last one (rows None where the last batch is not partial)."""
    import keras
    import tensorflow as tf

    def from_arrays(arrays: Any, rows: int | None) -> list | None:
        if arrays is None:
            return None
        specs = []
        for a in keras.tree.flatten(arrays):
            a = np.asarray(a)
            dtype = keras.config.floatx() if a.dtype.kind == "f" else a.dtype.name
            specs.append(((rows, *a.shape[1:]), dtype))
        return specs

    def from_tensor_specs(specs: Any) -> list | None:
        if specs is None:
            return None
        return [(tuple(s.shape.as_list()), s.dtype.name) for s in keras.tree.flatten(specs)]

    if isinstance(x, tf.data.Dataset):
        _, ys, ws = unpack(x.element_spec)
        out_y, out_w = from_tensor_specs(ys), from_tensor_specs(ws)
        first = next((s for s in keras.tree.flatten(x.element_spec)), None)
        rows = first.shape[0] if first is not None and first.shape.rank else None
        return rows, out_y, out_w
    if isinstance(x, keras.utils.PyDataset):
        _, ys, ws = unpack(x[0])
        return None, from_arrays(ys, None), from_arrays(ws, None)
    if x is None:
        return None, None, None
    full = full_batch_rows(x, batch_size)
    rows = full if full_batches else None if full else min(batch_size or 32, len(keras.tree.flatten(x)[0]))
    return rows, from_arrays(y, rows), from_arrays(sample_weight, rows)


def full_batch_rows(x: Any, batch_size: int | None) -> int | None:
    """For arrays whose last batch is partial, the rows of every batch before it (else None)."""
    import keras
    import tensorflow as tf

    if x is None or isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return None
    batch_size = batch_size or 32
    samples = len(keras.tree.flatten(x)[0])
    return batch_size if samples > batch_size and samples % batch_size else None


class Feeds:
    """One step's data on this worker: the reader's slices, and what the loss worker needs."""

    def __init__(self, model: Any, run: Any, x: Any, y: Any, sw: Any):
        import keras
        import tensorflow as tf

        self.model, self.run, self.stage, self.plan = model, run, run.stage, run.plan
        self.graph = keras_internals.functional_of(model)
        self.y_struct, self.sw_struct = y, sw
        reader = self.stage.is_reader
        self.inputs = [self.split(t) for t in keras_internals.standardize_inputs(self.graph, x)] if reader else []
        # The reader sends the loss stage the whole batch's labels and weights once a step.
        self.whole_labels = keras.tree.flatten(y) if reader and y is not None else []
        self.whole_weights = keras.tree.flatten(sw) if reader and sw is not None else []
        self.labels = [self.split(t) for t in self.whole_labels]
        self.weights = [self.split(t) for t in self.whole_weights]
        self.split_received: dict[str, list[Any]] = {}  # loss stage: edge name -> the micro-batches' rows
        # Every worker iterates the same batches (only the reader's contents are used), so
        # each knows the batch's row count locally.
        first = keras.tree.flatten(x)[0]
        self.rows = tf.cast(tf.shape(first)[0], keras.config.floatx())
        self._batch_rows = first.shape[0] if first.shape[0] is not None else tf.shape(first, out_type=tf.int64)[0]
        self._metric_batches: list[tuple] = []
        self._draws: dict = {}  # the step's random draws, made by its first micro-batch and shared by the others

    def global_batch(self, m: int) -> GlobalBatch:
        """Micro-batch m as a part of the batch: its draws are its rows of one draw for the whole batch, with the
        seed one process uses, and its loss its share of the batch's (their sum is the batch's loss)."""
        import tensorflow as tf

        micro, n = self.plan.micro_batches, self._batch_rows
        if isinstance(n, int) and n % micro == 0:
            rows: Any = n // micro
            start: Any = m * rows
        else:  # as split() cuts them: the first micro-batches one row longer
            sizes = [(n + micro - 1 - i) // micro for i in range(micro)]
            rows, start = sizes[m], tf.add_n([tf.cast(r, tf.int64) for r in sizes[:m]]) if m else 0
        return GlobalBatch(start, rows, n, 1, None, draws=self._draws, parts=micro)

    def after_data(self) -> list[Any]:
        """What the step's first transfer waits for: this batch. A worker that only receives must not
        start a blocking receive before its own iterator has yielded, or at the end of a dataset of
        unknown length it would wait for a step that no worker runs."""
        return [self.rows]

    def split(self, t: Any) -> list[Any]:
        """`t`'s rows in the step's micro-batches (as every stage splits the batch)."""
        import tensorflow as tf

        m = self.plan.micro_batches
        if m == 1:
            return [t]
        if self.plan.batch_size is not None:
            return tf.split(t, m, axis=0)
        n = tf.shape(t)[0]
        return tf.split(t, tf.stack([(n + m - 1 - i) // m for i in range(m)]), num=m, axis=0)

    def model_outputs(self, outs: list[Any], received: dict[str, Any], m: int = 0) -> list[Any]:
        """The model's outputs for micro-batch m, from its stage model's outputs and what it received."""
        where = self.run.stage_for(m).outputs
        return [outs[ref] if kind == "local" else received[ref.name] for kind, ref in where]

    def loss(self, m: int, outs: list[Any], received: dict[str, Any], training: bool) -> Any:
        """Loss worker: micro-batch m's share of the full batch's loss."""
        import keras

        flat_pred = self.model_outputs(outs, received, m)
        y_pred = keras.tree.pack_sequence_as(keras_internals.outputs_struct(self.graph), flat_pred)
        if self.stage.is_reader:
            ys, ws = [p[m] for p in self.labels], [p[m] for p in self.weights]
        else:
            ys = [received[e.name] for e in self.stage.label_edges if e.kind == "labels"]
            ws = [received[e.name] for e in self.stage.label_edges if e.kind == "sample_weight"]
        y = keras.tree.pack_sequence_as(self.y_struct, ys) if self.y_struct is not None else None
        sw = keras.tree.pack_sequence_as(self.sw_struct, ws) if self.sw_struct is not None else None
        self._metric_batches.append((y, y_pred, sw))
        compile_loss = keras_internals.compiled_loss(self.model)
        if compile_loss is None:
            return None
        if self.plan.micro_batches == 1:
            return compile_loss(y, y_pred, sw)
        # Micro-batch m's share of the batch's loss: its sum over the batch's count where every value counts, else
        # its mean weighted by its rows (fitting.global_batch); the shares add up to the batch's loss.
        with keras_internals.global_batch_step(self.global_batch(m)):
            return compile_loss(y, y_pred, sw)

    def update_metrics(self, total_loss: Any) -> None:
        if total_loss is not None:
            keras_internals.loss_tracker(self.model).update_state(total_loss, sample_weight=self.rows)
        for y, y_pred, sw in self._metric_batches:
            self.model.compute_metrics(None, y, y_pred, sample_weight=sw)
        self._metric_batches.clear()
