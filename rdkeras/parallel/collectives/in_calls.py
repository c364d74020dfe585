"""Allgathers and reduce-scatters of any size in calls of a bounded size: the rings stay N times the bound however
large a layer is."""

from __future__ import annotations

import numpy as np

from rdkeras.parallel.collectives.core import Collectives

CALL_BYTES = 4 << 20  # the most of each worker's shard one gather or reduce-scatter call moves


def allgather_in_calls(
    collectives: Collectives, shard: np.ndarray, purpose: str, limit: int = CALL_BYTES
) -> np.ndarray:
    """:meth:`Collectives.allgather` of `shard` in calls of at most `limit` bytes of it (a fresh array): the ring
    stays N times `limit` however large a layer is."""
    n, per = collectives.size, shard.size
    step = max(64, limit) // shard.itemsize // 16 * 16  # (whole 64-byte lines)
    if per <= step:
        return np.array(collectives.allgather(shard, purpose=purpose))
    whole = np.empty((n, per), shard.dtype)
    for lo in range(0, per, step):
        hi = min(per, lo + step)
        whole[:, lo:hi] = np.reshape(collectives.allgather(shard[lo:hi], purpose=purpose), (n, hi - lo))
    return whole.reshape(-1)


def reduce_scatter_in_calls(
    collectives: Collectives, flat: np.ndarray, purpose: str, limit: int = CALL_BYTES
) -> np.ndarray:
    """:meth:`Collectives.reduce_scatter` (the mean) of `flat` in calls of at most `limit` bytes of each shard."""
    n = collectives.size
    per = flat.size // n
    step = max(64, limit) // flat.itemsize // 16 * 16
    if per <= step:
        return np.array(collectives.reduce_scatter(flat, average=True, purpose=purpose))
    rows, mine = np.reshape(flat, (n, per)), np.empty(per, flat.dtype)
    for lo in range(0, per, step):
        hi = min(per, lo + step)
        part = np.ascontiguousarray(rows[:, lo:hi]).reshape(-1)
        mine[lo:hi] = collectives.reduce_scatter(part, average=True, purpose=purpose)
    return mine
