"""The pipeline schedules' order of passes: every micro-batch's forward before its backward, each once, and what
1F1B bounds -- the activations stashed on a stage at once (GPipe: all M micro-batches'); which batches get a
static plan of their own."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from rdkeras.parallel import check_settings
from rdkeras.pipeline.feeds import full_batch_rows
from rdkeras.pipeline.schedule import most_stashed, passes_in_order


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 1), (2, 8), (3, 2), (4, 4), (4, 16), (3, 5)])
def test_every_pass_once_and_each_forward_before_its_backward(schedule, stages, micro_batches, group):
    for position in range(stages):
        order = passes_in_order(schedule, position, stages, micro_batches, group)
        assert sorted(order) == sorted(
            [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
        )
        assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(micro_batches))
        assert [m for kind, m in order if kind == "F"] == list(range(micro_batches))  # data arrive in order


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 8), (3, 4), (4, 16)])
def test_1f1b_stashes_at_most_the_stages_left_and_gpipe_every_micro_batch(stages, micro_batches):
    for position in range(stages):
        assert most_stashed(passes_in_order("1f1b", position, stages, micro_batches)) == stages - position
        assert most_stashed(passes_in_order("gpipe", position, stages, micro_batches)) == micro_batches


def test_1f1b_alternates_after_filling_the_pipeline():
    assert passes_in_order("1f1b", 0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                                ("B", 2), ("B", 3)]  # fmt: skip
    assert passes_in_order("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert passes_in_order("gpipe", 1, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]


def test_1f1b_in_pairs_runs_a_pair_of_forwards_then_a_pair_of_backwards():
    # Where a layer alternates between two stages by micro-batch, each pair holds one turn of it on each stage.
    assert passes_in_order("1f1b", 0, 2, 6, group=2) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("F", 4), ("F", 5), ("B", 2), ("B", 3),
        ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert passes_in_order("1f1b", 1, 2, 4, group=2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("F", 2), ("F", 3),
                                                         ("B", 2), ("B", 3)]  # fmt: skip
    # Twice the stash of single micro-batches: the stages left, in pairs.
    assert most_stashed(passes_in_order("1f1b", 0, 2, 8, group=2)) == 4
    assert most_stashed(passes_in_order("1f1b", 1, 2, 8, group=2)) == 2


def test_an_unknown_schedule_is_refused_and_pipeline_names_model_parallelism():
    with pytest.raises(ValueError, match="schedule must be '1f1b' \\(the default\\) or 'gpipe', got 'pipedream'"):
        check_settings("pipeline", placement={"a": 0, "b": 1}, schedule="pipedream")
    check_settings("pipeline", placement={"a": 0, "b": 1}, workers=2)  # the same checks as "model"
    with pytest.raises(ValueError, match="only 2 workers"):
        check_settings("pipeline", placement={"a": 0, "b": 2}, workers=2)


def test_full_batches_are_known_only_for_arrays_with_a_partial_last_batch():
    x = np.zeros((88, 3), np.float32)
    assert full_batch_rows(x, 16) == 16  # 5 x 16 + 8
    assert full_batch_rows({"a": x, "b": x}, 16) == 16
    assert full_batch_rows(x[:80], 16) is None  # every batch full: the one plan is static already
    assert full_batch_rows(x[:10], 16) is None  # one batch only
    assert full_batch_rows(x[:40], None) == 32  # Keras's default batch
    assert full_batch_rows(tf.data.Dataset.from_tensor_slices(x).batch(16), None) is None
