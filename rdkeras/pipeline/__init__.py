"""Model (pipeline) parallelism's pipeline: the planner (:mod:`.planner`, with the placement rules,
:mod:`.placement`, and the automatic cut, :mod:`.cut`) makes a frozen :class:`PipelinePlan` (:mod:`.plan`); each
worker builds its stage of it (:mod:`.rewriter`) and its channels (:mod:`.stages`), and the schedule
(:mod:`.schedule`) runs a step over micro-batches (:mod:`.feeds`: its data; :mod:`.passes`: a stage's compute;
:mod:`.deferred`: the weight gradients that wait for the step's end)."""

from rdkeras.pipeline.deferred import deferrable
from rdkeras.pipeline.placement import assign_layers
from rdkeras.pipeline.plan import READER, Edge, PipelinePlan
from rdkeras.pipeline.planner import analyze, make_plan
from rdkeras.pipeline.rewriter import Stage, build_stage

__all__ = ["READER", "Edge", "PipelinePlan", "Stage", "analyze", "assign_layers", "build_stage", "deferrable",
           "make_plan"]  # fmt: skip
