"""A full disk while a checkpoint is written (a small tmpfs): a clear error, no signal, the previous file
intact, no temporary file left; and what a killed save left behind is removed at the next start (in the
weights case)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# A model of 84,490 parameters: 0.34 MB of weights, about 1 MB with Adam's slots (a weights file holds them too).
TRAIN = """
import os, sys, numpy as np, keras, rdkeras
from rdkeras.fitting import saving
out, kind = sys.argv[1], sys.argv[2]
if "unchecked" in sys.argv:
    saving._check_room = lambda path, expected: None  # as if the estimate had been too low
strategy = rdkeras.RDMAStrategy()  # one worker: saves go through rdkeras's hooks
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(256),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(0)
x, y = rng.random((256, 64), np.float32), rng.integers(0, 10, 256)
callbacks = {
    "weights": [keras.callbacks.ModelCheckpoint(os.path.join(out, "ck.weights.h5"), save_weights_only=True)],
    "model": [keras.callbacks.ModelCheckpoint(os.path.join(out, "ck.keras"))],
    "backup": [keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))],
}[kind]


class Saved(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        np.save(os.path.join(os.path.dirname(out), f"kernel{epoch}.npy"), self.model.layers[0].kernel.numpy())


model.fit(x, y, batch_size=64, epochs=int(os.environ.get("EPOCHS", "3")), callbacks=[*callbacks, Saved()], verbose=0)
print("finished")
"""


@contextlib.contextmanager
def _tmpfs(path: Path, size_kb: int) -> Iterator[Path]:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _train(out: Path, kind: str, *flags: str, epochs: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", "EPOCHS": str(epochs)}
    for k in [k for k in env if k.startswith("RDKERAS_")]:
        env.pop(k)
    script = [sys.executable, "-c", textwrap.dedent(TRAIN), str(out), kind, *flags]
    return subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


@pytest.mark.parametrize(
    ("kind", "size_kb", "saved"),
    [
        ("weights", 1700, "ck.weights.h5"),  # the default run keeps one kind; -m slow the whole-model and backup saves
        pytest.param("model", 1700, "ck.keras", marks=pytest.mark.slow),
        pytest.param("backup", 1700, "backup/latest.weights.h5", marks=pytest.mark.slow),
    ],
)
def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_file(tmp_path, kind, size_kb, saved):
    with _tmpfs(tmp_path / "disk", size_kb) as disk:
        # What killed saves of an earlier run left goes when fit starts; files not ours stay.
        left = [disk / ".ck.k9x_2abq.tmp.weights.h5", disk / ".ck.0123abcd.tmp.keras"]
        kept = [disk / "notes.txt", disk / ".hidden", disk / "ck.tmp.weights.h5"]
        seeded = left + kept if kind == "weights" else []
        for p in seeded:
            p.write_text("half a file, or not ours")
        done = _train(disk, kind)
        # Room for one file and not for its replacement beside it: the second epoch's save fails.
        assert done.returncode == 1, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
        assert "OSError: [Errno 28] no space left in" in done.stderr, done.stderr[-3000:]
        assert "finished" not in done.stdout
        assert _temporaries(disk) == [p.name for p in seeded if p in kept and ".tmp" in p.name]
        assert all(p.exists() for p in seeded if p in kept)
        assert (disk / saved).is_file()
        _assert_holds_epoch_0(disk / saved, np.load(tmp_path / "kernel0.npy"))


def _assert_holds_epoch_0(path: Path, expected: np.ndarray) -> None:
    import keras

    if path.suffix == ".keras":
        model = keras.models.load_model(path)
    else:
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(256), keras.layers.Dense(10)]
        )
        model.load_weights(path)
    assert np.array_equal(model.layers[0].kernel.numpy(), expected), "not the first epoch's file"


def test_a_disk_that_fills_in_the_middle_of_an_hdf5_write_is_an_error_not_a_crash(tmp_path):
    # Without the room check (as if it had estimated too little), HDF5 meets the full disk itself.
    with _tmpfs(tmp_path / "disk", 1700) as disk:
        done = _train(disk, "weights", "unchecked")
        assert done.returncode == 1, f"exit {done.returncode} (a negative one is a signal):\n{done.stderr[-3000:]}"
        assert "no space left in" in done.stderr and _temporaries(disk) == []


@pytest.mark.extended
def test_the_train_apps_checkpoint_on_a_full_disk_ends_in_one_clear_error(tmp_path):
    with _tmpfs(tmp_path / "disk", 300) as disk:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
        done = subprocess.run(
            [sys.executable, "-m", "rdkeras.train", "+recipe=fcn5", "model.input_dim=64", "model.hidden=64",
             "trainer.epochs=4", "trainer.steps_per_epoch=3", f"hydra.run.dir={tmp_path / 'run'}",
             f"callbacks.model_checkpoint.filepath='{disk}/epoch{{epoch:03d}}.weights.h5'"],
            env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    first = next(line for line in done.stderr.splitlines() if "failed first" in line)
    assert "worker rank 0 failed first (uncaught OSError: [Errno 28] no space left in" in first, first
    assert "signal" not in first
