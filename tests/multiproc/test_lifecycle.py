"""A Keras user's whole lifecycle under RDMAStrategy: saved files load without rdkeras, training resumes
after a worker is killed, custom loops and tf.distribute scripts train like one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import launch_in_turn, run_ranks

TARGET = "tests.ranks.lifecycle_workers"
MODES = ["allreduce", "ps"]
# Parameter-server mode's saving and resuming run with -m slow (the default run keeps allreduce's): the fixtures
# below train it only where a slow test is selected.
MODE_PARAMS = ["allreduce", pytest.param("ps", marks=pytest.mark.slow)]
POLICIES = ["float32", "mixed_float16"]  # float32, then mixed precision (loss scaling)
# The module fixtures below run several tests' trainings in one launch.
pytestmark = pytest.mark.timeout(900)


def _modes(config) -> list[str]:
    """The data modes whose lifecycle runs train: PS mode's only where slow tests are selected (-m slow)."""
    return MODES if "slow" in (config.option.markexpr or "").replace("not slow", "") else ["allreduce"]


def _close(a, b, tol):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def _same_state(got: dict, want: dict, tol: float) -> None:
    _close(got["weights"], want["weights"], tol)
    _close(got["optimizer"], want["optimizer"], tol)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, request) -> dict:
    """For each data mode, a launch whose rank 1 is killed as epoch 2 begins: the job fails, naming it, and
    BackupAndRestore holds epoch 1's state in the backup folder."""
    out = {}
    for mode in _modes(request.config):
        backup = str(tmp_path_factory.mktemp(f"backup-{mode}") / "backup")
        failed = run_ranks(
            "train_with_backup", 2, module=TARGET, timeout=300, check=False, backup_dir=backup, mode=mode,
            env={"RDKERAS_TEST_KILL": "1"},
        )  # fmt: skip
        out[mode] = {"backup_dir": backup, "failed": failed}
    return out


@pytest.fixture(scope="module")
def two_workers(killed, tmp_path_factory, request):
    """The other 2-worker runs of the tests here, one after another in one launch (TensorFlow imports once a
    worker): saving (both modes, both policies), the killed runs relaunched, the custom loop and its
    one-process reference."""
    saved = tmp_path_factory.mktemp("saved")
    jobs: dict = {}
    for mode in _modes(request.config):
        jobs[f"save/{mode}"] = (
            f"{TARGET}:save_all",
            {"out_dir": str(saved / mode), "mode": mode, "policies": POLICIES},
        )
        jobs[f"resume/{mode}"] = (
            f"{TARGET}:train_with_backup",
            {"backup_dir": killed[mode]["backup_dir"], "mode": mode},
        )
    jobs["custom loop"] = (f"{TARGET}:custom_loop", {})
    jobs["custom loop in one process"] = (f"{TARGET}:custom_loop", {"distributed": False})
    jobs["reduce forms"] = (f"{TARGET}:reduce_forms", {})
    jobs["replica checks"] = (f"{TARGET}:replica_checks", {})
    jobs["gan"] = (f"{TARGET}:gan", {})
    jobs["ran out of data"] = (f"{TARGET}:ran_out_of_data", {})
    jobs["mwms custom loop"] = (f"{TARGET}:mwms_custom_loop", {})
    jobs["mwms custom loop in one process"] = (f"{TARGET}:mwms_custom_loop", {"distributed": False})
    return launch_in_turn(jobs, 2, timeout=900)


@pytest.fixture(scope="module")
def loaded(two_workers, request) -> dict:
    """Every saved folder, loaded in one fresh process that never imports rdkeras."""
    from tests.ranks.lifecycle_workers import load_in_fresh_process

    folders = [two_workers.kwargs[f"save/{mode}"]["out_dir"] for mode in _modes(request.config)]
    return load_in_fresh_process(folders, POLICIES)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_saved_files_load_where_rdkeras_is_not_installed(two_workers, loaded, mode):
    results = two_workers(f"save/{mode}")
    loaded_all = loaded[two_workers.kwargs[f"save/{mode}"]["out_dir"]]
    for policy in POLICIES:
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
        # Keras's own fit is routed while the strategy lives (the patch table's entry), and every class- or
        # module-level replacement is gone after close(): each patched attribute is Keras's own object again.
        assert any(p.startswith("Model.fit ") for p in r["after_close"]["patches_during_fit"])
        assert r["after_close"]["patches"] == [] and r["after_close"]["sites_changed"] == []

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


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_killed_worker_resumes_with_backup_and_restore(killed, two_workers, mode):
    # Rank 1 is killed as epoch 2 begins: the job fails, naming it.
    failed = killed[mode]["failed"]
    assert failed[1].returncode == -9
    assert failed[0].returncode != 0 and "rank 1" in failed[0].output
    # Relaunched, both workers resume at epoch 2 with the backed-up weights and optimizer state.
    results = two_workers(f"resume/{mode}")
    for r in results:
        assert r.value["epochs_run"] == [2, 3]
        assert r.value["resumed"] == r.value["uninterrupted"]  # bit for bit: the data order is fixed
        assert not r.value["backup_left"]  # removed once the training completed
    assert results[0].value["resumed"] == results[1].value["resumed"]


