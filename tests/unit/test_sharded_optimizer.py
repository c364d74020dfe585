"""What a sharded update refuses, and what it leaves the compiled optimizer (tests/multiproc/test_sharded.py
trains with it)."""

from __future__ import annotations

import keras
import pytest

from rdkeras import keras_internals
from rdkeras.parallel.sharded_optimizer import ShardedUpdate


def test_what_is_not_sharded_yet_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="shard='optimizer' does not run with loss_scale_factor"):
        ShardedUpdate(None, keras.optimizers.Adam(loss_scale_factor=8.0), "optimizer", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("compiled", "named"),
    [
        (lambda m: m.compile(keras.optimizers.Adam(gradient_accumulation_steps=2)), "gradient_accumulation_steps"),
        (  # (a LossScaleOptimizer runs: what its inner optimizer does not is refused, named)
            lambda m: m.compile(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(use_ema=True))),
            "use_ema",
        ),
        (lambda m: m.compile(keras.optimizers.SGD(use_ema=True)), "use_ema"),
    ],
)
def test_what_sharded_parameters_do_not_run_yet_is_refused_by_name(compiled, named):
    from rdkeras.parallel.sharded_parameters import ShardedParameters

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    compiled(model)
    with pytest.raises(NotImplementedError, match=f"shard='parameters' does not run with {named}"):
        ShardedParameters(None, model)  # type: ignore[arg-type]
    constrained = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, kernel_constraint="non_neg")])
    constrained.compile(keras.optimizers.Adam())
    with pytest.raises(NotImplementedError, match=r"a constraint or regularizer \(sequential_\d+/dense_\d+/kernel\)"):
        ShardedParameters(None, constrained)  # type: ignore[arg-type]


def test_the_compiled_optimizer_builds_no_per_variable_state():
    # Not its slots, its gradient accumulators nor its moving averages: the sharded update's copy holds those.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    settings = {"gradient_accumulation_steps": 2, "use_ema": True}
    optimizer = keras.optimizers.Adam(**settings)
    ShardedUpdate(None, optimizer, "gradients", None)  # type: ignore[arg-type]
    optimizer.build(model.trainable_variables)
    assert optimizer.built and [v.name for v in optimizer.variables] == ["iteration", "learning_rate"]
    assert optimizer.use_ema and optimizer.gradient_accumulation_steps == 2  # (as compiled: the copy follows them)
    keras_internals.restore(optimizer)
    fresh = keras.optimizers.Adam(**settings)
    fresh.build(model.trainable_variables)
    assert len(fresh.variables) == 2 + 4 * len(model.trainable_variables)  # (what it would have built)


def test_a_layer_is_recomputed_in_backprop_only_where_a_rerun_changes_nothing():
    # Sharded parameters gather such a layer again for its backward pass instead of keeping it whole.
    class Outer(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],))
            self.inner = keras.layers.Dense(2)

        def call(self, x):
            return self.inner(x * self.w)

    outer = Outer()
    outer(keras.ops.ones((1, 3)))
    for layer in (keras.layers.Dense(2), keras.layers.LayerNormalization()):
        layer.build((None, 3))
        assert keras_internals.only_own_trainable_state(layer), layer
    assert not keras_internals.only_own_trainable_state(outer)  # (its sublayer's variables)
    batch_norm = keras.layers.BatchNormalization()
    batch_norm.build((None, 3))
    assert not keras_internals.only_own_trainable_state(batch_norm)  # (moving statistics)
    embedding = keras.layers.Embedding(10, 2)
    embedding.build((None,))
    assert not keras_internals.only_own_trainable_state(embedding)  # (its gradient is rows, its weights not read)

    class Noisy(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],))
            self.seed = keras.random.SeedGenerator(1)

        def call(self, x):
            return x * self.w + keras.random.normal(keras.ops.shape(x), seed=self.seed)

    noisy = Noisy()
    noisy.build((None, 3))
    assert not keras_internals.only_own_trainable_state(noisy)  # (a seed: a rerun would draw again)
