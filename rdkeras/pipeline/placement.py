"""Placement: which stage runs each layer, by name globs, and the order of the stages.

Rules, in the order they apply:
- a layer named exactly by a key is placed there; otherwise the first glob (in
  the placement's order) that matches its name wins;
- an unplaced layer follows the producer of its first input (stage 0, the
  reader, when it reads only model inputs);
- every pattern must match a layer, every stage must own a layer, and the
  stages must form a pipeline without cycles -- otherwise a ValueError says
  what is wrong before any process waits on another.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import numpy as np

from rdkeras.keras_internals import functional_of, nodes_in_order, producer_of
from rdkeras.pipeline.plan import READER


def assign_layers(model: Any, placement: Mapping[str, int], stages: int) -> dict[str, int]:
    """Maps every (non-input) layer of `model` to a stage; raises ValueError on a bad placement."""
    graph = functional_of(model)
    if stages < 1:
        raise ValueError(f"model parallelism needs at least one stage, got {stages}")
    if not placement:
        raise ValueError("placement is empty: map layer-name patterns to stages, e.g. {'conv*': 0, 'fc*': 1}")
    for pattern, where in placement.items():
        if not isinstance(where, (int, np.integer)) or isinstance(where, bool) or not 0 <= where < stages:
            raise ValueError(
                f"placement {pattern!r}: {where!r} is not a stage index in 0..{stages - 1} "
                f"(this job has {stages} pipeline stages)"
            )
    nodes = [n for n in nodes_in_order(graph) if not n.is_input]
    layers = []
    for n in nodes:
        if n.operation.name not in layers:
            layers.append(n.operation.name)
    unmatched = [p for p in placement if not any(fnmatch.fnmatchcase(name, p) for name in layers)]
    if unmatched:
        raise ValueError(
            f"placement pattern(s) {', '.join(repr(p) for p in unmatched)} match no layer of model "
            f"{model.name!r}; its layers are: {', '.join(layers)}"
        )
    stage: dict[str, int] = {}
    for name in layers:
        if name in placement:
            stage[name] = int(placement[name])
            continue
        for pattern, where in placement.items():
            if fnmatch.fnmatchcase(name, pattern):
                stage[name] = int(where)
                break
    for n in nodes:  # producers come first, so a follower's producer is already placed
        name = n.operation.name
        if name not in stage:
            producers = [producer_of(t)[0] for t in n.input_tensors]
            placed = [stage[p.name] for p in producers if p.name in stage]
            stage[name] = placed[0] if placed else READER
    empty = sorted(set(range(stages)) - set(stage.values()))
    if empty:
        raise ValueError(
            f"stage(s) {', '.join(map(str, empty))} would own no layer of model {model.name!r}: "
            f"every one of the {stages} stages needs at least one (placement: {dict(placement)})"
        )
    return stage


def producer_stage(tensor: Any, stage: Mapping[str, int]) -> int | None:
    op = producer_of(tensor)[0]
    return stage.get(op.name)  # None: a model input


def topological(succ: dict[int, set[int]], stage: Mapping[str, int], consumers: dict, tensors: dict) -> list[int]:
    indegree = {s: 0 for s in succ}
    for outs in succ.values():
        for d in outs:
            indegree[d] += 1
    ready = sorted(s for s, d in indegree.items() if d == 0)
    order: list[int] = []
    while ready:
        s = ready.pop(0)
        order.append(s)
        for d in sorted(succ[s]):
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append(d)
        ready.sort()
    if len(order) < len(succ):
        stuck = sorted(set(succ) - set(order))
        crossing = []
        for (tid, dst), names in consumers.items():
            src = producer_stage(tensors[tid], stage)
            if src in stuck and dst in stuck:
                op = producer_of(tensors[tid])[0]
                crossing.append(f"{op.name} (stage {src}) -> {names[0]} (stage {dst})")
        raise ValueError(
            f"placement makes a cycle between stages {', '.join(map(str, stuck))}: "
            f"{'; '.join(crossing[:4])}. A pipeline needs tensors to flow one way: "
            "move those layers so that each stage only feeds later ones"
        )
    return order
