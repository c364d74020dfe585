"""Replicas that agree: non-trainable float state averaged over them, everything else checked bit for bit.

Data-parallel replicas must hold the same training state. Two things break that without an error:
state each replica updates from its own batches (BatchNormalization's moving mean and variance: here
the mean over replicas, as tf.distribute reads it), and variables something else updates per worker
(the optimizers a custom ``train_step`` keeps, a callback on one worker). :func:`agree` runs at every
epoch end and on ``strategy.check_replicas()``: one checksum per variable, compared with rank 0's; the
non-trainable float ones that differ are averaged, any other difference fails on every worker naming
the first variable, so a divergence is found within an epoch, not after a week.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rdkeras.errors import ReplicasDivergedError
from rdkeras.parallel.collectives import Collectives


def checksums(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One CRC-32 of each array's bytes, as float64 (exact: below 2^53), to compare across workers."""
    return np.array([zlib.crc32(np.ascontiguousarray(a).tobytes()) for a in arrays], np.float64)


def agree(collectives: Collectives, variables: Sequence[Any], averaged: Sequence[bool], when: str) -> int:
    """Makes the replicas' `variables` agree (collective): those marked `averaged` that differ get the mean
    over replicas; any other that differs raises ReplicasDivergedError on every worker, naming it.
    Returns how many variables were averaged."""
    if collectives.size == 1 or not variables:
        return 0
    values = [np.asarray(v.numpy()) for v in variables]
    mine = checksums(values)
    (reference,) = collectives.broadcast([mine], root=0)
    (differ,) = collectives.allreduce([(mine != reference).astype(np.float64)], average=False, purpose="sync")
    differing = [int(i) for i in np.flatnonzero(differ)]
    wrong = [i for i in differing if not averaged[i]]
    if wrong:
        first = variables[wrong[0]]
        raise ReplicasDivergedError(
            f"data-parallel replicas diverged {when}: {_name(first)} differs between workers ({int(differ[wrong[0]])} "
            f"of {collectives.size - 1} differ from rank 0; {len(wrong)} variable(s) in all, the first named). "
            "Something updated it differently per worker: trainable flags changed or the model was recompiled on "
            "some workers only, an optimizer other than the model's compiled one (a custom train_step's own "
            "optimizers), a callback or custom code acting on some workers only"
        )
    fix = [i for i in differing if averaged[i]]
    if fix:
        wire = [values[i].astype(np.float64) for i in fix]  # exact for float16/32 sums of a few replicas
        for i, mean in zip(fix, collectives.allreduce(wire, average=True, purpose="sync"), strict=True):
            variables[i].assign(mean.astype(values[i].dtype))
    return len(fix)


def averaged_on_disagreement(variables: Sequence[Any], non_trainable: Sequence[Any]) -> list[bool]:
    """Which of `variables` replicas may hold apart between epoch ends: the model's non-trainable float ones
    (BatchNormalization's statistics and the like), not its weights or its optimizer's state."""
    own = {id(v) for v in non_trainable}
    return [id(v) in own and str(v.dtype).startswith(("float", "bfloat")) for v in variables]


def _name(variable: Any) -> str:
    return repr(getattr(variable, "path", None) or getattr(variable, "name", "a variable"))
