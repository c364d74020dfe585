"""The Keras seam (rdkeras/keras_internals.py) and rdkeras's Keras policy (rdkeras/fitting/): hooks present,
clear errors, atomic saves, callbacks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

from rdkeras import keras_internals
from rdkeras.fitting.model import worker_callbacks

ROOT = Path(__file__).resolve().parents[2]


def _probes() -> dict:
    seq = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    seq.compile(optimizer="sgd", loss="mse")
    seq.optimizer.build(seq.trainable_variables)
    inputs = keras.Input((2,))
    functional = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    return {
        "keras.Model": seq,
        "keras.Sequential": seq,
        "keras.src.models.functional.Functional": functional,
        "keras.KerasTensor": inputs,
        "keras.callbacks.BackupAndRestore": keras.callbacks.BackupAndRestore(tempfile.gettempdir()),
        "keras.optimizers.LossScaleOptimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        "keras.optimizers.Optimizer": seq.optimizer,
        "keras.src.optimizers.base_optimizer.BaseOptimizer": seq.optimizer,
    }


def test_the_installed_keras_has_every_hook_rdkeras_uses():
    assert keras_internals.missing_hooks(_probes()) == []
    keras_internals.check()


def test_a_keras_without_a_hook_is_named_with_the_tested_range(monkeypatch):
    from keras.src.trainers.trainer import Trainer

    monkeypatch.delattr(Trainer, "_get_metrics_result_or_logs")
    with pytest.raises(RuntimeError, match=r"lacks what rdkeras relies on: keras.Model._get_metrics_result_or_logs"):
        keras_internals.check()
    with pytest.raises(RuntimeError, match=r"pip install 'keras>="):
        keras_internals.check()


def test_another_keras_backend_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND is 'jax': set KERAS_BACKEND=tensorflow"):
        keras_internals.check()


class _Parallel:
    def __init__(self, reporter: bool, membership: object = None):
        self.is_reporter, self.membership = reporter, membership


def test_chief_only_callbacks_are_recognised_by_type():
    class MyCheckpoint(keras.callbacks.ModelCheckpoint):
        pass

    class MyBoard(keras.callbacks.TensorBoard):
        pass

    stop = keras.callbacks.EarlyStopping()
    backup = keras.callbacks.BackupAndRestore(tempfile.mkdtemp())
    given = [MyCheckpoint("x.keras"), MyBoard(), keras.callbacks.CSVLogger("log.csv"), stop, backup]
    kept, verbose = worker_callbacks(_Parallel(reporter=False), given, "auto")
    assert kept == [stop, backup] and verbose == 0  # BackupAndRestore runs everywhere (it gathers state)
    kept, verbose = worker_callbacks(_Parallel(reporter=True), given, "auto")
    assert kept == given and verbose == "auto"
    assert "_save_model" in backup.__dict__  # adapted: the reporter writes, atomically


def test_an_elastic_job_keeps_chief_only_callbacks_silent_until_this_worker_is_the_chief():
    calls = []

    class Recorder(keras.callbacks.CSVLogger):  # a chief-only type
        def set_model(self, model):
            calls.append(("set_model", model))

        def on_train_begin(self, logs=None):
            calls.append(("train_begin",))

        def on_epoch_begin(self, epoch, logs=None):
            calls.append(("epoch_begin", epoch))

        def on_train_batch_end(self, batch, logs=None):
            calls.append(("batch_end", batch))

    parallel = _Parallel(reporter=False, membership=object())
    (gate,), _ = worker_callbacks(parallel, [Recorder("log.csv")], "auto")
    gate.set_model(model := keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    gate.on_train_begin()
    gate.on_epoch_begin(0)
    gate.on_epoch_begin(1)
    gate.on_train_batch_end(0)
    assert calls == []  # another worker is the chief
    parallel.is_reporter = True  # the chief was lost: this worker is rank 0 of the new group
    gate.on_train_batch_end(1)
    gate.on_train_batch_end(2)
    assert calls == [("set_model", model), ("train_begin",), ("epoch_begin", 1), ("batch_end", 1), ("batch_end", 2)]


def test_instance_overrides_leave_the_class_alone_and_come_off():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    calls = []
    keras_internals.override(model, "summary", lambda m, *a, **k: calls.append(m))
    model.summary()
    assert calls == [model] and "summary" not in type(model).__dict__
    keras_internals.restore(model)
    assert "summary" not in model.__dict__


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    for k in [k for k in env if k.startswith("RDKERAS_")]:
        env.pop(k)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("name", ["model.keras", "model.weights.h5"])
def test_a_kill_during_a_save_leaves_the_previous_file_loadable(tmp_path, name):
    # A process saves once, then dies in the middle of the second save (the file is half written).
    path = tmp_path / name
    proc = _run(
        f"""
        import os, keras, numpy as np, rdkeras
        from keras.src.saving import saving_lib
        strategy = rdkeras.RDMAStrategy()  # one worker: saves go through rdkeras's hooks
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
        path = {str(path)!r}
        save = model.save_weights if path.endswith(".weights.h5") else model.save
        save(path)
        np.save(path + ".expected.npy", model.get_weights()[0])

        def dies_half_way(model, filepath, *args, **kwargs):
            with open(filepath, "wb") as f:
                f.write(b"PK\\x03\\x04 half a file")
            os._exit(9)

        saving_lib.save_model = saving_lib.save_weights_only = dies_half_way
        model.layers[0].kernel.assign(np.zeros((3, 2)))
        save(path)
        """
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    # The file left is the first save's (loaded here: Keras reads it without rdkeras's hooks).
    if name.endswith(".keras"):
        model = keras.models.load_model(path)
    else:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.load_weights(path)
    assert np.array_equal(model.get_weights()[0], np.load(str(path) + ".expected.npy")), "not the first save"


def test_every_patch_is_in_the_table_and_undone_on_the_way_out():
    from types import SimpleNamespace

    from keras.src.backend.tensorflow import random as backend_random
    from keras.src.losses import loss as loss_module

    before = {name: getattr(backend_random, name) for name in ("normal", "uniform", "dropout")}
    reduce = loss_module.reduce_weighted_values
    batch = SimpleNamespace(start=0, rows=2, total=4, reduce_loss=None, draws=None)
    with keras_internals.global_batch_step(batch):
        inside = keras_internals.active_patches()
        assert backend_random.dropout is not before["dropout"]
    assert {p.split()[0] for p in inside} == {
        s for s in keras_internals.PATCH_TABLE if s.startswith(("random.", "losses."))
    }
    assert keras_internals.active_patches() == []
    assert {name: getattr(backend_random, name) for name in before} == before
    assert loss_module.reduce_weighted_values is reduce
    with pytest.raises(KeyError, match=r"not in keras_internals\.PATCH_TABLE"):
        keras_internals._replace("Model.train_step", keras.Model, "train_step", None)
    assert "train_step" not in vars(keras.Model)


def _remat_gradients(mode: str | None) -> list[np.ndarray]:
    """A Dense layer and a Dropout built under ``keras.RematScope(mode)`` (None: none): their weight gradients in a
    traced step, as fit computes them (``training=True`` reaches the layers' calls as a keyword)."""
    import contextlib

    import tensorflow as tf

    keras.utils.set_random_seed(3)
    with keras.RematScope(mode) if mode else contextlib.nullcontext():
        dense, dropout = keras.layers.Dense(5, activation="relu"), keras.layers.Dropout(0.5)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")

    @tf.function
    def step(x: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dropout(dense(x), training=True) ** 2)
        return tape.gradient(loss, dense.trainable_variables)

    return [g.numpy() for g in step(x)]


def test_rematerialization_runs_in_a_traced_step_and_recomputes_the_forward_pass():
    from keras.src.backend.tensorflow import core

    keras_own = core.remat
    with pytest.raises(ValueError, match="keywords arguments only when eager"):  # Keras's own, in a traced step
        _remat_gradients("full")
    plain = _remat_gradients(None)
    keras_internals.hold_remat()
    keras_internals.hold_remat()  # (two strategies)
    try:
        keras_internals.release_remat()
        assert {p.split()[0] for p in keras_internals.active_patches()} == {"backend.remat", "SeedGenerator.next"}
        for mode in ("full", "larger_than", "activations"):
            # The recompute draws the forward's Dropout mask: the gradient of what the forward pass computed.
            for g, expected in zip(_remat_gradients(mode), plain, strict=True):
                np.testing.assert_allclose(g, expected, rtol=0, atol=1e-6, err_msg=mode)
    finally:
        keras_internals.release_remat()
    assert core.remat is keras_own and keras_internals.active_patches() == []


def test_a_rematerialized_layer_recomputes_in_the_forward_passes_compute_dtype():
    # Under mixed_float16 the backward pass reran a RematScope layer outside its autocast scope, in float32, and
    # TensorFlow refused float16 gradients against float32 activations; now it trains as without remat.
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 8)).astype("float32"), rng.integers(0, 3, 16)

    def trained(remat: bool) -> list[np.ndarray]:
        keras.utils.set_random_seed(1)
        with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(3, dtype="float32")])  # fmt: skip
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        return model.get_weights()

    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras_internals.hold_remat()
    try:
        got, want = trained(remat=True), trained(remat=False)
    finally:
        keras_internals.release_remat()
        keras.mixed_precision.set_global_policy(previous)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_a_tied_reverse_call_on_given_values_is_keras_own_without_transposing_the_table(soft_cap):
    # Stage 3 runs a tied ReversibleEmbedding's reverse call on its gathered table: the same logits and gradients
    # as Keras's call, from a matmul that reads the table transposed in place (no Transpose op in either pass).
    import tensorflow as tf

    layer = keras.layers.ReversibleEmbedding(50, 8, tie_weights=True, logit_soft_cap=soft_cap)
    layer.build((None,))
    x = tf.constant(np.random.default_rng(0).standard_normal((2, 3, 8)), tf.float32)
    table = tf.constant(layer.embeddings.numpy())

    def logits_and_grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, table])
            out = fn()
            loss = tf.reduce_sum(out * tf.range(50, dtype=tf.float32))
        return [out, *tape.gradient(loss, [x, table])]

    with keras.StatelessScope([(layer.embeddings, table)]):
        want = logits_and_grads(lambda: layer(x, reverse=True))
    keras_internals.call_with_values(layer, [layer.embeddings], lambda inputs: [table])
    try:
        got = logits_and_grads(lambda: layer(x, reverse=True))
        graph = tf.function(lambda: logits_and_grads(lambda: layer(x, reverse=True))).get_concrete_function().graph
        assert layer(tf.constant([[1, 2]])).shape == (1, 2, 8)  # the lookup is Keras's own
    finally:
        keras_internals.restore(layer)
    for name, a, b in zip(("logits", "inputs' gradient", "table's gradient"), got, want, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
    assert got[0].shape == (2, 3, 50)
    assert not [op.name for op in graph.get_operations() if op.type == "Transpose"]
