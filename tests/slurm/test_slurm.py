"""Real SLURM: srun, sbatch and Hydra's submitit launcher run rdkeras training jobs on the test cluster.

No rdkeras variable is set: rank and local rank come from SLURM, the job token from a per-user secret
file (here under a temporary XDG_CONFIG_HOME, as a shared home directory would hold it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import TESTS_DIR
from tests.readme_commands import command

REPO = TESTS_DIR.parent
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
# Each test waits for SLURM jobs that import TensorFlow; on a loaded machine that takes minutes.
pytestmark = pytest.mark.timeout(900)
# FCN-5 small enough for 2 cores; the global batch of 16 is split over the tasks.
SMALL = ["model.input_dim=256", "model.hidden=128", "trainer.epochs=1", "trainer.steps_per_epoch=4"]
SMALL += ["trainer.batch_size=16", "trainer.verbose=2", "logger=none"]


def _env(folder: Path) -> dict:
    return {"XDG_CONFIG_HOME": str(folder / "config"), "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHON": sys.executable}


@pytest.fixture
def env(tmp_path):
    return _env(tmp_path)


def _weights(run_dir: Path) -> list[np.ndarray]:
    (ckpt,) = sorted((run_dir / "checkpoints").glob("*.weights.h5"))
    out = []
    with h5py.File(ckpt, "r") as f:
        f.visititems(lambda name, obj: out.append((name, np.array(obj))) if isinstance(obj, h5py.Dataset) else None)
    return [w for _, w in sorted(out, key=lambda t: t[0])]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The same training in one process, the reference for every SLURM run."""
    import subprocess

    out = tmp_path_factory.mktemp("one")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rdkeras.train",
            "+recipe=fcn5",
            *SMALL,
            "cluster.num_workers=1",
            f"hydra.run.dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def _srun_train(slurm, env, run_dir: Path):
    """The README's srun command, made small."""
    argv = command("srun", overrides=[*SMALL, f"hydra.run.dir={run_dir}"])
    return slurm.run(*argv, env=env, timeout=600, cwd=run_dir.parent)


@pytest.fixture(scope="module")
def srun(slurm, tmp_path_factory):
    """The README's srun command, made small, run once for the tests below: (its folder, the run, the env)."""
    tmp = tmp_path_factory.mktemp("srun")
    env, run = _env(tmp), tmp / "srun"
    done = _srun_train(slurm, env, run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run, done, env


def test_srun_trains_two_tasks_with_no_rdkeras_variable(srun):
    run, done, env = srun
    results = json.loads((run / "results.json").read_text())
    assert results["workers"] == 2 and results["transport"] == "shm"  # one node: auto picks shm
    assert "local workers" not in done.stdout  # each task is one worker; nothing spawned
    secret = Path(env["XDG_CONFIG_HOME"]) / "rdkeras" / "job-token"
    assert oct(secret.stat().st_mode & 0o777) == "0o600"


def test_srun_two_tasks_equal_one_process(srun, one_process):
    run, _, _ = srun
    for got, want in zip(_weights(run), _weights(one_process), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.extended  # (12 s; the srun tests keep SLURM in the default run, which is at its 10-minute budget)
def test_sbatch_script_runs_and_a_failing_job_is_reported(slurm, env, tmp_path):
    run = tmp_path / "sbatch"
    readme = command("sbatch", overrides=[*SMALL, f"hydra.run.dir={run}"])
    assert readme[1] == "examples/slurm/train.sbatch"
    # Submitted from tmp_path, where the job's output file goes.
    ok = slurm.run("sbatch", "--wait", str(REPO / readme[1]), *readme[2:], env=env, timeout=600, cwd=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("rdkeras-fcn5-*.out"))
    assert ok.returncode == 0, ok.stdout + ok.stderr + logs[-3000:]
    assert json.loads((run / "results.json").read_text())["workers"] == 2
    bad = slurm.run(
        "sbatch", "--wait", f"--chdir={tmp_path}", str(SBATCH), "trainer.batch_size=0", env=env, timeout=300
    )
    assert bad.returncode != 0  # sbatch --wait exits with the job's status
    logs = "".join(p.read_text() for p in tmp_path.glob("rdkeras-fcn5-*.out"))
    assert "rdkeras.train: error: trainer.batch_size must be a whole number >= 1, got 0" in logs


@pytest.mark.slow
def test_hydra_submitit_launcher_runs_a_recipe_and_reports_a_failed_job(slurm, env, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    sweep = tmp_path / "multirun"
    extra = ["hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}"]
    extra += [f"hydra.launcher.submitit_folder={tmp_path}/submitit", *SMALL]
    args = command("python", "submitit_slurm", overrides=extra)
    done = slurm.run(*args, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((sweep / "0" / "results.json").read_text())
    assert results["workers"] == 2 and results["history"]["loss"]
    failed = slurm.run(*args, "trainer.batch_size=0", env=env, timeout=600, cwd=tmp_path)
    assert failed.returncode == 2  # the job failed on the cluster; the sweep ends in its one-line error
    assert "rdkeras.train: error: trainer.batch_size must be a whole number >= 1, got 0" in failed.stderr, failed.stderr


LOCAL_RANK_SCRIPT = """
import os
before = os.environ.get("LOCAL_RANK")
import rdkeras
strategy = rdkeras.RDMAStrategy()
print("ranks", strategy.worker_index, before, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], flush=True)
strategy.close()
"""


def test_rdmastrategy_exports_local_rank_under_srun(slurm, env, tmp_path):
    # Horovod-style scripts read os.environ["LOCAL_RANK"] after creating the strategy; srun sets SLURM_LOCALID only.
    done = slurm.run("srun", "-n", "2", sys.executable, "-c", LOCAL_RANK_SCRIPT, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = sorted(line for line in done.stdout.splitlines() if line.startswith("ranks "))
    assert seen == ["ranks 0 None 0 2", "ranks 1 None 1 2"], done.stdout
