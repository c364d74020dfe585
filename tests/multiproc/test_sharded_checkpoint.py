"""Sharded checkpoints (rdkeras.parallel.sharded_checkpoint): 4 workers' checkpoint resumes on 2 workers (sharded
or not) and in one plain Keras process, each going on as one process that never stopped; a save cut short leaves
the previous checkpoint whole."""

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


def test_four_workers_checkpoint_resumes_anywhere_as_one_process_would_go_on(tmp_path):
    folder = str(tmp_path / "checkpoint")
    first = _launch({"reference": (1, {"directory": folder, "epochs": 2, "shard": None}),
                     "four": (4, {"directory": folder, "epochs": 1, "shard": "gradients", "save": True})})  # fmt: skip
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["workers"] == 4 and manifest["slots"] == ["momentum", "velocity"]
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("shard-*")) == [f"shard-{r}" for r in range(4)]
    load = {"directory": folder, "epochs": 1, "load": True}
    resumed = _launch({"two_sharded": (2, {**load, "shard": "optimizer"}), "two_whole": (2, {**load, "shard": "none"}),
                       "plain_keras": (1, {**load, "shard": None})})  # fmt: skip
    reference = first["reference"][0]
    for name, workers in resumed.items():
        for rank, got in enumerate(workers):
            who = f"{name}, worker {rank}"
            assert got["iterations"] == reference["iterations"] == 8, who  # 4 steps an epoch: the count went on
            np.testing.assert_allclose(got["loss"][0], reference["loss"][1], rtol=1e-5, err_msg=who)
            for i, (g, w) in enumerate(zip(got["weights"], reference["weights"], strict=True)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{who}, weight {i}")
