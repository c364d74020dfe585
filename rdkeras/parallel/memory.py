"""What malloc keeps of a worker's memory, given back.

glibc's malloc keeps what is freed in its free lists, resident, unless it lies at the top of the heap: tracing a
step of a 168 M-parameter model left 200 MB there on each worker, through every step after. (TensorFlow's own CPU
allocator with oneDNN, its default on x86 Linux, never gives a page back at all: a worker's resident memory is the
high-water mark of both.)
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any


def trim_free_lists() -> bool:
    """Gives the free pages in malloc's free lists back to the system (glibc's ``malloc_trim``); False where there
    is no such call, or nothing was given back."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
