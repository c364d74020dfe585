"""What malloc keeps of a worker's memory, given back (rdkeras/parallel/memory.py)."""

from __future__ import annotations

import ctypes

import pytest

from rdkeras.parallel.memory import trim_free_lists


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_trimming_gives_malloc_free_lists_back():
    # 64 MiB in blocks under malloc's mmap threshold, touched, then freed below the last, still in use: glibc keeps
    # them resident in its free lists until trimmed.
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)
    before = _resident_mb()
    assert trim_free_lists()
    after = _resident_mb()
    libc.free(blocks[-1])
    assert before - after > 48, f"{before:.0f} MB resident before, {after:.0f} MB after"
