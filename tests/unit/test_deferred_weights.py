"""Weight gradients deferred to the step's end: which layers qualify, what the plan says, and that one
computation over the whole batch equals the sum of the micro-batches' gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from rdkeras.pipeline import analyze, build_stage, deferrable, deferred, make_plan


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
    plan = make_plan(model, PLACEMENT, 2, batch_size=32, micro_batches=4, defer_weight_gradients=True)
    assert (plan.deferred, plan.deferred_bytes) == ({1: ("relu", "linear")}, kept)
    assert "weight gradients once a step, over all micro-batches: stage 1 relu, linear (keeps 8.2 KB)" in plan.text()


def test_plain_convolutions_are_deferred_but_not_their_relatives():
    x = keras.Input((8, 8, 3), name="x")
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(x)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(h)
    h = keras.layers.SeparableConv2D(4, 3, padding="same", name="separable")(h)
    h = keras.layers.Conv2DTranspose(4, 3, padding="same", name="transpose")(h)
    h = keras.layers.Conv2D(4, 3, activation="gelu", name="gelu")(h)
    h = keras.layers.Flatten(name="flat")(keras.layers.Conv2D(2, 1, name="pointwise")(h))
    model = keras.Model(x, keras.layers.Dense(3, name="out")(h), name="cnn")
    plan = analyze(model, {"conv": 0, "depthwise": 0, "separable": 0, "transpose": 1}, 2, batch_size=8, micro_batches=2)
    names, kept = deferrable(model, plan)
    assert names == {0: ["conv"], 1: ["pointwise", "out"]}
    # conv keeps its input (8x8x3) and output (8x8x4); pointwise 6x6x4 and 6x6x2; out 72 and 3, all float32
    assert kept == {0: 8 * 4 * (8 * 8 * 3 + 8 * 8 * 4), 1: 8 * 4 * (6 * 6 * 4 + 6 * 6 * 2 + 72 + 3)}


def test_the_tapped_stage_names_each_deferred_layers_input_and_output_once():
    model = _model()
    plan = make_plan(model, PLACEMENT, 2, batch_size=32, micro_batches=4, defer_weight_gradients=True)
    stage = build_stage(model, plan, 1)
    assert [layer.name for layer in stage.deferred] == ["relu", "linear"]
    # relu's input is what stage 1 receives; its output is linear's input; after the model's output, linear's.
    assert stage.taps == [("in", 0), ("out", 1), ("out", 1), ("out", 2)]
    h = np.random.default_rng(0).random((8, 16), dtype=np.float32)
    outs = stage.tapped_model([h])
    np.testing.assert_allclose(outs[0], stage.model([h]), rtol=1e-6)
    np.testing.assert_allclose(outs[1], model.get_layer("relu")(h), rtol=1e-6)
    assert build_stage(model, plan, 0).tapped_model is None  # nothing deferred there


def test_a_layer_split_by_rows_defers_on_both_stages_over_its_rows_there():
    from rdkeras.pipeline.cut.split import split_model

    x = keras.Input((12,), name="x")
    h = keras.layers.Dense(16, name="widen")(x)
    h = keras.layers.Dense(16, activation="relu", name="big")(h)
    model = keras.Model(x, keras.layers.Dense(4, name="out")(h), name="m")
    split = split_model(model, {"big": (1, 2)})  # the later stage runs big for the last half of each micro-batch
    placement = {"widen": 0, "big__rows": 0, "big": 0, "big__twin": 1, "big__join": 1, "out": 1}
    plan = analyze(split, placement, 2, batch_size=32, micro_batches=4)
    names, kept = deferrable(split, plan)
    assert names == {0: ["widen", "big"], 1: ["big__twin", "out"]}
    # widen and out keep all 32 rows; each part of big its 4 of every micro-batch's 8 (16 in all), float32.
    assert kept == {0: 4 * (32 * (12 + 16) + 16 * (16 + 16)), 1: 4 * (16 * (16 + 16) + 32 * (16 + 4))}
    plan = make_plan(split, placement, 2, batch_size=32, micro_batches=4, defer_weight_gradients=True)
    assert (plan.deferred, plan.deferred_bytes) == ({0: ("widen", "big"), 1: ("big__twin", "out")}, kept)
    later = build_stage(split, plan, 1)
    assert later.deferred == [model.get_layer("big"), model.get_layer("out")]  # the twin computes with big's weights
    # The twin's input is what stage 1 receives for its rows; its output, one of the tapped model's.
    assert later.taps[0][0] == "in" and later.feeds[later.taps[0][1]].edge.producer == "big__rows:1"
    assert later.taps[1][0] == "out"
    h = np.random.default_rng(0).random((4, 16), dtype=np.float32)
    feed = [h if f.edge.producer == "big__rows:1" else np.zeros((4, 16), np.float32) for f in later.feeds]
    twin_output = later.tapped_model(feed)[later.taps[1][1]]
    np.testing.assert_allclose(twin_output, model.get_layer("big")(h), rtol=1e-6)


LAYERS = {
    "dense": (lambda a: keras.layers.Dense(24, activation=a), (10,)),
    "conv1d causal": (lambda a: keras.layers.Conv1D(6, 3, padding="causal", activation=a), (9, 4)),
    "conv2d strided": (lambda a: keras.layers.Conv2D(6, 3, strides=2, activation=a), (9, 9, 3)),
    "conv2d same": (lambda a: keras.layers.Conv2D(6, 3, padding="same", use_bias=False, activation=a), (8, 8, 3)),
    "conv3d": (lambda a: keras.layers.Conv3D(4, 2, activation=a), (4, 5, 5, 2)),
}


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", None])
def test_one_gradient_over_the_batch_equals_the_sum_over_micro_batches(kind, activation):
    make, shape = LAYERS[kind]
    layer = make(activation)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(32, *shape)).astype(np.float32))
    layer.build((None, *shape))
    upstream = tf.constant(rng.normal(size=(32, *layer.compute_output_shape((None, *shape))[1:])).astype(np.float32))
    assert deferred.defers_weight_gradients(layer)
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
        kept_dz.append(deferred.pre_activation_gradient(layer, y, dy))
    once = deferred.weight_gradients(layer, tf.concat(kept_x, 0), tf.concat(kept_dz, 0))
    for a, b in zip(once, summed, strict=True):  # float32 sums in another order: relative to the largest entry
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    assert layer.activation is keras.activations.get(activation)  # restored
