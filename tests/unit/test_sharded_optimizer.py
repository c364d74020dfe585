"""What a sharded update refuses, and what it leaves the compiled optimizer (tests/multiproc/test_sharded.py
trains with it)."""

from __future__ import annotations

import keras
import pytest

from rdkeras import keras_internals
from rdkeras.parallel.sharded_optimizer import ShardedUpdate


@pytest.mark.parametrize(
    ("optimizer", "named"),
    [
        (lambda: keras.optimizers.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
        (lambda: keras.optimizers.SGD(use_ema=True), "use_ema"),
    ],
)
def test_what_is_not_sharded_yet_is_refused_by_name(optimizer, named):
    with pytest.raises(NotImplementedError, match=f"shard='optimizer' does not run with {named}"):
        ShardedUpdate(None, optimizer(), "optimizer", None)  # type: ignore[arg-type]


def test_the_compiled_optimizer_builds_no_per_variable_state():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    optimizer = keras.optimizers.Adam()
    ShardedUpdate(None, optimizer, "gradients", None)  # type: ignore[arg-type]
    optimizer.build(model.trainable_variables)
    assert optimizer.built and [v.name for v in optimizer.variables] == ["iteration", "learning_rate"]
    keras_internals.restore(optimizer)
    fresh = keras.optimizers.Adam()
    fresh.build(model.trainable_variables)
    assert len(fresh.variables) == 2 + 2 * len(model.trainable_variables)  # (what it would have built)
