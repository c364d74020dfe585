"""The global batch's losses, in one process: each replica's part (rdkeras.fitting.global_batch) averages, over the
replicas, to the loss Keras computes for the whole batch, for every reduction, with masks and sample weights whose
totals differ between the parts, and with a part that has no rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from rdkeras import keras_internals
from rdkeras.fitting.global_batch import GlobalBatch

REDUCTIONS = ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight"]
ROWS = 7  # split 4 + 3 over 2 replicas, or 7 + 0


def _case(weighted: bool, masked: bool):
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 5, (ROWS, 6))
    logits = rng.standard_normal((ROWS, 6, 5)).astype("float32")
    weights = np.where(np.arange(ROWS) < 4, 3.0, 0.5).astype("float32")[:, None] if weighted else None
    mask = (np.arange(6)[None, :] < np.array([1, 2, 6, 6, 6, 6, 3])[:, None]) if masked else None
    return y_true, logits, weights, mask


def _loss(reduction: str, y_true, logits, weights, mask):
    """The loss Keras's SparseCategoricalCrossentropy computes for these rows (a mask as Keras attaches it)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    logits = tf.convert_to_tensor(logits)
    if mask is not None:
        logits._keras_mask = tf.convert_to_tensor(mask)
    return loss(y_true, logits, sample_weight=weights)


@pytest.mark.parametrize("split", [(4, 3), (7, 0)], ids=["4+3", "7+0"])
@pytest.mark.parametrize(("weighted", "masked"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_replicas_mean_is_the_whole_batchs_loss(reduction, weighted, masked, split):
    y_true, logits, weights, mask = _case(weighted, masked)
    whole = float(_loss(reduction, y_true, logits, weights, mask))

    def losses(sum_over_replicas):
        out = []
        for start, rows in ((0, split[0]), (split[0], split[1])):
            rows_of = slice(start, start + rows)
            with keras_internals.global_batch_step(GlobalBatch(start, rows, ROWS, 2, sum_over_replicas)):
                out.append(
                    _loss(
                        reduction,
                        y_true[rows_of],
                        logits[rows_of],
                        None if weights is None else weights[rows_of],
                        None if mask is None else mask[rows_of],
                    )
                )
        return out  # fmt: skip

    # Where the count needs every replica's rows, each replica's goes through the collective: record them, then
    # hand each replica their sum, as the allreduce does.
    counts: list = []
    losses(lambda count: counts.append(count) or count)
    parts = losses(lambda count: tf.add_n(counts))
    assert len(counts) in (0, 2)  # (none where every value counts: known from the batch's rows)
    np.testing.assert_allclose(sum(float(p) for p in parts) / 2, whole, rtol=1e-6, atol=1e-6)


def test_a_replicas_loss_tracker_records_the_batchs_loss_for_uneven_parts():
    # Replica losses N x their shares, weighted by the batch's rows over N: the merged tracker holds the batch's
    # loss and rows, whatever the parts' rows (Keras would weigh each by its own rows).
    shares = [0.25, 0.75]  # of a batch's loss of 1.0
    total = tracked_rows = 0.0
    for share in shares:
        value, weight = GlobalBatch(0, 1, 3, 2, None).tracked(tf.constant(2 * share))
        total, tracked_rows = total + float(value) * float(weight), tracked_rows + float(weight)
    assert total / tracked_rows == pytest.approx(1.0) and tracked_rows == pytest.approx(3.0)
    # A pipeline's micro-batches: their losses are shares, counted M times.
    total = tracked_rows = 0.0
    for share in shares:
        value, weight = GlobalBatch(0, 1, 3, 1, None, parts=2).tracked(tf.constant(share))
        total, tracked_rows = total + float(value) * float(weight), tracked_rows + float(weight)
    assert total / tracked_rows == pytest.approx(1.0) and tracked_rows == pytest.approx(3.0)
