"""One pipeline plan made real on this worker: its stage of the model and its channels.

A plan (:mod:`rdkeras.pipeline`) depends on the batch's rows, the micro-batches and
the labels' shapes, so model parallelism keeps one :class:`Pipeline` per plan and
makes one current for each of train, eval and predict; the schedule
(:mod:`rdkeras.pipeline.schedule`) runs a step of it. Where the automatic cut
alternates a layer between two stages (:mod:`rdkeras.pipeline.cut.partition`), the
micro-batches follow two (or more) plans, and a Pipeline holds this worker's
stage of each: they share the layers, so they share the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdkeras.channels import DynamicChannel, StaticChannel
from rdkeras.engine import Engine
from rdkeras.keras_internals import functional_of
from rdkeras.pipeline import PipelinePlan, Stage, build_stage


class Pipeline:
    """A plan's stage on this worker and one channel per cut edge, micro-batch and direction (where micro-batches
    follow different plans, ``plan.micro_plans``, each plan's stage, and each micro-batch's edges).

    Args:
        engine: The job's engine.
        model: The user's whole model (every worker builds it; this one trains `stage`), or the split model over
            its layers (:mod:`rdkeras.pipeline.cut.split`) that `plan` places.
        plan: The plan (batch rows, micro-batches, cut edges).
        stage: This worker's stage index.
        replica: This worker's pipeline replica (hybrid parallelism; 0 for one pipeline).
        rank_of: This replica's worker running a stage.
        serial: A number no other Pipeline of this strategy has (it keeps the channels' names apart).
        pair_sum: Where layers alternate between stages: the sum between stages c and c + 1, which share one.
    """

    def __init__(
        self,
        engine: Engine,
        model: Any,
        plan: PipelinePlan,
        stage: int,
        replica: int,
        rank_of: Callable[[int], int],
        serial: int,
        pair_sum: Callable[[int], Callable[[list], list]] | None = None,
    ):
        self.engine, self.plan, self.serial = engine, plan, serial
        uses = plan.micro_plans or [plan] * plan.micro_batches  # each micro-batch's plan
        self.plans: list[PipelinePlan] = []
        for p in uses:
            if all(p is not q for q in self.plans):
                self.plans.append(p)
        self._plan_of = [next(i for i, q in enumerate(self.plans) if q is p) for p in uses]
        self.stages = [build_stage(model, p, stage) for p in self.plans]
        self.stage = self.stages[0]  # (the reader and the loss stage are the same in all)
        self.replica, self.rank_of = replica, rank_of
        # Every variable either variant trains, in order.
        self.trainable_variables: list[Any] = []
        for variant in self.stages:
            known = {id(v) for v in self.trainable_variables}
            self.trainable_variables += [v for v in variant.trainable_variables if id(v) not in known]
        # (the sum between the two stages, indices into trainable_variables) per layer it shares with a neighbour.
        self.shared: list[tuple[Callable[[list], list], list[int]]] = []
        # Both stages train it in every step, whether this plan shares it or not (one that does not split a layer
        # by rows, as a batch too small to split, leaves it to the earlier stage: the later adds zeros).
        shares = plan.partition.alternates if plan.partition is not None and pair_sum is not None else {}
        for name, (first, second) in shares.items():
            if stage not in (first, second) or pair_sum is None:
                continue
            variables = functional_of(model).get_layer(name).trainable_variables
            known = {id(v) for v in self.trainable_variables}
            self.trainable_variables += [v for v in variables if id(v) not in known]
            index = {id(v): i for i, v in enumerate(self.trainable_variables)}
            self.shared.append((pair_sum(first), [index[id(v)] for v in variables]))
        # (edge name, micro-batch) -> this worker's end of the channel carrying it forward / its gradient back.
        self.fwd: dict[tuple[str, int], StaticChannel | DynamicChannel] = {}
        self.bwd: dict[tuple[str, int], StaticChannel | DynamicChannel] = {}
        self.predict_out: dict[int, DynamicChannel] = {}  # loss stage -> stage s: predictions
        me = engine.rank
        # Every worker creates its channels in plan order: each creation waits for the
        # peer's, and one global order cannot deadlock.
        for p in self.plans:
            for e in p.edges:
                src, dst = rank_of(e.src), rank_of(e.dst)
                if me not in (src, dst):
                    continue
                # An edge once a step (labels) is every plan's; one per micro-batch, only where it follows p.
                for m in range(e.transfers):
                    if (e.name, m) in self.fwd or (e.transfers > 1 and uses[m] is not p):
                        continue
                    base = f"mp{serial}/replica{replica}/{e.name}/{m}"
                    self.fwd[(e.name, m)] = self._channel(f"{base}/fwd", src, dst, e.shape, e.dtype, e.static)
                    if e.needs_grad:
                        self.bwd[(e.name, m)] = self._channel(f"{base}/bwd", dst, src, e.shape, e.dtype, e.static)

    def stage_for(self, m: int) -> Stage:
        """This worker's stage for micro-batch m."""
        return self.stages[self._plan_of[m]] if m < len(self._plan_of) else self.stage

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
