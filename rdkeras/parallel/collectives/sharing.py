"""Keras variables shared among the members: an owner's values, or rank 0's for variables created alike."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras.parallel.collectives.core import Collectives


def share_variables(collectives: Collectives, variables: Sequence[Any], owners: Sequence[int]) -> None:
    """Assigns each Keras variable its owner's value on every member (collective)."""
    if collectives.size == 1 or not variables:
        return
    values = collectives.from_owners([np.asarray(v.numpy()) for v in variables], owners)
    for v, value in zip(variables, values, strict=True):
        v.assign(value)


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
