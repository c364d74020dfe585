"""Collectives over the engine's ring allreduce: gradient averaging, state sharing, row gathering.

Everything here is collective: every member calls it in the same order with
equally shaped arguments (the ring checks nothing the caller can get wrong
silently only because all workers run the same program).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras.engine import Engine

_FLOAT_KINDS = ("float32", "float64")


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    """The ring's dtype for `dtype`: float32/float64 as they are, narrower floats as float32, and
    integers and booleans as float64 (exact below 2**53)."""
    dtype = np.dtype(dtype)
    if dtype.name in _FLOAT_KINDS:
        return dtype
    return np.dtype(np.float32) if dtype.kind == "f" or dtype.name == "bfloat16" else np.dtype(np.float64)


class Collectives:
    """Allreduce helpers over the engine, created lazily and identically on every member.

    Args:
        engine: The job's engine.
        bucket_bytes: Bytes the ring moves per pass.
        members: The ranks taking part, in ring order (default: all).
        name: A prefix keeping this instance's rings apart from another's.
    """

    def __init__(self, engine: Engine, bucket_bytes: int, members: list[int] | None = None, name: str = ""):
        self.engine, self.bucket_bytes, self.name = engine, bucket_bytes, name
        self.members = list(range(engine.world_size)) if members is None else list(members)
        self._rings: dict[tuple[str, str], tuple[Any, int]] = {}
        self._serial = itertools.count()

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def position(self) -> int:
        return self.members.index(self.engine.rank)

    def _ring(self, purpose: str, dtype: str, nbytes: int) -> Any:
        ring, capacity = self._rings.get((purpose, dtype), (None, 0))
        needed = nbytes + 64 * 1024  # 64-byte padding per tensor, generously
        if ring is None or needed > capacity:
            capacity = max(needed, 2 * capacity, 1 << 20)
            ring = self.engine.ring(
                f"{self.name}{purpose}/{dtype}/{next(self._serial)}", capacity, self.bucket_bytes, self.members
            )
            self._rings[(purpose, dtype)] = (ring, capacity)
        return ring

    def allreduce(self, arrays: Sequence[np.ndarray], average: bool, purpose: str = "grads") -> list[np.ndarray]:
        """Sums (averages) same-shaped lists of float arrays across members; one ring call per dtype.

        The results are views of registered memory, valid until the next-but-one call for this purpose.
        """
        out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(np.dtype(a.dtype).name, []).append(i)
        for dtype, idx in sorted(groups.items()):
            if dtype not in _FLOAT_KINDS:
                raise TypeError(f"cannot allreduce {dtype} tensors (float32/float64 only)")
            group = [np.ascontiguousarray(arrays[i]) for i in idx]
            ring = self._ring(purpose, dtype, sum(a.nbytes + 64 for a in group))
            for i, r in zip(idx, ring(group, average), strict=True):
                out[i] = r
        return out

    def from_owners(self, arrays: Sequence[np.ndarray], owners: Sequence[int]) -> list[np.ndarray]:
        """Every member gets each array from its owner (a rank): an exact sum in which only the owner
        contributes (the others add zeros). Any dtype; returns fresh arrays."""
        me = self.engine.rank
        if self.size == 1 or not arrays:
            return [np.array(a, copy=True) for a in arrays]
        wire = [
            (np.asarray(a).astype(_wire_dtype(a.dtype)) if o == me else np.zeros(np.shape(a), _wire_dtype(a.dtype)))
            for a, o in zip(arrays, owners, strict=True)
        ]
        summed = self.allreduce(wire, average=False, purpose="sync")
        return [s.reshape(np.shape(a)).astype(np.asarray(a).dtype) for s, a in zip(summed, arrays, strict=True)]

    def broadcast(self, arrays: Sequence[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """Every member gets `root`'s arrays."""
        return self.from_owners(arrays, [root] * len(arrays))

    def mean(self, values: Sequence[float]) -> list[float]:
        """The average of each value over the members."""
        if self.size == 1 or not values:
            return list(values)
        (out,) = self.allreduce([np.asarray(values, np.float64)], average=True, purpose="sync")
        return [float(v) for v in out]

    def gather_rows(self, array: np.ndarray) -> np.ndarray:
        """The members' arrays concatenated along the first axis, in member order (rows may differ)."""
        if self.size == 1:
            return array
        n, at = self.size, self.position
        counts = np.zeros(n, np.float64)
        counts[at] = len(array)
        (counts,) = self.allreduce([counts], average=False, purpose="rows")
        sizes = counts.astype(np.int64)
        wire = _wire_dtype(array.dtype)
        full = np.zeros((int(sizes.sum()), *array.shape[1:]), wire)
        start = int(sizes[:at].sum())
        full[start : start + len(array)] = array
        (summed,) = self.allreduce([full], average=False, purpose="rows")
        return summed.astype(array.dtype)


def share_variables(collectives: Collectives, variables: Sequence[Any], owners: Sequence[int]) -> None:
    """Assigns each Keras variable its owner's value on every member (collective)."""
    if collectives.size == 1 or not variables:
        return
    values = collectives.from_owners([np.asarray(v.numpy()) for v in variables], owners)
    for v, value in zip(variables, values, strict=True):
        v.assign(value)


class GradientAllreduce:
    """Averages (or sums) a list of tensors across members inside a compiled function.

    ``None`` entries pass through; IndexedSlices (embeddings) are made dense;
    tensors of other dtypes travel as float32 and come back in their own dtype.
    """

    def __init__(self, collectives: Collectives, average: bool = True):
        self.collectives, self.average = collectives, average

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        import tensorflow as tf

        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx or self.collectives.size == 1:
            return list(grads)
        dense = [tf.convert_to_tensor(grads[i]) for i in idx]
        wire = [g if g.dtype.name in _FLOAT_KINDS else tf.cast(g, tf.float32) for g in dense]
        reduced = tf.numpy_function(
            self._reduce, wire, Tout=[g.dtype for g in wire], stateful=True, name="rdkeras_allreduce"
        )
        out = list(grads)
        for i, g, r in zip(idx, dense, reduced, strict=True):
            r.set_shape(g.shape)
            out[i] = r if r.dtype == g.dtype else tf.cast(r, g.dtype)
        return out

    def _reduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        # The inputs are views of TensorFlow's buffers; the outputs are 64-byte
        # aligned views of registered memory, which TensorFlow aliases.
        reduced = self.collectives.allreduce(list(arrays), average=self.average)
        return [r.reshape(a.shape) for r, a in zip(reduced, arrays, strict=True)]  # views (0-d stays 0-d)
