"""Sharded checkpoints (rdkeras.parallel.sharded_checkpoint): 4 workers' checkpoint, of a sharded optimizer or of
sharded weights, resumes on 2 workers (sharded or not) and in one plain Keras process, each going on as one process
that never stopped; a save cut short leaves the previous checkpoint whole."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

from tests.conftest import run_ranks

MODULE = "tests.ranks.checkpoint_workers"
pytestmark = pytest.mark.timeout(900)


def _launch(runs: dict) -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {key: pool.submit(run_ranks, "train", world, module=MODULE, timeout=600, **kwargs)
                   for key, (world, kwargs) in runs.items()}  # fmt: skip
        return {key: [r.value for r in future.result()] for key, future in futures.items()}


@pytest.mark.extended  # (24 s; the default run is at its 10-minute budget)
def test_four_workers_checkpoint_resumes_anywhere_as_one_process_would_go_on(tmp_path):
    folder = str(tmp_path / "checkpoint")
    first = _launch({"reference": (1, {"directory": folder, "epochs": 2, "shard": None}),
                     "four": (4, {"directory": folder, "epochs": 1, "shard": "gradients", "save": True})})  # fmt: skip
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["workers"] == 4 and manifest["slots"] == ["momentum", "velocity"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("shard-*")) == [f"shard-{r}" for r in range(4)]
    load = {"directory": folder, "epochs": 1, "load": True}
    resumed = _launch({"two_sharded": (2, {**load, "shard": "optimizer"}), "two_whole": (2, {**load, "shard": "none"}),
                       "two_parameters": (2, {**load, "shard": "parameters"}),
                       "plain_keras": (1, {**load, "shard": None})})  # fmt: skip
    _went_on_as_one_process(resumed, first["reference"][0])


@pytest.mark.extended
def test_a_checkpoint_of_sharded_weights_resumes_anywhere_as_one_process_would_go_on(tmp_path):
    # shard="parameters": each of 4 workers writes its shard of every layer's weights and optimizer state; 2 workers
    # (with sharded weights or not) and one plain Keras process read back what they hold and go on.
    folder = str(tmp_path / "checkpoint")
    first = _launch({"reference": (1, {"directory": folder, "epochs": 2, "shard": None}),
                     "four": (4, {"directory": folder, "epochs": 1, "shard": "parameters", "save": True})})  # fmt: skip
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["workers"] == 4 and manifest["slots"] == ["momentum", "velocity"]
    assert [k for k, _ in manifest["in_shards"]] == [0, 1, 2, 3, 4], manifest["in_shards"]  # every weight trains
    with np.load(tmp_path / "checkpoint" / "weights.npz") as held:  # (the chief held none of them whole)
        assert all(held[key].size == 0 for key in held.files)
    load = {"directory": folder, "epochs": 1, "load": True}
    resumed = _launch({"two_parameters": (2, {**load, "shard": "parameters"}),
                       "two_gradients": (2, {**load, "shard": "gradients"}),
                       "plain_keras": (1, {**load, "shard": None})})  # fmt: skip
    _went_on_as_one_process(resumed, first["reference"][0])


@pytest.mark.extended
def test_sharded_weights_saved_before_fit_are_the_chiefs_as_built(tmp_path):
    # Before the first fit no worker has laid its weights out: the save lays out the chief's (worker 1 built other
    # weights, from another seed) and each writes its shards; one plain Keras process loads them and trains as
    # one process that built the chief's weights.
    folder = str(tmp_path / "checkpoint")
    save = {"directory": folder, "epochs": 1, "shard": "parameters", "save_first": True}
    runs = _launch({"reference": (1, {"directory": folder, "epochs": 2, "shard": None}), "two": (2, save)})
    resumed = _launch({"plain_keras": (1, {"directory": folder, "epochs": 2, "shard": None, "load": True})})
    got, reference = resumed["plain_keras"][0], runs["reference"][0]
    assert got["iterations"] == reference["iterations"] == 8
    np.testing.assert_allclose(got["loss"], reference["loss"], rtol=1e-5)
    for i, (g, w) in enumerate(zip(got["weights"], reference["weights"], strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")


def _went_on_as_one_process(resumed: dict, reference: dict) -> None:
    for name, workers in resumed.items():
        for rank, got in enumerate(workers):
            who = f"{name}, worker {rank}"
            assert got["iterations"] == reference["iterations"] == 8, who  # 4 steps an epoch: the count went on
            np.testing.assert_allclose(got["loss"][0], reference["loss"][1], rtol=1e-5, err_msg=who)
            for i, (g, w) in enumerate(zip(got["weights"], reference["weights"], strict=True)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{who}, weight {i}")


@pytest.mark.extended  # (the default run keeps the 4-to-2-and-1 resume above)
def test_backup_and_restore_resumes_a_sharded_optimizer_where_it_stopped(tmp_path):
    # BackupAndRestore writes each worker's shard of the optimizer state beside its backup; a new launch (at
    # another worker count) resumes from the second epoch with the state as it was, as a run that never stopped.
    folder = str(tmp_path / "backup")
    interrupt = {"directory": folder, "epochs": 2, "shard": "gradients", "backup": "interrupt"}
    first = _launch(
        {"reference": (1, {"directory": folder, "epochs": 2, "shard": None}), "interrupted": (4, interrupt)}
    )
    assert all(r == {"interrupted": True} for r in first["interrupted"])
    assert [p.name for p in (tmp_path / "backup").glob("optimizer-shards-*")] == ["optimizer-shards-4"]
    resumed = _launch({"two": (2, {"directory": folder, "epochs": 2, "shard": "optimizer", "backup": "resume"})})
    reference = first["reference"][0]
    for rank, got in enumerate(resumed["two"]):
        assert got["iterations"] == 8 and len(got["loss"]) == 1, got["loss"]  # the second epoch only
        np.testing.assert_allclose(got["loss"][0], reference["loss"][1], rtol=1e-5, err_msg=f"worker {rank}")
        for i, (g, w) in enumerate(zip(got["weights"], reference["weights"], strict=True)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"worker {rank}, weight {i}")
