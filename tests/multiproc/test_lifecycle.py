"""A Keras user's whole lifecycle under RDMAStrategy: saved files load without rdkeras, training resumes
after a worker is killed, custom loops and tf.distribute scripts train like one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_ranks

TARGET = "tests.multiproc.lifecycle_workers"


def _close(a, b, tol):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _same_state(got: dict, want: dict, tol: float) -> None:
    _close(got["weights"], want["weights"], tol)
    _close(got["optimizer"], want["optimizer"], tol)


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_saved_files_load_where_rdkeras_is_not_installed(tmp_path, mode):
    from tests.multiproc.lifecycle_workers import load_in_fresh_process

    # float32, then mixed precision (loss scaling), in the same two processes.
    policies = ["float32", "mixed_float16"]
    results = run_ranks("save_all", 2, module=TARGET, timeout=400, out_dir=str(tmp_path), mode=mode, policies=policies)
    loaded_all = load_in_fresh_process(str(tmp_path), policies)
    for policy in policies:
        _check_saved(results[0].value[policy], results[1].value[policy], loaded_all[policy], policy)


def _check_saved(chief: dict, other: dict, loaded: dict, policy: str) -> None:
    tol = 1e-5 if policy == "float32" else 2e-3
    # Every worker ends with the whole state (PS: each optimizer slot gathered from its owner), bit for bit,
    # and it is the state one process reaches with the same global batch.
    assert chief["trained"] == other["trained"]
    _same_state(chief["trained"], chief["reference"], tol)
    # predict splits every batch over the workers and gathers the rows back, in order, on every worker.
    assert chief["predict_odd"] == other["predict_odd"] and len(chief["predict_odd"]) == 9
    np.testing.assert_allclose(chief["predict_odd"], chief["reference_predict_odd"], rtol=tol * 10, atol=tol * 10)
    assert chief["loaded_is_distributed"] and other["loaded_is_distributed"]
    assert chief["continued"] == other["continued"]
    _same_state(chief["continued"], chief["reference_continued"], tol)
    for r in (chief, other):
        assert "compiled outside strategy.scope()" in r["outside_error"], r["outside_error"]
        assert r["after_close"]["model_overrides"] == [] and not r["after_close"]["optimizer_overrides"]
        assert r["after_close"]["class"] == "keras.src.models.sequential.Sequential"
        assert r["after_close"]["optimizer_class"].startswith("keras.src.optimizers.")

    assert not loaded["rdkeras_imported"]
    assert loaded["m.keras/class"] == loaded["ck.keras/class"] == "keras.src.models.sequential.Sequential"
    assert loaded["m.keras"] == chief["trained"]  # identical weights and optimizer state
    assert loaded["ck.keras"] == chief["trained"]  # the last epoch's checkpoint is the final state
    assert loaded["ck.weights.h5"]["weights"] == chief["trained"]["weights"]
    _same_state(loaded["continued"], chief["continued"], tol)  # fit continues where it left off (one process)
    np.testing.assert_allclose(loaded["predict"], chief["predict"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        loaded["savedmodel_predict"], chief["predict"], rtol=1e-3 if policy != "float32" else 1e-5
    )
    assert not loaded["json_mentions_rdkeras"] and loaded["from_json"] == "Sequential"


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_killed_worker_resumes_with_backup_and_restore(tmp_path, mode):
    backup = str(tmp_path / "backup")
    # Rank 1 is killed as epoch 2 begins: the job fails, naming it.
    failed = run_ranks(
        "train_with_backup", 2, module=TARGET, timeout=300, check=False, backup_dir=backup, mode=mode,
        env={"RDKERAS_TEST_KILL": "1"},
    )  # fmt: skip
    assert failed[1].returncode == -9
    assert failed[0].returncode != 0 and "rank 1" in failed[0].output
    # Relaunched, both workers resume at epoch 2 with the backed-up weights and optimizer state.
    results = run_ranks("train_with_backup", 2, module=TARGET, timeout=300, backup_dir=backup, mode=mode)
    for r in results:
        assert r.value["epochs_run"] == [2, 3]
        assert r.value["resumed"] == r.value["uninterrupted"]  # bit for bit: the data order is fixed
        assert not r.value["backup_left"]  # removed once the training completed
    assert results[0].value["resumed"] == results[1].value["resumed"]


def test_custom_training_loop_matches_one_process():
    results = run_ranks("custom_loop", 2, module=TARGET, timeout=240)
    (reference,) = run_ranks("custom_loop", 1, module=TARGET, timeout=240, distributed=False)
    assert results[0].value == results[1].value
    _close(results[0].value["weights"], reference.value["weights"], 1e-5)
    np.testing.assert_allclose(results[0].value["losses"], reference.value["losses"], rtol=1e-5)


def test_tensorflow_multi_worker_tutorial_runs_with_only_the_strategy_line_changed(tmp_path):
    # TF_CONFIG alone describes the job, as for MultiWorkerMirroredStrategy: no RDKERAS_* variable is set;
    # the job token comes from the user's secret file, created on first use.
    import json
    import os
    import sys

    from rdkeras.launch import _RESULT_MARK, free_port, run_workers

    ports = [free_port(), free_port()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    base = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    base.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), XDG_CONFIG_HOME=str(tmp_path / "config"))
    envs = [
        {**base, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})} for i in (0, 1)
    ]
    code = (
        "import json; from tests.multiproc.lifecycle_workers import tf_tutorial; "
        f"print({_RESULT_MARK!r} + json.dumps(tf_tutorial()), flush=True)"
    )
    results = run_workers([[sys.executable, "-c", code]] * 2, envs, timeout=240)
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    a, b = results[0].value, results[1].value
    assert a["weights"] == b["weights"] and a["loss"] == b["loss"]  # one model, trained together
    assert a["loss"][-1] < a["loss"][0]
    assert a["replicas"] == b["replicas"] == 2
    assert [a["task"], b["task"]] == [["worker", 0], ["worker", 1]]
    # No rdkeras variable anywhere but the folder the harness (a launcher) gives its workers for their reports.
    assert a["env"] == b["env"] == ["RDKERAS_REPORT_DIR"]
    assert (tmp_path / "config" / "rdkeras" / "job-token").stat().st_mode & 0o077 == 0
