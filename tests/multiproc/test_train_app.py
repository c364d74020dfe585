"""The training app as a Hydra citizen: a killed run resumes in its folder, a sweeper optimises the
returned objective."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "RDKERAS_TIMEOUT": "120", "PYTHONPATH": str(REPO)}
# FCN-5 on synthetic data (no recipe), small enough for seconds: 3 epochs of 3 steps, a fixed data order.
TINY = [
    "recipe=null", "model.input_dim=64", "model.hidden=32", "trainer.epochs=3", "trainer.steps_per_epoch=3",
    "trainer.verbose=2", "trainer.shuffle=false", "trainer.optimizer.class_name=Adam",
    "trainer.optimizer.learning_rate=0.01", "logger=none",
]  # fmt: skip


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rdkeras.train", *args], capture_output=True, text=True, timeout=600, env=env or ENV
    )


def _weights(path: Path) -> list[np.ndarray]:
    import h5py

    out: list[np.ndarray] = []
    with h5py.File(path, "r") as f:
        f["layers"].visititems(lambda name, obj: out.append(np.asarray(obj)) if hasattr(obj, "shape") else None)
    return out


def test_the_readmes_first_run_learns_the_digits_and_compares_with_one_process(tmp_path):
    # `python -m rdkeras.train`, as the README's first command runs it: the digits shipped with rdkeras on 2
    # workers, then the same training in one process; no line of its output looks like an error.
    done = subprocess.run(
        [sys.executable, "-m", "rdkeras.train", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if not k.startswith(("RDKERAS_", "TF_CPP"))},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    alarming = re.compile(r"error|fail|traceback|exception|warn|cuInit|^[EWF]\d{4} ", re.I)
    assert [line for line in (done.stdout + done.stderr).splitlines() if alarming.search(line)] == []
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["final"]["val_accuracy"] > 0.9 and results["one_process"]["final"]["val_accuracy"] > 0.9
    summary = results["summary"]
    assert f"on the held-out data after the last epoch: accuracy {results['final']['val_accuracy']:.3f}" in summary
    ratio = results["examples_per_s"] / results["one_process"]["examples_per_s"]
    assert f"examples/s there (the same training, run after this one), so {ratio:.2f}x here" in summary
    assert summary.splitlines()[-1] in done.stdout  # the comparison is the output's last line


@pytest.mark.extended
def test_a_killed_run_resumes_when_started_again_in_its_folder(tmp_path):
    run, straight = tmp_path / "run", tmp_path / "straight"
    kill = ["+callbacks.kill._target_=tests.ranks.lifecycle_workers.KillAtEpoch", "+callbacks.kill.epoch=1"]
    died = _train(*TINY, *kill, f"hydra.run.dir={run}", env={**ENV, "RDKERAS_TEST_KILL": "1"})
    assert died.returncode == 1 and "worker rank 1 failed first (rank 1 " in died.stderr, died.stderr[-3000:]
    assert "then signal 9)" in died.stderr
    assert (run / "backup" / "latest.weights.h5").exists()  # epoch 0's state
    again = _train(*TINY, *kill, f"hydra.run.dir={run}")  # the same command, the same folder
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = "rdkeras: resumed from BackupAndRestore's backup: 1 epoch(s) done, training on from epoch 2"
    assert (again.stdout + again.stderr).count(resumed) == 1  # said once, by the chief
    results = json.loads((run / "results.json").read_text())
    assert len(results["history"]["loss"]) == 2  # epochs 1 and 2: epoch 0 came from the backup
    assert not (run / "backup").exists()  # done: the backup is removed
    # Uninterrupted, with TensorBoard on and step 2 profiled (logger.profile_batch): the same weights.
    whole = _train(*TINY, "logger=tensorboard", "logger.profile_batch=2", f"hydra.run.dir={straight}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert list((straight / "tensorboard" / "train" / "plugins" / "profile").rglob("*.xplane.pb"))
    resumed, uninterrupted = (
        _weights(run / "checkpoints/epoch003.weights.h5"),
        _weights(straight / "checkpoints/epoch003.weights.h5"),
    )
    assert len(resumed) == 8 and all(np.array_equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))


@pytest.mark.extended
def test_an_optuna_sweep_optimises_the_objective_the_task_returns(tmp_path):
    # One worker a trial, in the sweep's own process (cluster=env outside a job): the sweep is under test here
    # (the killed run above trains on two).
    done = _train(
        "--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=minimize",
        "trainer.optimizer.learning_rate=interval(0.001,0.1)", *TINY[:3], "trainer.epochs=1",
        "trainer.steps_per_epoch=2", "logger=none", "trainer.verbose=0", "cluster=env",
        f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [json.loads((tmp_path / str(i) / "results.json").read_text())["final"]["loss"] for i in (0, 1)]
    best = (tmp_path / "optimization_results.yaml").read_text()
    assert f"best_value: {min(losses)}" in best, (best, losses)


def test_a_diverged_run_ends_non_zero_on_every_worker_and_writes_nothing_finished(tmp_path):
    # Adam at 1e38 makes the weights inf at the second step: both workers stop at that step (none waits for the
    # other), the run exits 1 with one line, and nothing looks like a finished run (issue 48).
    done = _train(*TINY, "trainer.optimizer.learning_rate=1e38", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    line = (
        "rdkeras.train: error: training diverged at epoch 1, step 2: the weights are no longer finite (nan or inf); "
        "lower trainer.optimizer.learning_rate (now 1e+38), or look for nan or inf in the data. The run stopped "
        "there on every worker: no checkpoint of this epoch, no results.json"
    )
    assert done.stderr.strip().splitlines()[-1] == line and "Traceback" not in done.stdout + done.stderr
    for rank in (0, 1):  # every worker said it
        assert line in (tmp_path / f"worker-{rank}.log").read_text()
    assert not (tmp_path / "results.json").exists() and not list(tmp_path.glob("checkpoints/*"))
