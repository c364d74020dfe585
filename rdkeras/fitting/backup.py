"""BackupAndRestore across workers: one backup of the whole job, written by the reporter.

Every worker takes part in gathering the training state before a backup (a
collective: all save at the same batches); the reporter then writes it atomically,
with the epoch stamped inside the weights file, so one rename commits both. At the
start of fit the reporter loads the backup and the parallelism gives every worker
its epoch, weights and optimizer state.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rdkeras import keras_internals
from rdkeras.fitting import saving
from rdkeras.fitting.elastic import retrying
from rdkeras.fitting.saving import write_atomically

if TYPE_CHECKING:
    from rdkeras.parallel.base import Parallelism

BACKUP_METADATA_ATTR = "rdkeras_training_metadata"
OPTIMIZER_SHARDS = "optimizer-shards"  # a sharded optimizer's state beside the backup: "optimizer-shards-ITERATION"


def adapt(callback: Any, parallel: Parallelism) -> None:
    """BackupAndRestore across workers: the reporter loads and writes the backup (atomically, with
    the epoch inside the weights file); every worker takes part in gathering the state first."""
    if keras_internals.overridden(callback):
        return

    def save(cb: Any) -> None:
        # In an elastic job a worker lost in the middle makes the group re-form and save again.
        retrying(parallel, cb.model, lambda: save_once(cb))

    def save_once(cb: Any) -> None:
        parallel.gather_state(cb.model)  # collective: every worker saves at the same batches
        folder = keras_internals.backup_paths(cb)[0].parent
        shards = parallel.save_optimizer_shards(cb.model, folder)  # collective; before the weights commit them
        if parallel.is_reporter:
            optimizer = cb.model.optimizer
            # With its sharded state beside it, the weights file rightly holds only the optimizer's own variables.
            quiet = parallel.optimizer_saved_as(cb.model, list(optimizer.variables)) if shards else None
            with quiet or contextlib.nullcontext():
                _write_backup(cb)
            for old in folder.glob(f"{OPTIMIZER_SHARDS}-*"):
                if shards is None or old != shards:
                    shutil.rmtree(old, ignore_errors=True)

    def load(cb: Any) -> None:
        parallel.backup_folder = keras_internals.backup_paths(cb)[0].parent  # (shards: read after the weights)
        if parallel.is_reporter and _load_backup(cb):
            parallel.restored = True

    def keep(cb: Any, logs: Any = None) -> None:
        if parallel.is_reporter:
            keras_internals.original(cb, "on_train_end")(logs)

    keras_internals.override(callback, keras_internals.BACKUP_SAVE_HOOK, save)
    keras_internals.override(callback, keras_internals.BACKUP_LOAD_HOOK, load)
    keras_internals.override(callback, "on_train_end", keep)


def _write_backup(cb: Any) -> None:
    import h5py

    weights, metadata, prev_weights, prev_metadata = keras_internals.backup_paths(cb)
    weights.parent.mkdir(parents=True, exist_ok=True)
    if cb.double_checkpoint:
        for src, dst in ((weights, prev_weights), (metadata, prev_metadata)):
            if src.exists():

                def copy(tmp: str, src: Path = src) -> None:
                    shutil.copyfile(src, tmp)

                write_atomically(dst, copy)
    epoch, batch = keras_internals.backup_position(cb)
    meta = json.dumps({"epoch": epoch, "batch": batch})
    save_weights = keras_internals.original(cb.model, "save_weights")  # Keras's: the rename is done here

    def write_weights(tmp: str) -> None:
        save_weights(tmp, overwrite=True)
        with h5py.File(tmp, "a") as f:  # the epoch travels with the weights: one rename commits both
            f.attrs[BACKUP_METADATA_ATTR] = meta

    write_atomically(weights, write_weights, saving.state_bytes(cb.model))

    def write_metadata(tmp: str) -> None:
        Path(tmp).write_text(meta)

    write_atomically(metadata, write_metadata)


def _load_backup(cb: Any) -> bool:
    """Keras's restore, reading the epoch from the weights file when it carries one."""
    import h5py

    model = cb.model
    if not model.built:
        raise ValueError(
            "To use the BackupAndRestore callback, your model must be built before you call `fit()`: "
            "call it on a batch of data (or give it an Input)"
        )
    weights, metadata, _, _ = keras_internals.backup_paths(cb)
    meta = None
    if weights.exists():
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(str(weights))
        with h5py.File(weights, "r") as f:
            stamped = f.attrs.get(BACKUP_METADATA_ATTR)
        meta = json.loads(stamped) if stamped is not None else None
    if meta is None and metadata.exists():
        meta = json.loads(metadata.read_text())
    if meta is None:
        return False
    keras_internals.set_initial_epoch(model, meta["epoch"])
    return True
