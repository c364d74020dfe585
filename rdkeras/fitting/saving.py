"""Saving under the strategy: a model file is written whole or not at all.

``model.save(...)`` and ``model.save_weights(...)`` of a distributed model write a
temporary file beside the target and rename it over the target, so a worker killed
in the middle of a save leaves the previous file intact (Keras writes in place).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rdkeras.keras_internals import original


def _atomic_path(filepath: Any, suffixes: tuple[str, ...]) -> Path | None:
    """`filepath` as a local Path when Keras writes it as one file with one of `suffixes`."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    text = os.fspath(filepath)
    if "://" in text or not text.endswith(suffixes):
        return None
    return Path(text)


def write_atomically(path: Path, write: Callable[[str], None], expected_bytes: int = 0) -> None:
    """Calls ``write(tmp)`` for a temporary path beside `path` (same suffix), then renames it over
    `path`: readers see the old file or the new one, never a part. With `expected_bytes` (about what
    `write` writes), a folder without that much room is refused before anything is written: HDF5 can
    crash the process when a disk fills under it."""
    suffix = ".weights.h5" if path.name.endswith(".weights.h5") else path.suffix
    stem = path.name[: -len(suffix)] if suffix else path.name
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_room(path, expected_bytes)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)  # Keras refuses to overwrite silently in some paths; let it create the file
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as e:
        _abandon_hdf5(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC, f"no space left in {path.parent} to save {path.name} (the previous {path.name} is intact)"
            ) from e
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_room(path: Path, expected_bytes: int) -> None:
    if expected_bytes <= 0:
        return
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    needed = int(expected_bytes * 1.1) + (64 << 10)  # the format's own bytes (a few KB per variable)
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no space left in {path.parent} to save {path.name}: it needs about {needed / 1e6:.1f} MB and "
            f"{free / 1e6:.1f} MB are free (the previous {path.name}, if any, is intact)",
        )


def variables_bytes(variables: Any) -> int:
    """Bytes the values of `variables` take, counted from their shapes and dtypes."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def kept_bytes(model: Any) -> dict[str, int]:
    """What training `model` keeps in one process, in bytes: ``parameters`` (its weights) and ``optimizer`` (its
    optimizer's variables, 0 before it is built), counted from the variables."""
    optimizer = getattr(model, "optimizer", None)
    slots = optimizer.variables if optimizer is not None and optimizer.built else []
    return {"parameters": variables_bytes(model.weights), "optimizer": variables_bytes(slots)}


def state_bytes(model: Any) -> int:
    """Bytes of a model's weights and its optimizer's variables, 4 KiB each for the file format's own: about
    what a save writes (a weights file holds the optimizer's variables too)."""
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    return variables_bytes(variables) + 4096 * len(variables)


# What write_atomically names its temporary files: ".<stem>.<mkstemp's 8 characters>.tmp<suffix>".
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp(\.weights\.h5|\.[A-Za-z0-9]+)?$")


def remove_stale_temporaries(folder: str) -> list[Path]:
    """Removes the temporary files saves into `folder` left behind when they were killed (a save of this job's
    cannot be running yet: called as fit starts, on the worker that saves); returns what it removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if _TEMPORARY.match(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed


def _abandon_hdf5(tmp: str) -> None:
    """After a failed write: an HDF5 file Keras left open on `tmp` would retry its buffered writes when it is
    collected -- at interpreter exit, where a failing write (a full disk) crashes the process (signal 11). Its
    descriptor is pointed at /dev/null, so those writes succeed into nothing, and the file is closed now."""
    h5py = sys.modules.get("h5py")
    if h5py is None:
        return
    for fid in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
        try:
            if os.fsdecode(fid.name) != tmp:
                continue
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fid.get_vfd_handle())
            finally:
                os.close(null)
            fid.close()
        except Exception:
            continue


def save(model: Any, filepath: Any, overwrite: bool = True, zipped: Any = None, **kwargs: Any) -> Any:
    save = original(model, "save")
    path = _atomic_path(filepath, (".keras",))
    if path is None or zipped is False or (not overwrite and path.exists()):
        return save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
    write_atomically(path, lambda tmp: save(tmp, overwrite=True, zipped=zipped, **kwargs), state_bytes(model))
    return None


def save_weights(model: Any, filepath: Any, overwrite: bool = True, max_shard_size: Any = None) -> Any:
    save_weights = original(model, "save_weights")
    path = _atomic_path(filepath, (".weights.h5",))
    if path is None or max_shard_size is not None or (not overwrite and path.exists()):
        return save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)
    write_atomically(path, lambda tmp: save_weights(tmp, overwrite=True), state_bytes(model))
    return None


def export(model: Any, parallel: Any, chief: bool, filepath: Any, **kwargs: Any) -> None:
    """``RDMAStrategy.export``: collective; the chief saves `model` with its optimizer's state whole."""
    with parallel.whole_weights(model):
        whole = parallel.whole_optimizer_state(model)
        if not chief:
            return
        with contextlib.nullcontext() if whole is None else parallel.optimizer_saved_as(model, whole):
            model.save(filepath, **kwargs)
