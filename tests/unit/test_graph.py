"""The graph analyzer and rewriter, in one process: plans, placement rules, clear errors."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest

from rdkeras.pipeline import analyze, assign_layers, build_stage, make_plan


@pytest.fixture(scope="module")
def vgg16():
    return keras.applications.VGG16(weights=None)  # 224x224x3 -> 1000 classes, 138 M parameters


def _mlp():
    x = keras.Input((20,), name="x")
    h = keras.layers.Dense(32, name="fc1")(x)
    h = keras.layers.Dense(32, name="fc2")(h)
    h = keras.layers.Dense(16, name="hidden")(h)
    return keras.Model(x, keras.layers.Dense(5, name="out")(h), name="mlp")


def test_vgg16_features_classifier_plan(vgg16):
    placement = {"block*": 0, "flatten": 1, "fc*": 1, "predictions": 1}
    plan = analyze(vgg16, placement, 2, batch_size=32, label_specs=[((None,), "int64")])
    assert plan.layers_of(0) == [
        f"block{b}_{k}"
        for b, n in [(1, 2), (2, 2), (3, 3), (4, 3), (5, 3)]
        for k in [*(f"conv{i}" for i in range(1, n + 1)), "pool"]
    ]
    assert plan.layers_of(1) == ["flatten", "fc1", "fc2", "predictions"]
    assert plan.stage_order == (0, 1) and plan.loss_stage == 1
    assert len(plan.edges) == 2
    act, labels = plan.edges
    assert (act.producer, act.consumers, act.src, act.dst) == ("block5_pool:0", ("flatten",), 0, 1)
    assert act.shape == (32, 7, 7, 512) and act.dtype == "float32"
    assert act.bytes_per_step == 32 * 7 * 7 * 512 * 4  # 3.2 MB forward, as much again backward
    assert act.static and act.needs_grad and act.kind == "activation"
    assert (labels.kind, labels.src, labels.dst, labels.shape, labels.static) == ("labels", 0, 1, (32,), True)
    assert not labels.needs_grad and labels.bytes_per_step == 32 * 8
    text = plan.text()
    assert "block5_pool:0 -> flatten" in text and "(32, 7, 7, 512)" in text and "static" in text


def test_vgg16_with_micro_batches_and_no_fixed_batch(vgg16):
    placement = {"block*": 0, "flatten": 1, "fc*": 1, "predictions": 1}
    plan = analyze(vgg16, placement, 2, batch_size=32, micro_batches=4, label_specs=[((None,), "int64")])
    act, labels = plan.edges
    assert act.shape == (8, 7, 7, 512) and act.transfers == 4  # a micro-batch per transfer
    assert act.bytes_per_step == 4 * act.bytes_per_transfer == 32 * 7 * 7 * 512 * 4
    # The labels cross once a step, the whole batch: the loss stage splits them (M-1 fewer hops each end).
    assert (labels.shape, labels.transfers, labels.static, labels.bytes_per_step) == ((32,), 1, True, 32 * 8)
    assert "once a step" in labels.reason
    plan = analyze(vgg16, placement, 2, batch_size=None, micro_batches=4, label_specs=[((None,), "int64")])
    assert [(e.shape[0], e.transfers, e.static) for e in plan.edges] == [(None, 4, False), (None, 1, False)]
    plan = analyze(vgg16, placement, 2, batch_size=None)
    (edge,) = plan.edges
    assert not edge.static and edge.shape == (None, 7, 7, 512) and "drop_remainder" in edge.reason
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        analyze(vgg16, placement, 2, batch_size=32, micro_batches=3)


def test_the_planner_makes_the_whole_plan_at_once_and_nothing_changes_it():
    model, placement = _mlp(), {"fc*": 0, "hidden": 1, "out": 1}
    plan = make_plan(model, placement, 2, 16, 4, replicas=2, schedule="1f1b", defer_weight_gradients=True)
    assert (plan.replicas, plan.schedule, plan.micro_batches, plan.group) == (2, "1f1b", 4, 1)
    assert plan.stashed == {0: 2, 1: 1}  # 1F1B: stage p of S keeps at most S - p micro-batches' activations
    assert plan.deferred == {0: ("fc1", "fc2"), 1: ("hidden", "out")}
    assert make_plan(model, placement, 2, 16, 4, schedule="gpipe").stashed == {0: 4, 1: 4}
    assert make_plan(model, placement, 2, 16, 4).deferred == {}  # (none unless asked)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batches = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.layer_stage["fc1"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.deferred[0] += ("out",)  # type: ignore[index]
    assert isinstance(plan.edges, tuple) and plan.micro_plans == ()


def test_unplaced_layers_follow_their_producer_and_exact_names_win():
    model = _mlp()
    stage = assign_layers(model, {"fc*": 0, "fc2": 1, "out": 1}, 2)
    # fc2 by name beats the fc* glob; hidden has no pattern and follows fc2.
    assert stage == {"fc1": 0, "fc2": 1, "hidden": 1, "out": 1}


def test_variable_length_sequences_make_dynamic_edges():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(50, 8, name="embed")(tokens)
    h = keras.layers.LSTM(6, return_sequences=True, name="lstm")(h)
    model = keras.Model(tokens, keras.layers.GRU(4, name="gru")(h))
    plan = analyze(model, {"embed": 0, "lstm": 1, "gru": 2}, 3, batch_size=16)
    assert [(e.producer, e.src, e.dst, e.static) for e in plan.edges] == [
        ("embed:0", 0, 1, False),
        ("lstm:0", 1, 2, False),
    ]
    assert all("dimension 1 known only at run time" in e.reason for e in plan.edges)
    assert plan.edges[0].shape == (16, None, 8) and plan.edges[0].bytes_per_step is None


def test_integer_and_weightless_edges_carry_no_gradient():
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    ids = keras.layers.Identity(name="ids")(tokens)
    h = keras.layers.Embedding(50, 8, name="embed")(ids)
    model = keras.Model(tokens, keras.layers.Flatten(name="flat")(h))
    plan = analyze(model, {"ids": 0, "embed": 1, "flat": 1}, 2, batch_size=4)
    (edge,) = plan.edges
    assert edge.dtype == "int32" and not edge.needs_grad


def test_stage_models_share_the_users_layers():
    model = _mlp()
    plan = analyze(model, {"fc1": 0, "fc2": 0, "hidden": 1, "out": 1}, 2, batch_size=4)
    first, last = build_stage(model, plan, 0), build_stage(model, plan, 1)
    assert [v.path for v in first.trainable_variables] == [v.path for v in model.get_layer("fc1").weights] + [
        v.path for v in model.get_layer("fc2").weights
    ]
    assert first.trainable_variables[0] is model.get_layer("fc1").kernel
    x = np.random.default_rng(0).standard_normal((4, 20)).astype("float32")
    h = first.model([x])  # one output: a tensor, as Keras returns it
    y = last.model([h])
    np.testing.assert_allclose(np.asarray(y), np.asarray(model(x)), rtol=1e-6, atol=1e-6)


def test_sequential_models_can_be_placed():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")])
    plan = analyze(model, {"a": 0, "b": 1}, 2, batch_size=2)
    assert [(e.producer, e.shape) for e in plan.edges] == [("a:0", (2, 4))]


@pytest.mark.parametrize(
    ("placement", "stages", "message"),
    [
        ({"conv*": 0, "fc*": 1}, 2, r"pattern\(s\) 'conv\*' match no layer of model 'mlp'; its layers are: fc1"),
        ({"fc*": 0, "out": 0, "hidden": 0}, 2, r"stage\(s\) 1 would own no layer"),
        ({"fc1": 0, "fc2": 1, "hidden": 0, "out": 1}, 2, r"cycle between stages 0, 1: fc1 \(stage 0\) -> fc2"),
        ({"fc*": 2}, 2, r"2 is not a stage index in 0..1"),
        ({}, 2, "placement is empty"),
    ],
)
def test_bad_placements_say_what_is_wrong(placement, stages, message):
    with pytest.raises(ValueError, match=message):
        analyze(_mlp(), placement, stages)


def test_subclassed_models_cannot_be_cut():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match=r"needs a Functional or Sequential model.*Net is subclassed"):
        analyze(Net(), {"*": 0}, 1)


def test_a_layer_split_by_rows_computes_what_the_model_does():
    from rdkeras.pipeline.cut.split import split_model, splittable

    x = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(x)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Flatten(name="flat")(h)
    model = keras.Model(x, keras.layers.Dense(5, name="out")(h), name="convnet")
    names = ["conv", "bn", "flat", "out"]
    # Row by row, with no state but trainable weights, no model output: only the convolution.
    assert splittable(model, names) == [True, False, False, False]
    split = split_model(model, {"conv": (3, 8)})  # the later part: 3 of every 8 rows
    data = np.random.default_rng(0).standard_normal((8, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(split(data), model(data))
    assert {id(v) for v in split.trainable_variables} == {id(v) for v in model.trainable_variables}  # shared
    placement = {"conv__rows": 0, "conv": 0, "conv__twin": 1, "conv__join": 1, "bn": 1, "flat": 1, "out": 1}
    plan = analyze(split, placement, 2, batch_size=16, micro_batches=2)
    # Of each micro-batch's 8 rows, stage 0 sends conv's output for its 5 and the input for the other 3.
    shapes = {e.producer: e.shape for e in plan.edges}
    assert shapes == {"conv:0": (5, 8, 8, 4), "conv__rows:1": (3, 8, 8, 3)}
    grads = {e.producer: e.needs_grad for e in plan.edges if e.static}
    assert grads == {"conv:0": True, "conv__rows:1": False}  # (the image's rows need no gradient)
    first, second = build_stage(split, plan, 0), build_stage(split, plan, 1)
    sent = first.model([data[:8]])
    by_edge = {e.name: t for edges, t in zip(first.sends, sent, strict=True) for e in edges}
    out = second.model([by_edge[f.edge.name] for f in second.feeds])
    np.testing.assert_allclose(out, model(data[:8]), rtol=1e-6)
    # A partial batch still keeps a row on each side.
    np.testing.assert_array_equal(split(data[:2]), model(data[:2]))
