"""A read-only view of what a strategy runs: the bytes it moved, the state it keeps, what it decided.

For the benchmarks, tests and monitoring: everything they read of a running job, through one small surface, so
that they need none of the engine's, the parallelisms' or the seam's internals. Nothing here changes what it
reads (:meth:`Inspection.algorithm_for` is collective the first time, as the allreduce it asks about is).

    view = rdkeras.introspect.inspect(strategy)   # inspect(None): one process, undistributed
    view.traffic()["bytes_written"]               # bytes this worker wrote so far
    view.state_bytes(model)                       # StateBytes(parameters=..., gradients=..., optimizer=...)
    view.plan_text()                              # what crosses the wire each step, as Markdown
    view.algorithm_for(4 << 20)                   # "ring", "doubling" or "hierarchical"
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rdkeras.fitting.saving import kept_bytes, variables_bytes
from rdkeras.parallel.collectives import BUCKET_BYTES, EXCHANGE_LANES

if TYPE_CHECKING:
    from rdkeras.strategy import RDMAStrategy

__all__ = ["BUCKET_BYTES", "EXCHANGE_LANES", "Inspection", "StateBytes", "inspect"]

# BUCKET_BYTES: the gradient bucket with which the exchange overlaps backprop where the transport's default turns
# overlap on; EXCHANGE_LANES: the threads an overlapped step exchanges its buckets on.

# The shard modes in which each worker keeps only its 1/N of the averaged gradients.
_SHARDED_GRADIENTS = ("gradients", "parameters")


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """What training a model keeps on this worker, in bytes, counted from the variables' shapes and dtypes."""

    parameters: int  # its weights (with shard="parameters": this worker's pieces of them)
    gradients: int  # the averaged gradients the optimizer applies (with shard "gradients"/"parameters": 1/N)
    optimizer: int  # its optimizer's state (with shard: this worker's shard of it)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Inspection:
    """Reads a strategy's state (None: one process, with nothing on the wire). Make it with :func:`inspect`."""

    def __init__(self, strategy: RDMAStrategy | None):
        self._strategy = strategy

    @property
    def workers(self) -> int:
        return self._strategy.num_workers if self._strategy is not None else 1

    def traffic(self) -> dict[str, float]:
        """What this worker moved so far, a copy of the engine's counters (:meth:`rdkeras.Engine.traffic`):
        ``bytes_written``, ``bytes_read``, ``writes``, ``reads``, ``flags``, ``bytes_received``, ``wait_seconds``,
        ``exchange_seconds`` and the transport's own; empty in one process."""
        return dict(self._strategy.engine.traffic()) if self._strategy is not None else {}

    def bytes_written(self) -> float:
        """Bytes this worker wrote to its peers so far (0 in one process)."""
        return float(self.traffic().get("bytes_written", 0.0))

    def state_bytes(self, model: Any) -> StateBytes:
        """What training `model` keeps on this worker (:class:`StateBytes`)."""
        trainable = variables_bytes(model.trainable_variables)
        if self._strategy is None:
            counted = kept_bytes(model)
        else:
            counted = self._strategy.state_bytes(model)
            if self.shard in _SHARDED_GRADIENTS:
                trainable //= self.workers
        return StateBytes(counted["parameters"], trainable, counted["optimizer"])

    @property
    def shard(self) -> str:
        """What each data-parallel worker keeps only 1/N of: "none", "optimizer", "gradients" or "parameters"."""
        data = self._strategy.options.data if self._strategy is not None else None
        return data.shard if data is not None else "none"

    @property
    def plan(self) -> Any:
        """The strategy's plan (:attr:`rdkeras.RDMAStrategy.plan`: an ``ExchangePlan`` or a pipeline's ``Plan``;
        None before a model is attached, and in one process). Read it; do not change it."""
        return self._strategy.plan if self._strategy is not None else None

    def plan_text(self) -> str:
        """The plan as Markdown ('' when there is none)."""
        return self._strategy.plan_text() if self._strategy is not None else ""

    def algorithm_for(self, nbytes: int) -> str:
        """The allreduce algorithm a data-parallel exchange of `nbytes` runs: "ring", "doubling" or "hierarchical"
        (collective the first time: "auto" measures and agrees once)."""
        if self._strategy is None:
            raise ValueError("algorithm_for needs a strategy: one process exchanges nothing")
        return str(self._strategy.collectives.algorithm_for(nbytes))


def inspect(strategy: RDMAStrategy | None) -> Inspection:
    """A read-only view of `strategy` (None: one process)."""
    return Inspection(strategy)
