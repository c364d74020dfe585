"""Elastic training: a worker lost in the middle of fit, and the survivors go on with the same global batch.

Each run is ``python -m rdkeras.launch -n N --min-workers M tests/ranks/elastic_fit.py`` -- an unchanged
Keras script -- whose workers SIGKILL (or SIGSTOP) themselves at a given batch, so the loss lands in the middle
of an epoch every time. The survivors' weights must be bit-identical and equal to one process's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
SCRIPT = TESTS_DIR / "ranks" / "elastic_fit.py"
LOOP = TESTS_DIR / "ranks" / "elastic_loop.py"  # a custom loop: rdkeras.elastic.State and run
ENV = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3", "RDKERAS_TIMEOUT": "60"}


def _launch(out: Path, *args: str, workers: int = 3, min_workers: int = 2, transport: str = "shm",
            env: dict | None = None, extra: tuple[str, ...] = (),
            script: Path = SCRIPT) -> subprocess.CompletedProcess:  # fmt: skip
    launch = [sys.executable, "-m", "rdkeras.launch", "-n", str(workers), "--min-workers", str(min_workers), *extra]
    return subprocess.run([*launch, "--transport", transport, str(script), str(out), *args], capture_output=True,
                          text=True, timeout=240, env={**ENV, **(env or {})}, cwd=REPO)  # fmt: skip


def _one_process(script: Path, out: Path, *args: str) -> list[np.ndarray]:
    """The weights `script` trains to in one plain Keras process."""
    subprocess.run([sys.executable, str(script), str(out), "--one-process", *args], check=True, env=ENV, timeout=120,
                   capture_output=True)  # fmt: skip
    return _weights(out / "weights-one.npz")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[np.ndarray]:
    return _one_process(SCRIPT, tmp_path_factory.mktemp("one"))


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[k] for k in f.files]


def _survivors(out: Path, expected: set[int]) -> list[list[np.ndarray]]:
    found = {int(p.stem.split("-")[1]): _weights(p) for p in out.glob("weights-[0-9]*.npz")}
    assert set(found) == expected
    return list(found.values())


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize(
    ("transport", "victim"),
    # over tcp the chief dies, and the gradient buckets overlap backprop (extended: the default run's budget)
    [("shm", 1), pytest.param("tcp", 0, marks=pytest.mark.extended)],
)
def test_survivors_go_on_equal_to_one_process(tmp_path, one_process, transport, victim):
    before = _shm_files()
    done = _launch(tmp_path, "--kill", f"{victim}:1:1", "--tensorboard", transport=transport)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    others = {0, 1, 2} - {victim}
    weights = _survivors(tmp_path, others)
    for a, b in zip(*weights, strict=True):
        assert np.array_equal(a, b)  # the survivors agree bit for bit
    for mine, reference in zip(weights[0], one_process, strict=True):
        np.testing.assert_allclose(mine, reference, atol=1e-5)
    # Each survivor ended in the 2-worker group, as the rank its old order gives it.
    for new_rank, worker in enumerate(sorted(others)):
        assert f"[{worker}] worker {worker} ended as rank {new_rank} of 2" in done.stdout
    line = re.search(r"lost worker (\d) \(killed by signal 9\); 2 workers \((\d), (\d)\) went on from step 6; "
                     r"its first step (\S+) s after the loss", done.stderr)  # fmt: skip
    assert line, done.stderr[-2000:]
    assert line.group(1) == str(victim) and {int(line.group(2)), int(line.group(3))} == others
    assert float(line.group(4)) > 0
    assert _shm_files() <= before
    # Nothing of the old group stays mapped: its own arena and one peer's over shm (the old group's were three),
    # its own alone over tcp.
    for worker in others:
        assert f"[{worker}] worker {worker} maps {2 if transport == 'shm' else 1} arenas" in done.stdout
    # One continuous run in TensorBoard, written by whoever is the chief: every epoch's loss (after the chief's
    # loss, its successor goes on in the same folder), and the change as an event at the step it happened.
    assert sorted(set(re.findall(r"TB epoch_loss step (\d)", done.stdout))) == ["0", "1", "2"], done.stdout[-2000:]
    assert re.search(r"TB elastic/workers step (\d+) value 2", done.stdout), done.stdout[-2000:]


def _checkpoint(path: Path) -> tuple[list[np.ndarray], int]:
    """A weights file's layers' weights (in the model's order) and its optimizer's step count."""
    import h5py

    with h5py.File(path, "r") as f:
        names: list[str] = []
        f["layers"].visititems(lambda name, o: names.append(name) if isinstance(o, h5py.Dataset) else None)
        return [f["layers"][n][()] for n in names], int(f["optimizer/vars/0"][()])


@pytest.mark.extended  # (19 s; the default run is at its 10-minute budget)
def test_a_checkpoint_the_chief_dies_writing_is_written_by_the_new_chief(tmp_path):
    # The chief SIGKILLs itself inside the second epoch's ModelCheckpoint write, its temporary file written: the
    # survivors meet after the epoch's callbacks, re-form, and worker 1, the new chief, writes that checkpoint.
    done = _launch(tmp_path, "--checkpoint", "--die-in-save", "0:1", "--epoch-weights")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Every epoch's checkpoint, and no temporary left.
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"ckpt-{e}.weights.h5" for e in (1, 2, 3)]
    assert re.search(r"\[1\] .*elastic: removed \S+/ckpt/\.ckpt-2\.\w+\.tmp\.weights\.h5, the lost chief's "
                     r"interrupted save", done.stdout), done.stdout[-3000:]  # fmt: skip
    assert "[1] rdkeras: elastic: the chief was lost in epoch 2's saves: worker 1, the new chief, saves that epoch" in (
        done.stdout
    )
    # What the lost chief would have written: the state it held at that epoch end (recorded just before its save),
    # bit for bit; the other epochs' checkpoints, written by the chief of their time, hold theirs.
    for epoch, worker in ((0, 0), (1, 0), (1, 1), (1, 2), (2, 1)):
        weights, steps = _checkpoint(tmp_path / "ckpt" / f"ckpt-{epoch + 1}.weights.h5")
        assert steps == 4 * (epoch + 1)
        for a, b in zip(weights, _weights(tmp_path / f"epoch-{worker}-{epoch}.npz"), strict=True):
            assert np.array_equal(a, b), (epoch, worker)
    assert re.search(r"lost worker 0 \(killed by signal 9\); 2 workers \(1, 2\) went on from step 8", done.stderr)


@pytest.mark.extended
def test_two_losses_in_a_row_leave_a_group_of_two(tmp_path, one_process):
    done = _launch(tmp_path, "--kill", "3:0:2", "--kill", "1:1:3", workers=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    weights = _survivors(tmp_path, {0, 2})
    for a, b in zip(*weights, strict=True):
        assert np.array_equal(a, b)
    for mine, reference in zip(weights[0], one_process, strict=True):
        np.testing.assert_allclose(mine, reference, atol=1e-5)
    assert re.search(r"lost worker 3 .*; 3 workers \(0, 1, 2\) went on from step 3", done.stderr), done.stderr[-2000:]
    assert re.search(r"lost worker 1 .*; 2 workers \(0, 2\) went on from step 8", done.stderr), done.stderr[-2000:]


@pytest.mark.extended
def test_a_replacement_joins_and_the_job_ends_with_three_equal_workers(tmp_path, tmp_path_factory):
    # Each step waits 0.8 s, so the replacement (TensorFlow's import included, on a loaded machine) starts while the
    # group trains.
    reference = _one_process(SCRIPT, tmp_path_factory.mktemp("one6"), "--epochs", "6")
    done = _launch(tmp_path, "--kill", "1:0:1", "--epochs", "6", "--slow", "0.8", extra=("--max-restarts", "1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    weights = _survivors(tmp_path, {0, 2, 3})  # worker 3: the replacement, taken in at an epoch end
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            assert np.array_equal(a, b)
    for mine, expected in zip(weights[0], reference, strict=True):
        np.testing.assert_allclose(mine, expected, atol=1e-5)
    assert "[3] worker 3 ended as rank 2 of 3" in done.stdout
    assert re.search(r"worker 3 joined as a replacement; 3 workers \(0, 2, 3\) went on from step \d+", done.stderr)


@pytest.mark.extended  # (25 s; the default run is at its 10-minute budget)
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_replacement_that_never_joins_is_reported_and_the_job_goes_on(tmp_path, how):
    # Worker 1 dies; its replacement, worker 3, exits (or hangs) before it reaches the launcher's lobby.
    done = _launch(tmp_path, "--kill", "1:0:1", "--slow", "0.5", "--replacement", how,
                   extra=("--max-restarts", "1", "--join-timeout", "2"))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _survivors(tmp_path, {0, 2})
    told = {
        "exit": r"it exited before joining \(exit code 3\); the group went on without it; its process: exit code 3",
        "hang": r"it did not reach the lobby within 2 s of its start \(--join-timeout\); it was told not to join; "
        r"the group went on without it; its process: killed by the launcher .*",
    }[how]
    which = r"rdkeras.launch: elastic: replacement worker 3 \(started for lost worker 1\) never joined the group"
    assert re.search(rf"{which}: {told}; its last output:\n.*replacement 3: cannot start \({how}\)", done.stderr), (
        done.stderr[-3000:]
    )
    # The launcher said so when it happened too, as the group trained on (before its summary at the end).
    said = re.search(rf"{which}: it (exited|did not reach).*; 2 workers go on\n", done.stderr)
    assert said and said.start() < done.stderr.index("rdkeras.launch: elastic: lost worker 1"), done.stderr[-3000:]


@pytest.mark.extended  # (8 s; the default run is at its 10-minute budget)
def test_losing_more_than_min_workers_allow_ends_the_job_naming_them(tmp_path):
    # Two of three die at once: the second is lost while the group re-forms, and one worker is too few.
    done = _launch(tmp_path, "--kill", "1:1:1", "--kill", "2:1:1")
    assert done.returncode != 0
    assert re.search(r"the job ended: lost worker 1 \(killed by signal 9\), worker 2 \(killed by signal 9\): 1 left, "
                     r"fewer than --min-workers 2", done.stderr), done.stderr[-2000:]  # fmt: skip
    assert not list(tmp_path.glob("weights-*"))


@pytest.mark.slow
def test_a_stopped_worker_ends_the_job_naming_it(tmp_path):
    done = _launch(tmp_path, "--stop", "1:1:1", env={"RDKERAS_HEARTBEAT_TIMEOUT": "2"})
    assert done.returncode != 0
    stopped = re.search(r"the job ended: worker 1 failed but is still running \(.*stalled", done.stderr)
    assert stopped, done.stderr[-2000:]
    assert "worker 1 ended" not in done.stdout


@pytest.fixture(scope="module")
def one_process_loop(tmp_path_factory) -> list[np.ndarray]:
    return _one_process(LOOP, tmp_path_factory.mktemp("one-loop"))


def _equal_workers(weights: list[list[np.ndarray]], reference: list[np.ndarray]) -> None:
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            assert np.array_equal(a, b)  # bit for bit
    for mine, expected in zip(weights[0], reference, strict=True):
        np.testing.assert_allclose(mine, expected, atol=1e-5)


@pytest.mark.extended  # (22 s; the default run is over its 10-minute budget)
def test_a_custom_loop_goes_on_from_its_last_commit(tmp_path, one_process_loop):
    # Over tcp, the chief dies after its sixth commit: the survivors restore theirs, take the group's newest
    # (the chief's successor may be a commit behind), call the reset callbacks and run the loop again.
    done = _launch(tmp_path, "--kill", "0:1:1", transport="tcp", script=LOOP)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _equal_workers(_survivors(tmp_path, {1, 2}), one_process_loop)
    for new_rank, worker in enumerate((1, 2)):
        assert f"[{worker}] worker {worker} reset: 2 workers" in done.stdout
        assert f"[{worker}] worker {worker} ended as rank {new_rank} of 2 after 12 commits at epoch 3" in done.stdout
    assert re.search(r"lost worker 0 \(killed by signal 9\); 2 workers \(1, 2\) went on from step 6", done.stderr)


@pytest.mark.slow
def test_a_replacement_joins_a_custom_loop_at_a_commit(tmp_path, one_process_loop):
    done = _launch(tmp_path, "--kill", "1:0:1", "--slow", "1.0", extra=("--max-restarts", "1"), script=LOOP)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _equal_workers(_survivors(tmp_path, {0, 2, 3}), one_process_loop)
    assert "[3] worker 3 ended as rank 2 of 3 after 12 commits at epoch 3" in done.stdout
    assert "[0] worker 0 reset: 3 workers" in done.stdout
