"""Weight gradients deferred to the step's end: which layers qualify, what the plan says, and that one
computation over the whole batch equals the sum of the micro-batches' gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from rdkeras import keras_internals
from rdkeras.graph import analyze, build_stage, deferrable


def _model():
    x = keras.Input((12,), name="x")
    h = keras.layers.Dense(16, activation="elu", name="first")(x)
    h = keras.layers.Dense(16, activation="relu", name="relu")(h)
    h = keras.layers.Dense(16, name="linear")(h)
    h = keras.layers.Dense(16, activation="softplus", name="softplus")(h)
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2", name="regularized")(h)
    shared = keras.layers.Dense(16, activation="relu", name="shared")
    h = shared(shared(h))
    frozen = keras.layers.Dense(16, activation="relu", name="frozen")
    frozen.trainable = False
    h = frozen(h)
    return keras.Model(x, keras.layers.Dense(4, activation="softmax", name="out")(h), name="m")


PLACEMENT = {"first": 0, "relu": 1, "linear": 1, "softplus": 1, "regularized": 1, "shared": 1, "frozen": 1, "out": 1}


def test_only_plain_dense_layers_called_once_are_deferred():
    model = _model()
    plan = analyze(model, PLACEMENT, 2, batch_size=32, micro_batches=4)
    names, kept = deferrable(model, plan)
    # elu, softplus, regularized, shared, frozen and softmax wait for nobody
    assert names == {1: ["relu", "linear"]}
    assert kept == {1: 32 * (16 + 16 + 16 + 16) * 4}  # the whole batch's inputs and outputs, float32
    plan.deferred, plan.deferred_bytes = names, kept
    assert "weight gradients once a step, over all micro-batches: stage 1 relu, linear (keeps 8.2 KB)" in plan.text()


def test_the_tapped_stage_names_each_deferred_layers_input_and_output_once():
    model = _model()
    plan = analyze(model, PLACEMENT, 2, batch_size=32, micro_batches=4)
    plan.deferred, plan.deferred_bytes = deferrable(model, plan)
    stage = build_stage(model, plan, 1)
    assert [layer.name for layer in stage.deferred] == ["relu", "linear"]
    # relu's input is what stage 1 receives; its output is linear's input; after the model's output, linear's.
    assert stage.taps == [("in", 0), ("out", 1), ("out", 1), ("out", 2)]
    h = np.random.default_rng(0).random((8, 16), dtype=np.float32)
    outs = stage.tapped_model([h])
    np.testing.assert_allclose(outs[0], stage.model([h]), rtol=1e-6)
    np.testing.assert_allclose(outs[1], model.get_layer("relu")(h), rtol=1e-6)
    assert build_stage(model, plan, 0).tapped_model is None  # nothing deferred there


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", None])
def test_one_gradient_over_the_batch_equals_the_sum_over_micro_batches(activation):
    layer = keras.layers.Dense(24, activation=activation)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(32, 10)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(32, 24)).astype(np.float32))
    layer.build((None, 10))
    assert keras_internals.defers_weight_gradients(layer)
    summed = None
    kept_x, kept_dz = [], []
    for part in range(4):  # what a stage does per micro-batch: every gradient, or only the pre-activation one
        rows = slice(part * 8, (part + 1) * 8)
        with tf.GradientTape(persistent=True) as tape:
            y = layer(x[rows])
            objective = tf.reduce_sum(y * upstream[rows])
        grads = tape.gradient(objective, layer.trainable_variables)
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
        dy = tape.gradient(objective, y)
        kept_x.append(x[rows])
        kept_dz.append(keras_internals.pre_activation_gradient(layer, y, dy))
    once = keras_internals.dense_weight_gradients(layer, tf.concat(kept_x, 0), tf.concat(kept_dz, 0))
    for a, b in zip(once, summed, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert layer.activation is keras.activations.get(activation)  # restored
