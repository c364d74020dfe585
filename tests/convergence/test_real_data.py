"""Convergence on real data (-m slow): the recipes reach their documented accuracy and perplexity.

Each run keeps its Hydra output folder under outputs/convergence/RECIPE (results.json holds the per-epoch
curve, curves.png draws it, tensorboard/ has the scalars).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "RDKERAS_TRANSPORT": "shm"}


def _run_recipe(recipe: str, *overrides: str) -> dict:
    out = REPO / "outputs" / "convergence" / recipe
    shutil.rmtree(out, ignore_errors=True)
    args = [f"+recipe={recipe}", "trainer.verbose=2", *overrides, f"hydra.run.dir={out}"]
    done = subprocess.run(
        [sys.executable, "-m", "rdkeras.train", *args],
        capture_output=True,
        text=True,
        timeout=1500,
        env=ENV,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert (out / "curves.png").stat().st_size > 0
    print(f"{recipe}: {json.dumps(results['history'])} ({out})")
    return results


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fashion_mnist_cnn_reaches_85_percent_test_accuracy():
    if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
        pytest.skip("Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
    results = _run_recipe("fashion_mnist_cnn")
    curve = results["history"]["val_accuracy"]  # the 10,000 test images, after every epoch
    assert len(curve) == 5 and results["workers"] == 2
    assert curve[-1] >= 0.85, curve
    assert curve[-1] > curve[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lstm_lm_learns_shakespeare():
    results = _run_recipe("lstm_lm")
    curve = results["history"]["val_perplexity"]
    # A uniform guess over the ~80 characters has perplexity 80.
    assert curve[-1] <= LM_TARGET, curve
    assert curve[-1] < curve[0]


LM_TARGET = 6.0
