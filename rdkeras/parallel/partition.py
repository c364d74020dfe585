"""The automatic pipeline cut: S contiguous stages of a layer order, balanced by measured cost.

Pure arithmetic (no TensorFlow): the layers ("units") in a topological order, each
with its measured forward+backward seconds, and for every position between two
units the bytes that would cross a cut there (every tensor produced before it and
consumed after it, skip connections included; ``None`` where no cut may go, e.g.
inside a layer used twice). A stage's time is its compute plus the transfers at
its two cuts; the cut minimising the slowest stage is found by a dynamic
programme over the order, as PipeDream's planner does for a chain -- O(S * L^2).
:mod:`rdkeras.graph.costs` measures the inputs for a Keras model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Seconds per byte assumed for a transfer when the caller has no measurement: about 1 GB/s.
DEFAULT_SECONDS_PER_BYTE = 1e-9


@dataclass(frozen=True)
class Partition:
    """A cut of `names` into stages: stage s runs ``names[bounds[s]:bounds[s + 1]]``."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # 0 = b_0 < b_1 < ... < b_S = len(names)
    compute: tuple[float, ...]  # per stage: seconds of forward+backward
    transfer: tuple[float, ...]  # per stage: seconds of the transfers at its cuts (in and out)
    cut_bytes: tuple[int, ...]  # per cut (S - 1): bytes crossing it each step
    rows: int = 0  # the batch the layers were timed on (0: not said)

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def cuts(self) -> tuple[int, ...]:
        """Positions cut: a cut at i falls between ``names[i - 1]`` and ``names[i]``."""
        return self.bounds[1:-1]

    @property
    def stage_costs(self) -> tuple[float, ...]:
        return tuple(c + t for c, t in zip(self.compute, self.transfer, strict=True))

    @property
    def slowest(self) -> float:
        return max(self.stage_costs)

    @property
    def speedup(self) -> float:
        """One device's time over the slowest stage's: the pipeline's bound with many micro-batches."""
        return sum(self.compute) / self.slowest if self.slowest > 0 else float(self.stages)

    def gpipe_speedup(self, micro_batches: int) -> float:
        """The bound with M micro-batches: the pipeline fills and drains, (M + S - 1) / M slowest stages."""
        m = max(1, micro_batches)
        return self.speedup * m / (m + self.stages - 1)

    def stage_of(self) -> dict[str, int]:
        """unit name -> stage: the placement this cut makes (exact names, so the analyzer runs unchanged)."""
        return {name: s for s in range(self.stages) for name in self.names[self.bounds[s] : self.bounds[s + 1]]}

    def text(self, micro_batches: int = 1) -> str:
        lines = [
            f"automatic placement: {self.stages} stages balanced by measured cost; expected speed-up "
            f"{self.speedup:.2f}x over one device with many micro-batches, "
            f"{self.gpipe_speedup(micro_batches):.2f}x with {micro_batches}"
            + (f" (layers timed on batches of {self.rows} rows)" if self.rows else "")
        ]
        for s in range(self.stages):
            first, last = self.names[self.bounds[s]], self.names[self.bounds[s + 1] - 1]
            span = first if first == last else f"{first} .. {last}"
            lines.append(
                f"  stage {s}: {span} ({self.bounds[s + 1] - self.bounds[s]} layers): "
                f"{_ms(self.compute[s])} compute + {_ms(self.transfer[s])} transfers"
            )
        for i, (at, nbytes) in enumerate(zip(self.cuts, self.cut_bytes, strict=True)):
            lines.append(
                f"  cut {i}: after {self.names[at - 1]}, before {self.names[at]}: "
                f"{nbytes} bytes cross it per measured batch (activations and gradients)"
            )
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def balanced_cut(
    names: Sequence[str],
    costs: Sequence[float],
    cut_bytes: Sequence[int | None],
    stages: int,
    seconds_per_byte: float = DEFAULT_SECONDS_PER_BYTE,
) -> Partition:
    """The contiguous cut of `names` into `stages` stages whose slowest stage (compute + transfers) is fastest.

    Args:
        names: the units (layers) in a topological order.
        costs: seconds of forward+backward per unit.
        cut_bytes: ``len(names) - 1`` entries; entry i: bytes crossing a cut between ``names[i]`` and
            ``names[i + 1]`` each step, or None where no cut may go.
        stages: S >= 1.
        seconds_per_byte: what one byte's transfer costs.
    """
    n = len(names)
    _check(names, costs, cut_bytes, stages, seconds_per_byte)
    allowed = [i + 1 for i, b in enumerate(cut_bytes) if b is not None]  # cut positions
    if stages - 1 > len(allowed):
        where = f" ({n - 1 - len(allowed)} of the {n - 1} gaps lie inside layers that cannot be split)"
        raise ValueError(
            f"cannot cut {n} layers into {stages} stages: only {len(allowed) + 1} stages are possible, "
            f"with a cut at each of the {len(allowed)} places a cut may go{where if len(allowed) < n - 1 else ''}; "
            f"ask for at most {len(allowed) + 1} stages or give a placement"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    edge = [0.0] * (n + 1)  # transfer seconds at a cut position (0 and n: none)
    for pos in allowed:
        edge[pos] = float(cut_bytes[pos - 1] or 0) * seconds_per_byte

    def stage_time(a: int, b: int) -> float:
        return prefix[b] - prefix[a] + edge[a] + edge[b]

    starts = [0, *allowed]  # where a stage may begin
    inf = float("inf")
    # best[s][b]: the slowest stage of the best cut of names[:b] into s + 1 stages; back[s][b]: its last start.
    best = [[inf] * (n + 1) for _ in range(stages)]
    back = [[-1] * (n + 1) for _ in range(stages)]
    ends = [*allowed, n]  # where a stage may end
    for b in ends:
        best[0][b] = stage_time(0, b)
        back[0][b] = 0
    for s in range(1, stages):
        for b in ends:
            for a in starts:
                if a == 0 or a >= b or best[s - 1][a] == inf:
                    continue
                value = max(best[s - 1][a], stage_time(a, b))
                # Ties go to the earlier cut, so every worker (same inputs) picks the same one.
                if value < best[s][b] - 1e-15:
                    best[s][b], back[s][b] = value, a
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(back[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return _partition(names, bounds, costs, cut_bytes, edge)


def evaluate_cut(
    names: Sequence[str],
    costs: Sequence[float],
    cut_bytes: Sequence[int | None],
    cuts: Sequence[int],
    seconds_per_byte: float = DEFAULT_SECONDS_PER_BYTE,
) -> Partition:
    """The stage costs of a given cut (positions as in :attr:`Partition.cuts`); ValueError if it is impossible."""
    n = len(names)
    _check(names, costs, cut_bytes, len(cuts) + 1, seconds_per_byte)
    bounds = [0, *cuts, n]
    for s in range(len(bounds) - 1):
        if bounds[s + 1] <= bounds[s]:
            raise ValueError(
                f"cuts {list(cuts)} leave stage {s} empty: cut positions must rise strictly within 1..{n - 1} "
                f"(a cut at i falls between layer i-1 and layer i of the {n})"
            )
    for pos in cuts:
        if cut_bytes[pos - 1] is None:
            raise ValueError(
                f"a cut at {pos}, between {names[pos - 1]!r} and {names[pos]!r}, falls inside a layer that "
                "cannot be split (a layer used at both sides of it): move the cut"
            )
    edge = [0.0] * (n + 1)
    for pos in cuts:
        edge[pos] = float(cut_bytes[pos - 1] or 0) * seconds_per_byte
    return _partition(names, bounds, costs, cut_bytes, edge)


def _check(
    names: Sequence[str],
    costs: Sequence[float],
    cut_bytes: Sequence[int | None],
    stages: int,
    seconds_per_byte: float,
) -> None:
    n = len(names)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"a pipeline needs a whole number of stages >= 1, got {stages!r}")
    if n == 0:
        raise ValueError("the model has no layers to place on pipeline stages")
    if len(costs) != n:
        raise ValueError(f"{len(costs)} costs for {n} layers: give one cost per layer")
    if len(cut_bytes) != n - 1:
        raise ValueError(f"{len(cut_bytes)} cut sizes for {n} layers: give one per gap between layers ({n - 1})")
    if len(set(names)) != n:
        raise ValueError("layer names must be unique: each is placed on one stage")
    bad = [(name, c) for name, c in zip(names, costs, strict=True) if not c >= 0]
    if bad:
        raise ValueError(f"layer costs must be seconds >= 0; got {bad[0][1]!r} for {bad[0][0]!r}")
    if not seconds_per_byte >= 0:
        raise ValueError(f"seconds_per_byte must be >= 0, got {seconds_per_byte!r}")
    if stages > n:
        raise ValueError(
            f"cannot cut {n} layers into {stages} stages: every stage needs at least one layer, so at most "
            f"{n} stages are possible; use fewer stages (workers) or a larger model"
        )


def _partition(
    names: Sequence[str],
    bounds: Sequence[int],
    costs: Sequence[float],
    cut_bytes: Sequence[int | None],
    edge: Sequence[float],
) -> Partition:
    stages = len(bounds) - 1
    return Partition(
        names=tuple(names),
        bounds=tuple(bounds),
        compute=tuple(float(sum(costs[bounds[s] : bounds[s + 1]])) for s in range(stages)),
        transfer=tuple(edge[bounds[s]] + edge[bounds[s + 1]] for s in range(stages)),
        cut_bytes=tuple(int(cut_bytes[p - 1] or 0) for p in bounds[1:-1]),
    )