def test_custom_training_loop_matches_one_process(two_workers):
    results, (reference, _) = two_workers("custom loop"), two_workers("custom loop in one process")
    assert results[0].value == results[1].value
    _close(results[0].value["weights"], reference.value["weights"], 1e-5)
    np.testing.assert_allclose(results[0].value["losses"], reference.value["losses"], rtol=1e-5)


def test_strategy_reduce_takes_every_form_mwms_loops_use(two_workers):
    # Rank 0 gives 1.0, [0, 0] and one row [1, 2]; rank 1 gives 2.0, [1, 10] and three rows [3, 4].
    expected = {
        "sum scalar": 3.0,
        "sum scalar, axis None": 3.0,
        "sum vector": [1.0, 10.0],
        "mean along rows": [2.5, 3.5],  # (1*[1, 2] + 3*[3, 4]) / 4 rows
        "sum along rows": [10.0, 14.0],
        "allreduce one tensor": [1.5],
        # strategy.gather: every replica's rows in replica order, along any axis, any structure and dtype.
        "gather rows": [[1.0, 2.0], [3.0, 4.0], [3.0, 4.0], [3.0, 4.0]],
        "gather columns": [[1.0, 3.0, 3.0, 3.0], [2.0, 4.0, 4.0, 4.0]],
        "gather a structure": {"ids": [0, 1, 1]},
    }
    for r in two_workers("reduce forms"):
        # experimental_local_results: a tuple of one, this replica's value of strategy.run (its rows, doubled).
        own = {"local results": [[[2.0, 4.0]] if r.rank == 0 else [[6.0, 8.0]] * 3]}
        for name, value in {**expected, **own}.items():
            assert r.value[name] == value, (r.rank, name, r.value[name])
            assert r.value[f"{name} (tf.function)"] == value, (r.rank, name, r.value[f"{name} (tf.function)"])


def test_replicas_agree_on_batchnorm_statistics_and_a_diverged_one_is_named(two_workers):
    first, second = (r.value for r in two_workers("replica checks"))
    # Each worker's moving statistics come from its own batches: averaged at every epoch end, so equal.
    assert first["bn"] == second["bn"]
    # Rank 1 added 1 to its moving mean: the check averages it (+0.5 on both), no error.
    assert first["bn after check"] == second["bn after check"]
    np.testing.assert_allclose(first["bn after check"], np.array(first["bn"][0]) + 0.5, rtol=1e-6)
    # Rank 1 nudged a kernel at the start of epoch 1: caught at that epoch's end, on both workers, by name.
    for value in (first, second):
        for when in ("epoch end", "on demand"):
            assert value[when] and "'net/logits/kernel' differs between workers" in value[when], value[when]
    assert "after 24 steps" in first["epoch end"]  # 6 steps an epoch: the first fit's 2, then epochs 0 and 1


def test_a_gan_with_its_own_optimizers_trains_as_one_model(two_workers):
    # The keras.io pattern: no call(), two optimizers from a custom compile. Both average their gradients, so
    # the replicas end bit-identical (the replica check at each epoch end would have named a difference).
    first, second = (r.value for r in two_workers("gan"))
    assert first["weights"] == second["weights"] and first["d_loss"] == second["d_loss"]
    assert first["restored"] and second["restored"]  # strategy.close() gave the optimizers back to plain Keras
    # (That it is one process's training, noise and all: test_keras_patterns.py's gan_with_keras_random.)


def test_keras_warnings_about_the_program_come_from_the_chief_alone(two_workers):
    # A dataset of unknown size that runs out in epoch 2 (and fit's ignored shuffle): said once, by rank 0.
    chief, other = (r.value["warnings"] for r in two_workers("ran out of data"))
    assert chief.count("Your input ran out of data") == 1 and other == [], (chief, other)


def test_tf_distribute_custom_loop_runs_with_only_the_strategy_line_changed(two_workers):
    # Model and optimizer made in scope (rank 1 seeded apart: the scope gives it the chief's values),
    # apply_gradients inside strategy.run sums over replicas, reduce(SUM, axis=None) gives the global loss.
    _replicas_agree_with_one_process(two_workers, "mwms custom loop", ["weights", "losses"])
    for r in two_workers("mwms custom loop"):  # apply_gradients was patched in strategy.run, and restored
        assert any(p.startswith("Optimizer.apply ") for p in r.value["patches"]["during"]), r.value["patches"]
        assert r.value["patches"]["after"] == [] and r.value["patches"]["sites_changed"] == []


def _replicas_agree_with_one_process(two_workers, key: str, fields: list[str]) -> None:
    """Job `key`'s two workers hold the same bits, and `fields` equal job "`key` in one process"'s within 1e-5."""
    first, second = (r.value for r in two_workers(key))
    alone = two_workers(f"{key} in one process")[0].value
    assert first == second
    for field in fields:
        _close(first[field], alone[field], 1e-5)


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
        "import json; from tests.ranks.lifecycle_workers import tf_tutorial; "
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
