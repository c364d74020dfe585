"""Model (pipeline) parallelism's pipeline: place layers, find cut edges (the planner), build each worker's stage
and its channels, and run a step (the schedule); the automatic cut is :mod:`.cut`."""

from rdkeras.pipeline.planner import READER, Edge, Plan, analyze, assign_layers
from rdkeras.pipeline.rewriter import Stage, build_stage, deferrable

__all__ = ["READER", "Edge", "Plan", "Stage", "analyze", "assign_layers", "build_stage", "deferrable"]
