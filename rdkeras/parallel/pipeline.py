"""One pipeline plan made real on this worker: its stage of the model and its channels.

A plan (:mod:`rdkeras.graph`) depends on the batch's rows, the micro-batches and
the labels' shapes, so model parallelism keeps one :class:`Pipeline` per plan and
makes one current for each of train, eval and predict; the schedule
(:mod:`rdkeras.parallel.schedule`) runs a step of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdkeras.channels import DynamicChannel, StaticChannel
from rdkeras.engine import Engine
from rdkeras.graph import Plan, build_stage


class Pipeline:
    """A plan's stage on this worker and one channel per cut edge, micro-batch and direction.

    Args:
        engine: The job's engine.
        model: The user's whole model (every worker builds it; this one trains `stage`).
        plan: The plan (batch rows, micro-batches, cut edges).
        stage: This worker's stage index.
        replica: This worker's pipeline replica (hybrid parallelism; 0 for one pipeline).
        rank_of: This replica's worker running a stage.
        serial: A number no other Pipeline of this strategy has (it keeps the channels' names apart).
    """

    def __init__(
        self,
        engine: Engine,
        model: Any,
        plan: Plan,
        stage: int,
        replica: int,
        rank_of: Callable[[int], int],
        serial: int,
    ):
        self.engine, self.plan, self.serial = engine, plan, serial
        self.stage = build_stage(model, plan, stage)
        self.replica, self.rank_of = replica, rank_of
        # (edge name, micro-batch) -> this worker's end of the channel carrying it forward / its gradient back.
        self.fwd: dict[tuple[str, int], StaticChannel | DynamicChannel] = {}
        self.bwd: dict[tuple[str, int], StaticChannel | DynamicChannel] = {}
        self.predict_out: dict[int, DynamicChannel] = {}  # loss stage -> stage s: predictions
        me = engine.rank
        # Every worker creates its channels in plan order: each creation waits for the
        # peer's, and one global order cannot deadlock.
        for e in plan.edges:
            src, dst = rank_of(e.src), rank_of(e.dst)
            if me not in (src, dst):
                continue
            for m in range(e.transfers):
                base = f"mp{serial}/replica{replica}/{e.name}/{m}"
                self.fwd[(e.name, m)] = self._channel(f"{base}/fwd", src, dst, e.shape, e.dtype, e.static)
                if e.needs_grad:
                    self.bwd[(e.name, m)] = self._channel(f"{base}/bwd", dst, src, e.shape, e.dtype, e.static)

    def ensure_predict_channels(self, stages: int) -> None:
        """Loss worker -> every other stage of its replica: predictions (every worker returns them)."""
        if self.predict_out or stages == 1:
            return
        loss, mine = self.plan.loss_stage, self.stage.index
        for s in range(stages):
            if s != loss and mine in (s, loss):
                name = f"mp{self.serial}/replica{self.replica}/predict->{s}"
                self.predict_out[s] = self.engine.dynamic_channel(name, self.rank_of(loss), self.rank_of(s))

    def _channel(
        self, name: str, src: int, dst: int, shape: tuple, dtype: str, static: bool
    ) -> StaticChannel | DynamicChannel:
        if static:
            return self.engine.static_channel(name, src, dst, shape, dtype)
        return self.engine.dynamic_channel(name, src, dst)
