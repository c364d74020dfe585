"""Saving under the strategy: a model file is written whole or not at all.

``model.save(...)`` and ``model.save_weights(...)`` of a distributed model write a
temporary file beside the target and rename it over the target, so a worker killed
in the middle of a save leaves the previous file intact (Keras writes in place).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rdkeras.keras_internals import original


def _atomic_path(filepath: Any, suffixes: tuple[str, ...]) -> Path | None:
    """`filepath` as a local Path when Keras writes it as one file with one of `suffixes`."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    text = os.fspath(filepath)
    if "://" in text or not text.endswith(suffixes):
        return None
    return Path(text)


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` for a temporary path beside `path` (same suffix), then renames it over
    `path`: readers see the old file or the new one, never a part."""
    suffix = ".weights.h5" if path.name.endswith(".weights.h5") else path.suffix
    stem = path.name[: -len(suffix)] if suffix else path.name
    path.parent.mkdir(parents=True, exist_ok=True)
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
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save(model: Any, filepath: Any, overwrite: bool = True, zipped: Any = None, **kwargs: Any) -> Any:
    save = original(model, "save")
    path = _atomic_path(filepath, (".keras",))
    if path is None or zipped is False or (not overwrite and path.exists()):
        return save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
    write_atomically(path, lambda tmp: save(tmp, overwrite=True, zipped=zipped, **kwargs))
    return None


def save_weights(model: Any, filepath: Any, overwrite: bool = True, max_shard_size: Any = None) -> Any:
    save_weights = original(model, "save_weights")
    path = _atomic_path(filepath, (".weights.h5",))
    if path is None or max_shard_size is not None or (not overwrite and path.exists()):
        return save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)
    write_atomically(path, lambda tmp: save_weights(tmp, overwrite=True))
    return None
