"""The graph rewriter: one worker's stage of a placed model, as its own Keras model.

A stage's model takes, in order, the model inputs this worker reads itself and
the tensors it receives (each one the destination of a cut edge: an RDMARecv),
and returns the tensors it sends (sources of cut edges: RDMASend) and the model
outputs it computes. It shares its layers -- and so its weights -- with the
user's model: nothing is copied, and training the stage trains the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rdkeras.keras_internals import functional_of, nodes_in_order, producer_of
from rdkeras.pipeline.cut.split import weights_layer
from rdkeras.pipeline.plan import READER, Edge, PipelinePlan


@dataclass
class Feed:
    """Where one stage-model input comes from: the reader's own data, or a received edge."""

    input_index: int | None  # position among the model's (flattened) inputs, for local data
    edge: Edge | None


@dataclass
class Stage:
    index: int
    plan: PipelinePlan
    model: Any  # keras.Model over this worker's layers (None if it only relays data)
    feeds: list[Feed]
    sends: list[list[Edge]]  # per stage-model output: the edges that carry it (may be empty)
    outputs: list[tuple[str, Any]]  # per model output (on the loss stage): ("local", position) | ("edge", Edge)
    data_edges: list[tuple[int, Edge]]  # reader only: (input position, edge) for inputs others consume
    label_edges: list[Edge]  # labels / sample weights, reader -> loss stage
    # Training with weight gradients once a step (plan.deferred): those Dense layers; `model` with their inputs
    # and outputs among its outputs (None: none deferred); where each one's input and output is, in order.
    deferred: list[Any] = field(default_factory=list)
    tapped_model: Any = None
    taps: list[tuple[str, int]] = field(default_factory=list)

    @property
    def is_reader(self) -> bool:
        return self.index == READER

    @property
    def is_loss(self) -> bool:
        return self.index == self.plan.loss_stage

    @property
    def received(self) -> list[Edge]:
        """Edges this stage receives each step, in plan order."""
        return [e for e in self.plan.edges if e.dst == self.index]

    @property
    def trainable_variables(self) -> list[Any]:
        return list(self.model.trainable_variables) if self.model is not None else []


def build_stage(model: Any, plan: PipelinePlan, index: int) -> Stage:
    """The stage of `plan` that worker `index` runs."""
    import keras

    graph = functional_of(model)
    inputs = list(graph.inputs)
    input_pos = {id(t): i for i, t in enumerate(inputs)}
    mine = set(plan.layers_of(index))

    feeds: list[Feed] = []
    feed_tensors: list[Any] = []
    received_by_tensor = {id(e.tensor): e for e in plan.edges if e.dst == index and e.kind in ("activation", "input")}
    seen: set[int] = set()
    for node in nodes_in_order(graph):
        if node.is_input or node.operation.name not in mine:
            continue
        for t in node.input_tensors:
            if id(t) in seen:
                continue
            if id(t) in received_by_tensor:
                feeds.append(Feed(None, received_by_tensor[id(t)]))
            elif id(t) in input_pos and index == READER:
                feeds.append(Feed(input_pos[id(t)], None))
            else:
                continue  # produced by this stage
            seen.add(id(t))
            feed_tensors.append(t)

    # Tensors this stage computes that leave it: cut edges out, and model outputs.
    out_tensors: list[Any] = []
    sends: list[list[Edge]] = []

    def output_position(t: Any) -> int:
        for i, u in enumerate(out_tensors):
            if u is t:
                return i
        out_tensors.append(t)
        sends.append([])
        return len(out_tensors) - 1

    for e in plan.edges:
        if e.src == index and e.kind in ("activation", "output"):
            sends[output_position(e.tensor)].append(e)
    outputs: list[tuple[str, Any]] = []
    for i, t in enumerate(graph.outputs):
        producer = plan.layer_stage.get(producer_of(t)[0].name)
        if producer == index:
            pos = output_position(t)
            if index == plan.loss_stage:
                outputs.append(("local", pos))
        elif index == plan.loss_stage:
            edge = next((e for e in plan.edges if e.tensor is t and e.dst == index), None)
            if edge is None:
                raise ValueError(f"model output {i} of {model.name!r} has no way to the loss stage {index}")
            outputs.append(("edge", edge))

    stage_model = tapped = None
    tapped_layers = [graph.get_layer(name) for name in plan.deferred.get(index, [])] if out_tensors else []
    deferred = [weights_layer(layer) for layer in tapped_layers]
    taps: list[tuple[str, int]] = []
    if out_tensors and deferred:
        # Each deferred layer's input and output, as ("in", position among the stage model's inputs) or
        # ("out", position among the tapped model's outputs): a tensor is named once (Keras's Functional
        # cannot clone a graph whose outputs repeat a tensor or name an input).
        nodes = {id(n.operation): n for n in nodes_in_order(graph)}
        tapped_outputs = list(out_tensors)
        for layer in tapped_layers:
            for t in (nodes[id(layer)].input_tensors[0], nodes[id(layer)].output_tensors[0]):
                at = next((i for i, u in enumerate(feed_tensors) if u is t), None)
                if at is not None:
                    taps.append(("in", at))
                    continue
                at = next((i for i, u in enumerate(tapped_outputs) if u is t), None)
                if at is None:
                    at = len(tapped_outputs)
                    tapped_outputs.append(t)
                taps.append(("out", at))
        tapped = keras.Model(feed_tensors, tapped_outputs, name=f"{model.name}_stage{index}_tapped")
        # The same graph without the taps (Keras gave it inputs of its own: a second model from the
        # user's tensors would clone them again).
        stage_model = keras.Model(tapped.inputs, tapped.outputs[: len(out_tensors)], name=f"{model.name}_stage{index}")
    elif out_tensors:
        stage_model = keras.Model(feed_tensors, out_tensors, name=f"{model.name}_stage{index}")
    data_edges = []
    if index == READER:
        for e in plan.edges:
            if e.kind == "input":
                data_edges.append((input_pos[id(e.tensor)], e))
    label_edges = [e for e in plan.edges if e.kind in ("labels", "sample_weight") and index in (e.src, e.dst)]
    return Stage(index, plan, stage_model, feeds, sends, outputs, data_edges, label_edges, deferred, tapped, taps)
