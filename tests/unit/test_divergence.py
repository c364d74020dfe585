"""A diverged run raises at the step its weights stop being finite, before any callback saves (issue 48); the train
app's end of it (exit status 1, one line, no results.json) is tests/multiproc/test_train_app.py's."""

from __future__ import annotations

import numpy as np
import pytest

from rdkeras.train.divergence import DivergedError, stop_on_divergence


def _model(learning_rate: float):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    return model


def test_weights_that_stop_being_finite_end_fit_with_an_error_and_no_checkpoint(tmp_path):
    import keras

    x, y = np.random.default_rng(0).random((64, 8), np.float32), np.ones((64, 3), np.float32)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True)
    with pytest.raises(DivergedError) as e:
        _model(1e38).fit(x, y, batch_size=16, epochs=3, callbacks=[stop_on_divergence("lower it"), checkpoint],
                         verbose=0)  # fmt: skip
    assert str(e.value) == (
        "training diverged at epoch 1, step 2: the weights are no longer finite (nan or inf); lower it. The run "
        "stopped there on every worker: no checkpoint of this epoch, no results.json"
    )
    assert list(tmp_path.iterdir()) == []
    history = _model(1e-3).fit(x, y, batch_size=16, epochs=2, callbacks=[stop_on_divergence()], verbose=0)
    assert len(history.epoch) == 2  # a run that learns is left alone


def test_an_epoch_loss_that_is_not_finite_ends_the_run_at_the_epoch_end():
    callback = stop_on_divergence()
    callback.set_model(_model(1e-3))
    callback.on_epoch_end(0, {"loss": 0.5})
    with pytest.raises(DivergedError, match=r"^training diverged in epoch 2: its loss is inf\. The run stopped there"):
        callback.on_epoch_end(1, {"loss": float("inf")})
