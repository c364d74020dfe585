"""rdkeras.elastic.State and run in one process: what a commit keeps, what a restore puts back, what is refused.
(A loss and a replacement in a custom loop: tests/multiproc/test_elastic.py.)"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import rdkeras  # noqa: E402
from rdkeras.elastic import State, run  # noqa: E402


@pytest.fixture
def strategy():
    strategy = rdkeras.RDMAStrategy()
    yield strategy
    strategy.close()


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_restore_puts_back_the_weights_optimizer_and_values_of_the_last_commit(strategy):
    with strategy.scope():
        model, optimizer = _model(), keras.optimizers.Adam(0.1)
    state = State(strategy, model, optimizer, epoch=0, seen=["a"])
    assert optimizer.built  # built at once: every commit holds the same variables
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                      strict=True))  # fmt: skip

    step()
    state.epoch, state.seen = 1, [*state.seen, "b"]
    state.commit()
    committed = [v.numpy().copy() for v in [*model.weights, *optimizer.variables]]
    step()
    state.epoch = 2
    state.seen.append("c")  # changed in place: the commit kept a copy
    state.restore()
    assert state.epoch == 1 and state.seen == ["a", "b"] and state.commits == 1
    for v, expected in zip([*model.weights, *optimizer.variables], committed, strict=True):
        np.testing.assert_array_equal(v.numpy(), expected)
    assert int(optimizer.iterations.numpy()) == 1


def test_run_calls_the_loop_and_returns_what_it_returns(strategy):
    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse")
    state = State(strategy, model, batch=3)  # the compiled optimizer is kept

    @run
    def train(state: State, add: int) -> int:
        state.batch += add
        state.commit()
        return state.batch

    assert train(state, 2) == 5 and state.commits == 1
    assert train.__name__ == "train"


def test_a_failure_that_is_no_lost_worker_is_raised_as_it_is(strategy):
    state = State(strategy, epoch=0)

    @run
    def train(state: State) -> None:
        raise ValueError("a bug in the loop")

    with pytest.raises(ValueError, match="a bug in the loop"):
        train(state)


def test_unknown_and_reserved_names_are_refused(strategy):
    state = State(strategy, epoch=0)
    with pytest.raises(AttributeError, match=r"State has no value 'epcoh': name it when creating the State"):
        state.epcoh = 1
    with pytest.raises(ValueError, match="commit: names State uses itself"):
        State(strategy, commit=1)
    with pytest.raises(ValueError, match="needs the model whose variables it trains"):
        State(strategy, optimizer=keras.optimizers.SGD())
