"""What the automatic cut and the pipeline bench time: a stage's compute as the step runs it."""

from __future__ import annotations

import keras
import pytest

from rdkeras.pipeline import build_stage, deferred, make_plan
from rdkeras.pipeline.cut import timing


def _convnet():
    x = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1")(x)
    h = keras.layers.BatchNormalization(name="norm")(h)  # never deferred
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="convnet")


@pytest.fixture
def whole_batch_gradients(monkeypatch):
    """Records (layer, rows) for every weight gradient computed once over a whole batch."""
    calls: list[tuple[str, int]] = []
    real = deferred.weight_gradients

    def recording(layer, inputs, pre_activation_grads):
        calls.append((layer.name, int(inputs.shape[0])))
        return real(layer, inputs, pre_activation_grads)

    monkeypatch.setattr(deferred, "weight_gradients", recording)
    return calls


def test_a_stage_is_timed_as_its_passes_and_its_tail(whole_batch_gradients):
    model = _convnet()
    placement = {"conv1": 0, "norm": 0, "conv2": 1, "flatten": 1, "out": 1}
    plan = make_plan(model, placement, 2, batch_size=16, micro_batches=4, defer_weight_gradients=True)
    assert plan.deferred == {0: ("conv1",), 1: ("conv2", "out")}
    passes, tail = timing.stage_compute(build_stage(model, plan, 1), rows=4, micro_batches=4, repeats=1)
    assert passes > 0 and tail > 0
    assert sorted(set(whole_batch_gradients)) == [("conv2", 16), ("out", 16)]  # once, over the 4 micro-batches
    plan = make_plan(model, placement, 2, batch_size=16, micro_batches=4)  # nothing deferred
    passes, tail = timing.stage_compute(build_stage(model, plan, 1), rows=4, micro_batches=4, repeats=1)
    assert passes > 0 and tail == 0.0
