"""Allgathers and reduce-scatters of any size in calls of a bounded size: the rings stay N times the bound however
large a layer is."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rdkeras.parallel.collectives.core import Collectives

CALL_BYTES = 1 << 20  # the most of each worker's shard one gather or reduce-scatter call moves


def allgather_in_calls(
    collectives: Collectives, shard: np.ndarray | Sequence[np.ndarray], purpose: str, limit: int = CALL_BYTES
) -> np.ndarray:
    """:meth:`Collectives.allgather` of `shard` -- whole, or its consecutive parts, read where they lie: a unit's
    pieces need no concatenated copy -- in calls of at most `limit` bytes of it (a fresh array): the ring stays N
    times `limit` however large a layer is."""
    parts = _parts(shard)
    n, itemsize = collectives.size, parts[0].itemsize
    per = sum(p.size for p in parts)
    step = max(64, limit) // itemsize // 16 * 16  # (whole 64-byte lines)
    whole = np.empty((n, per), parts[0].dtype)
    for lo in range(0, per, step):
        hi = min(per, lo + step)
        views = _views(parts, lo, hi)
        chunk = views[0] if len(views) == 1 else np.concatenate(views)
        whole[:, lo:hi] = np.reshape(collectives.allgather(chunk, purpose=purpose), (n, hi - lo))
    return whole.reshape(-1)


def reduce_scatter_in_calls(
    collectives: Collectives, flat: np.ndarray | Sequence[np.ndarray], purpose: str, limit: int = CALL_BYTES
) -> np.ndarray:
    """:meth:`Collectives.reduce_scatter` (the mean) of `flat` -- whole, or its consecutive parts, read where they
    lie: a layer's gradients need no concatenated copy -- in calls of at most `limit` bytes of each shard."""
    parts = _parts(flat)
    n, itemsize = collectives.size, parts[0].itemsize
    per = sum(p.size for p in parts) // n
    step = max(64, limit) // itemsize // 16 * 16
    mine = np.empty(per, parts[0].dtype)
    for lo in range(0, per, step):
        hi = min(per, lo + step)
        columns = [view for r in range(n) for view in _views(parts, r * per + lo, r * per + hi)]
        mine[lo:hi] = collectives.reduce_scatter(columns, average=True, purpose=purpose)
    return mine


def _parts(flat: np.ndarray | Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.reshape(p, -1) for p in ([flat] if isinstance(flat, np.ndarray) else flat)]


def _views(parts: Sequence[np.ndarray], lo: int, hi: int) -> list[np.ndarray]:
    """Elements [lo, hi) of the concatenation of `parts`, as views of them."""
    views, start = [], 0
    for p in parts:
        end = start + p.size
        if p.size and start < hi and lo < end:
            views.append(p[max(lo, start) - start : min(hi, end) - start])
        start = end
    return views
