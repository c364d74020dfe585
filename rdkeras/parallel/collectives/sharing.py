"""Keras variables shared among the members: an owner's values, or rank 0's for variables created alike."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras.parallel.collectives.core import CHUNK_BYTES, KEPT_BYTES, LARGE_PURPOSE, Collectives


def share_variables(collectives: Collectives, variables: Sequence[Any], owners: Sequence[int]) -> None:
    """Assigns each Keras variable its owner's value on every member (collective)."""
    if collectives.size == 1 or not variables:
        return
    # Variables in groups of at most a chunk, each assigned before the next is read: the copies in flight stay
    # that size, not the whole model's twice over (the groups depend on shapes only: alike on every member).
    sizes = [int(np.prod(v.shape)) * np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)).itemsize for v in variables]
    groups: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if groups[-1] and held + size > CHUNK_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    large = sum(sizes) > KEPT_BYTES
    for group in groups:
        values = collectives.from_owners([np.asarray(variables[j].numpy()) for j in group],
                                         [owners[j] for j in group], LARGE_PURPOSE if large else None)  # fmt: skip
        for j, value in zip(group, values, strict=True):
            variables[j].assign(value)
    if large:
        collectives.release(LARGE_PURPOSE)


def share_new_variables(collectives: Collectives, variables: Sequence[Any], where: str) -> None:
    """Gives every member rank 0's values of variables each member created alike (collective); raises on
    every member if they created different ones (count, shapes or dtypes)."""
    if collectives.size == 1:
        return
    described = ";".join(f"{tuple(v.shape)}:{v.dtype.name}" for v in variables)
    mine = np.array([len(variables), zlib.crc32(described.encode())], np.float64)
    (reference,) = collectives.broadcast([mine], root=0)
    (differ,) = collectives.allreduce([np.array([float((mine != reference).any())])], average=False, purpose="sync")
    if differ[0]:
        raise ValueError(
            f"the workers created different variables {where} ({len(variables)} here; {int(differ[0])} worker(s) "
            "differ from rank 0): create the same models, optimizers and metrics on every worker"
        )
    share_variables(collectives, variables, [0] * len(variables))
