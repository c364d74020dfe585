"""The automatic cut of one model: its layers timed (:mod:`.timing`), the cut balanced over them
(:func:`.partition.balanced_cut`), and where a layer may be shared by two stages, the cut sharing it tried against
the cut between layers, both timed stage by stage as whole sub-models."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdkeras.pipeline.cut import split, timing
from rdkeras.pipeline.cut.partition import ALTERNATION_GAIN, Partition, balanced_cut

if TYPE_CHECKING:
    from rdkeras.parallel.options import PipelineOptions

# measure(model, what, count, seconds): `seconds()` (a list of `count`) as every worker is to take it (rank 0's).
Measure = Callable[[Any, str, int, Callable[[], list[float]]], list[float]]


class AutoCut:
    """Cuts a model into `stages` stages balanced by its layers' measured costs, as `options` allow (micro-batches,
    layers alternating or split by rows, weight gradients once a step); a transfer is priced at `per_byte`
    seconds. `measure` takes each timing as every worker is to (rank 0's: every worker chooses the same cut)."""

    def __init__(self, options: PipelineOptions, stages: int, per_byte: float, measure: Measure):
        self.options, self.stages, self.per_byte, self._measure = options, stages, per_byte, measure
        self.rows = 0  # the batch the latest cut's layers were timed on
        self._split_models: dict[tuple, Any] = {}  # split_layers -> the split model

    def cut(self, model: Any, rows: int | None = None) -> Partition:
        """The cost-balanced cut of `model`, its layers timed on batches of `rows` (default: the dry run's).
        Every worker times the layers (the same dry run everywhere, so nothing it creates differs between
        workers) and all take rank 0's times, so they choose the same cut. With `alternate_layers` and
        micro-batches, where a layer could alternate between stages (with `split_layers`, be split by rows), the
        cut is then timed stage by stage as whole sub-models, and so is the best cut sharing a layer that the
        layers' times (scaled to their stages') predict: the faster by ``ALTERNATION_GAIN`` is kept."""
        rows = rows or timing.DRY_RUN_ROWS
        self.rows = rows
        names, cut_bytes, _ = timing.layer_order(model, rows)
        seconds = self._measure(model, "the layers", len(names), lambda: timing.measure(model, rows).seconds)
        per_byte, micro, stages = self.per_byte, self.options.micro_batches, self.stages
        try:
            cut = balanced_cut(names, seconds, cut_bytes, stages, per_byte)
            alternable = timing.alternable(model, names)
            if self.options.split_layers:
                splittable = split.splittable(model, names)  # (alternable ones only)
                alternable = [a if ok else None for a, ok in zip(alternable, splittable, strict=True)]
            elif not self.options.alternate_layers or micro % 2:
                alternable = [None] * len(names)
            if stages == 1 or all(a is None for a in alternable):
                return dataclasses.replace(cut, rows=rows)
            whole = self._stage_seconds(model, cut, rows)
            scale = [w / c if c > 0 else 1.0 for w, c in zip(whole, cut.compute, strict=True)]
            stage = [s for s in range(stages) for _ in range(cut.bounds[s], cut.bounds[s + 1])]
            scaled = [t * scale[stage[i]] for i, t in enumerate(seconds)]
            split_rows = rows if self.options.split_layers else 0
            mixed = balanced_cut(names, scaled, cut_bytes, stages, per_byte, alternable, micro, 0.0, split_rows)
            if not mixed.alternates:
                return dataclasses.replace(cut, compute=tuple(whole), rows=rows)
            measured = self._stage_seconds(model, mixed, rows)
            slowest = max(w + t for w, t in zip(whole, cut.transfer, strict=True))
            sharing = max(m + t for m, t in zip(measured, mixed.transfer, strict=True))
            how = "split by rows" if mixed.splits else "alternating"
            trial = (
                f"{', '.join(mixed.alternates)} {how} measured {' | '.join(f'{m * 1e3:.3f}' for m in measured)} ms "
                f"against {' | '.join(f'{w * 1e3:.3f}' for w in whole)} ms between layers"
            )
            if sharing < slowest * (1 - ALTERNATION_GAIN):
                return dataclasses.replace(mixed, compute=tuple(measured), rows=rows, trial=trial + ": kept")
            return dataclasses.replace(cut, compute=tuple(whole), rows=rows, trial=trial + ": not 5% faster")
        except ValueError as e:
            raise ValueError(f"model {model.name!r}: {e}") from None

    def _stage_seconds(self, model: Any, cut: Partition, rows: int) -> list[float]:
        """Per stage of `cut`: its whole sub-model's forward and backward per micro-batch, measured (with an
        alternating layer, each plan's for half the micro-batches; with a layer split by rows, the split
        model's); rank 0's."""
        half = max(1, self.options.micro_batches // 2)
        graph, plans = model, [cut.stage_of()]
        if cut.shares:
            plans.append(cut.stage_of(cut.moved(1)))
        elif cut.splits:
            graph, plans = self.split_model(model, cut), [cut.split_placement()]

        def measure() -> list[float]:
            defer = self.options.defer_weight_gradients
            times = [timing.stage_seconds(graph, p, self.stages, rows, half, defer=defer) for p in plans]
            return [sum(t[s] for t in times) / (half * len(plans)) for s in range(self.stages)]

        return self._measure(model, "the stages", self.stages, measure)

    def split_model(self, model: Any, cut: Partition) -> Any:
        """`model` with the layers `cut` splits by rows split (:func:`rdkeras.pipeline.cut.split.split_model`),
        made once."""
        key = tuple(sorted(cut.split_layers.items()))
        if key not in self._split_models:
            self._split_models[key] = split.split_model(model, cut.split_layers)
        return self._split_models[key]
