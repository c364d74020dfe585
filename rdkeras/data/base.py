"""What a data loader returns."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdkeras import options


class DataError(RuntimeError):
    """Data cannot be found or read; the message says how to get it."""


@dataclass
class Data:
    """Arrays for ``model.fit`` and, where the data set has one, a held-out set for validation.

    Attributes:
        x: Training inputs.
        y: Training targets (class ids; for language models the next token at every position).
        validation: ``(x, y)`` evaluated after every epoch (a real data set's test split), or None.
        description: One line for the log: what the data is and where it came from.
        info: Facts a recipe reports, e.g. the vocabulary size.
    """

    x: np.ndarray
    y: np.ndarray
    validation: tuple[np.ndarray, np.ndarray] | None = None
    description: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def cache_dir() -> str:
    """Where fetched package files are kept: ``RDKERAS_CACHE`` or ``~/.cache/rdkeras``."""
    path = str(options.from_env().cache_dir)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """One process at a time (the workers of a job start together and may all want to fetch)."""
    with open(os.path.join(cache_dir(), f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
