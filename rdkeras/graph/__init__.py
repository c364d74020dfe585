"""Graph analysis for model parallelism: place layers, find cut edges, build per-worker stages."""

from rdkeras.graph.analyzer import READER, Edge, Plan, analyze, assign_layers
from rdkeras.graph.rewriter import Stage, build_stage, deferrable

__all__ = ["READER", "Edge", "Plan", "Stage", "analyze", "assign_layers", "build_stage", "deferrable"]
