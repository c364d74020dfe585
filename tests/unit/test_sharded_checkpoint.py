"""A sharded checkpoint in one process (rdkeras.parallel.sharded_checkpoint): written whole or not at all, read back
into a plain Keras model, refused for another model (tests/multiproc/test_sharded_checkpoint.py resumes across
worker counts)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from rdkeras.parallel import sharded_checkpoint


def _model(units: int = 4):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    model.fit(np.ones((8, 3)), np.zeros((8, 2)), epochs=2, verbose=0)
    return model


def test_a_checkpoint_reads_back_into_a_plain_keras_model(tmp_path):
    model = _model()
    sharded_checkpoint.save(tmp_path / "ck", model, None, rank=0, workers=1, barrier=lambda: None)
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    fresh.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    sharded_checkpoint.load(tmp_path / "ck", fresh)
    for got, want in zip(fresh.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.name)
    for got, want in zip(fresh.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_save_cut_short_leaves_the_previous_checkpoint_whole(tmp_path):
    model = _model()
    sharded_checkpoint.save(tmp_path / "ck", model, None, rank=0, workers=1, barrier=lambda: None)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    model.fit(np.ones((8, 3)), np.zeros((8, 2)), epochs=1, verbose=0)
    calls = []

    def dies_after_the_shards_are_written() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("a worker died")

    with pytest.raises(ConnectionError):
        sharded_checkpoint.save(
            tmp_path / "ck", model, None, rank=0, workers=1, barrier=dies_after_the_shards_are_written
        )
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert after == before and (tmp_path / "ck.partial").exists()
    sharded_checkpoint.save(tmp_path / "ck", model, None, rank=0, workers=1, barrier=lambda: None)
    assert not (tmp_path / "ck.partial").exists() and not (tmp_path / "ck.old").exists()


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    sharded_checkpoint.save(tmp_path / "ck", _model(4), None, rank=0, workers=1, barrier=lambda: None)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2), keras.layers.Dense(1)])
    other.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="is of another model: 6 weights here, 4 there"):
        sharded_checkpoint.load(tmp_path / "ck", other)
