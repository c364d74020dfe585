"""The training app end to end: the six recipes on 2 workers (--multirun launches), TensorBoard contents,
model-parallel VGG-16, a bad placement, TF_CONFIG, and the notebook."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
SIX = ["fcn5", "alexnet", "inception_v3", "vgg16", "lstm", "gru"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "RDKERAS_TIMEOUT": "120", "RDKERAS_TRANSPORT": "shm"}
TWO_STEPS = ["trainer.steps_per_epoch=2", "trainer.epochs=1", "trainer.verbose=2", "~callbacks.model_checkpoint"]


def _train(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rdkeras.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or ENV,
        cwd=cwd,  # anywhere: the configs ship inside the package
    )


def _scalars(folder: Path) -> dict[str, list[tuple[int, Any]]]:
    """TensorBoard scalars and text (Keras 3 and tf.summary write them as tensors), read back by rdkeras's reader."""
    from rdkeras.train.tbplot import read_run

    return read_run(folder)


def _hparams(folder: Path) -> tuple[dict, list[str]]:
    """The HParams session record in a TensorBoard folder's own event files, and the metric columns."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import plugin_data_pb2

    found, metrics = None, []
    for events in sorted(folder.glob("events.out.tfevents.*")):
        for record in tf.compat.v1.train.summary_iterator(str(events)):
            for value in record.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        found = {
                            n: getattr(v, v.WhichOneof("kind")) for n, v in data.session_start_info.hparams.items()
                        }
                    if data.HasField("experiment"):
                        metrics = [
                            f"{m.name.group}/{m.name.tag} {m.display_name}" for m in data.experiment.metric_infos
                        ]
    assert found is not None, f"no HParams record in {folder}"
    return found, metrics


# The default run trains two of the six (fully connected, recurrent with an embedding; convolutional VGG-16 trains
# in the model-parallel recipe test below); -m slow trains the other four the same way.
DEFAULT_RECIPES, SLOW_RECIPES = ["fcn5", "lstm"], ["alexnet", "inception_v3", "vgg16", "gru"]


def _sweep(root: Path, recipes: list[str]) -> None:
    """One --multirun launch of `recipes` for 2 steps on 2 local workers, into `root`."""
    done = _train("--multirun", f"+recipe={','.join(recipes)}", *TWO_STEPS, f"hydra.sweep.dir={root}", cwd=root)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def _checked_results(root: Path, recipes: list[str]) -> dict[str, dict]:
    """Each job's results by recipe, after the checks every recipe's run must pass."""
    seen = {}
    for job in sorted(p for p in root.iterdir() if (p / ".hydra").is_dir()):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        recipe = next(r for r in recipes if f"recipe={r}\n" in overrides)  # the app writes +recipe= as recipe=
        results = json.loads((job / "results.json").read_text())
        seen[recipe] = results
        assert results["workers"] == 2 and results["transport"] == "shm" and results["parallelism"] == "data"
        assert math.isfinite(results["final"]["loss"]) and results["final"]["loss"] > 0
        # The chief printed Keras's progress; only the chief.
        assert "2/2" in (job / "worker-0.log").read_text()
        assert "2/2" not in (job / "worker-1.log").read_text()
        assert (job / "resolved_config.yaml").exists() and (job / "curves.png").stat().st_size > 0
    assert sorted(seen) == sorted(recipes)
    return seen


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    _sweep(root, DEFAULT_RECIPES)
    return root


@pytest.mark.timeout(900)
def test_two_of_the_recipes_train_two_steps_on_two_workers(sweep):
    assert sorted(DEFAULT_RECIPES + SLOW_RECIPES) == sorted(SIX)
    seen = _checked_results(sweep, DEFAULT_RECIPES)
    assert seen["fcn5"]["parameters"] == 10_492_928
    assert seen["lstm"]["final"]["perplexity"] == pytest.approx(2000, rel=0.2)  # random tokens, 2000 words


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_other_four_recipes_train_two_steps_on_two_workers(tmp_path):
    _sweep(tmp_path, SLOW_RECIPES)
    seen = _checked_results(tmp_path, SLOW_RECIPES)
    # Random labels: the loss starts near log(classes).
    assert seen["vgg16"]["final"]["loss"] == pytest.approx(math.log(10), rel=0.2)


def test_tensorboard_holds_loss_throughput_traffic_registrations_and_the_plan(sweep, tmp_path):
    jobs = [p for p in sweep.iterdir() if (p / ".hydra").is_dir()]
    job = next(p for p in jobs if "recipe=fcn5\n" in (p / ".hydra" / "overrides.yaml").read_text())
    train = _scalars(job / "tensorboard" / "train")
    assert [s for s, _ in train["batch_loss"]] == [1, 2] and all(v > 0 for _, v in train["batch_loss"])
    assert "batch_accuracy" in train and "epoch_loss" in train
    stats = _scalars(job / "tensorboard" / "rdkeras")
    for tag in (
        "throughput/batches_per_s",
        "throughput/examples_per_s",
        "comm/bytes_sent",
        "comm/bytes_received",
        "comm/wait_ms",
        "tracker/registrations",
    ):
        assert [s for s, _ in stats[tag]] == [1, 2], tag
    batches_per_s, examples_per_s = stats["throughput/batches_per_s"][1][1], stats["throughput/examples_per_s"][1][1]
    assert examples_per_s == pytest.approx(64 * batches_per_s, rel=1e-3)  # the recipe's global batch, 64
    # Step 2 moved exactly one allreduce of FCN-5's gradients: on 2 workers each sends all of them once.
    gradient_bytes = 10_492_928 * 4
    assert stats["comm/bytes_sent"][1][1] == pytest.approx(gradient_bytes, rel=0.01)
    assert stats["tracker/registrations"][1][1] == stats["tracker/registrations"][0][1]  # nothing new registered
    (step, plan), *_ = stats["plan"]
    assert step == 0 and "data parallel" in plan and f"{gradient_bytes:,} gradient bytes" in plan
    assert "| fc1/kernel | (4096, 1024) | float32 | 16,777,216 |" in plan
    # The resolved config is recorded as TensorBoard HParams (the HPARAMS tab compares runs by it).
    hparams, metrics = _hparams(job / "tensorboard")
    assert hparams["trainer.batch_size"] == 64 and hparams["model"] == "fcn5"
    assert not [k for k in hparams if "_target_" in k or k.startswith("callbacks.") or k.endswith("path")], hparams
    assert metrics == ["train/epoch_loss loss (objective)", "train/epoch_accuracy accuracy"], metrics
    # The README's picture of the scalars is drawn from the same files.
    from rdkeras.train.tbplot import render

    drawn = render(job / "tensorboard", tmp_path / "scalars.png")
    assert {"rdkeras/comm/bytes_sent", "train/batch_loss"} <= set(drawn) and (tmp_path / "scalars.png").exists()


# Hybrid on 4 workers is slow here (test_model_parallel trains hybrid to the one-process weights by default).
@pytest.mark.parametrize(
    ("parallel", "workers"),
    [pytest.param("model", 2, marks=pytest.mark.extended), pytest.param("hybrid", 4, marks=pytest.mark.slow)],
)
def test_vgg16_model_parallel_recipe_trains_two_steps(tmp_path, parallel, workers):
    args = ("+recipe=vgg16_model", f"parallel={parallel}", f"cluster.num_workers={workers}", *TWO_STEPS)
    done = _train(*args, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["parallelism"] == parallel and math.isfinite(results["final"]["loss"])
    text = dict(_scalars(tmp_path / "tensorboard" / "rdkeras")["plan"])[0]
    assert "block5_pool:0 -> flatten" in text and "static" in text  # the cut edge between the workers
    assert ("2 stages x 2 replicas" in text) == (parallel == "hybrid")
    # The summary says how the pipeline runs: 1F1B by default, stashing at most 2 and 1 of the 4 micro-batches.
    assert results["pipeline"]["schedule"] == "1f1b" and results["pipeline"]["stashed"] == [2, 1]
    assert "4 micro-batches, 1f1b; activations stashed at most 2 / 1 micro-batches" in done.stdout


def test_a_placement_naming_a_missing_layer_is_one_error_line(tmp_path):
    done = _train(
        "+recipe=vgg16_model",
        "~parallel.placement",
        "+parallel.placement={block9*:0,fc*:1}",
        *TWO_STEPS,
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[0]] and done.stderr.startswith(
        "rdkeras.train: error: parallel.placement pattern 'block9*' matches no layer"
    ), done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_under_tf_config_the_app_is_one_worker_of_that_cluster(tmp_path):
    from rdkeras.launch import free_port

    tf_config = {"cluster": {"worker": [f"127.0.0.1:{free_port()}"]}, "task": {"type": "worker", "index": 0}}
    env = {**ENV, "TF_CONFIG": json.dumps(tf_config), "RDKERAS_JOB_TOKEN": "test"}
    args = ["+recipe=fcn5", "cluster.num_workers=3", *TWO_STEPS, f"hydra.run.dir={tmp_path}"]
    done = _train(*args, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "local workers" not in done.stdout  # nothing spawned: this process is the worker
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["workers"] == 1


def test_the_notebook_trains_on_two_workers_through_launch(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "examples" / "notebook.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    client.execute(env={**ENV, "PYTHONPATH": str(REPO)})
    outputs = "".join(
        o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    assert "[0] Epoch 3/3" in outputs and "[1] Epoch" not in outputs  # progress on the chief, rank-prefixed
    assert "identical weights on both workers: True" in outputs
    assert "accuracy after 3 epochs:" in outputs
