"""The automatic pipeline cut: S contiguous stages of a layer order, balanced by measured cost.

Pure arithmetic (no TensorFlow): the layers ("units") in a topological order, each
with its measured forward+backward seconds, and for every position between two
units the bytes that would cross a cut there (every tensor produced before it and
consumed after it, skip connections included; ``None`` where no cut may go, e.g.
inside a layer used twice). A stage's time is its compute plus the transfers at
its two cuts; the cut minimising the slowest stage is found by a dynamic
programme over the order, as PipeDream's planner does for a chain -- O(S * L^2).
:mod:`rdkeras.pipeline.cut.timing` measures the inputs for a Keras model.

Cuts between layers balance only as finely as the layers are: one expensive layer at
the balance point leaves a stage up to half its cost slower than the other. Where the
caller marks layers `alternable` and the batch has an even number M of micro-batches,
the layer just before a cut may **alternate**: the stage after the cut runs it for the
odd micro-batches (:meth:`Partition.moved`), the stage before for the even ones (both
hold its weights; their partial gradients are summed between them at the step's end,
so both apply the same update), and each stage is charged half of it. Half, because
1F1B then runs in pairs of micro-batches (:func:`rdkeras.pipeline.schedule.passes_in_order`):
each pair holds one turn of the layer on each stage, so neither waits on the other's
turn -- alternating one micro-batch at a time, the two stages would pay the layer by
turns and gain nothing. After the programme, each cut in turn tries every position
between its neighbours with and without alternating (exact for two stages, a local
search for more); :func:`balanced_cut` keeps the alternation only where it makes the
slowest stage ``ALTERNATION_GAIN`` faster than the best cut between layers.

A layer that computes each row on its own may instead be **split by rows**
(:mod:`rdkeras.pipeline.cut.split`): the stage after the cut runs it for k of every n rows of each
micro-batch, the stage before for the rest, so every micro-batch is balanced and 1F1B needs
no pairs. The same search prices it, k among 0..n-1 of the micro-batch's n rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

# Seconds per byte assumed for a transfer when the caller has no measurement: about 1 GB/s.
DEFAULT_SECONDS_PER_BYTE = 1e-9
# How much faster (a share of the slowest stage) alternating layers must make the cut to be chosen: below it,
# the extra channels, the gradient sum and the weights held twice are not worth their measured gain.
ALTERNATION_GAIN = 0.05


@dataclass(frozen=True)
class Partition:
    """A cut of `names` into stages: stage s runs ``names[bounds[s]:bounds[s + 1]]``."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # 0 = b_0 < b_1 < ... < b_S = len(names)
    compute: tuple[float, ...]  # per stage: seconds of forward+backward
    transfer: tuple[float, ...]  # per stage: seconds of the transfers at its cuts (in and out)
    cut_bytes: tuple[int, ...]  # per cut (S - 1): bytes crossing it each step
    rows: int = 0  # the batch the layers were timed on (0: not said)
    # Per cut (S - 1; empty: none alternates): of `micro_batches`, how many run the layer just before it on the
    # stage after it (0 or half).
    shares: tuple[int, ...] = ()
    micro_batches: int = 1
    # Per cut (S - 1; empty: none is split): of each micro-batch's `rows`, how many the stage after it runs the
    # layer just before it for (:mod:`rdkeras.pipeline.cut.split`; 0: none).
    splits: tuple[int, ...] = ()
    trial: str = ""  # how a cut sharing a layer measured against this one's, where one was tried

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

    def stage_of(self, moved: Collection[int] = ()) -> dict[str, int]:
        """unit name -> stage: the placement this cut makes (exact names, so the analyzer runs unchanged); the
        layers alternating at the cuts in `moved` on their later stage (:meth:`moved`: a micro-batch's)."""
        placement = {name: s for s in range(self.stages) for name in self.names[self.bounds[s] : self.bounds[s + 1]]}
        for c in moved:
            placement[self.names[self.cuts[c] - 1]] = c + 1
        return placement

    @property
    def alternates(self) -> dict[str, tuple[int, int]]:
        """Each layer two stages share (alternating or split by rows) -> (the stage before its cut, the one
        after)."""
        return {self.names[self.cuts[c] - 1]: (c, c + 1) for c, k in enumerate(self.shares or self.splits) if k}

    @property
    def split_layers(self) -> dict[str, tuple[int, int]]:
        """Each layer split by rows -> (rows the later stage runs it for, of every `rows`)."""
        return {self.names[self.cuts[c] - 1]: (k, self.rows) for c, k in enumerate(self.splits) if k}

    def split_placement(self) -> dict[str, int]:
        """The placement of the split model (:func:`rdkeras.pipeline.cut.split.split_model` of :attr:`split_layers`):
        a split layer and its rows' layer on the stage before its cut, its twin and join on the one after."""
        from rdkeras.pipeline.cut.split import JOIN, ROWS, TWIN

        placement = self.stage_of()
        for name, (first, second) in self.alternates.items():
            placement.update({name + ROWS: first, name + TWIN: second, name + JOIN: second})
        return placement

    def moved(self, m: int) -> tuple[int, ...]:
        """The cuts whose alternating layer micro-batch m runs on the later stage: k of every M, spread evenly
        (where the running count m * k // M steps up), so that the two stages take turns."""
        whole = self.micro_batches
        return tuple(c for c, k in enumerate(self.shares) if k and (m + 1) * k // whole > m * k // whole)

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
        if self.trial:
            lines.append(f"  tried: {self.trial}")
        for i, (at, nbytes) in enumerate(zip(self.cuts, self.cut_bytes, strict=True)):
            lines.append(
                f"  cut {i}: after {self.names[at - 1]}, before {self.names[at]}: "
                f"{nbytes} bytes cross it per measured batch (activations and gradients)"
            )
            k = self.shares[i] if self.shares else 0
            rows = self.splits[i] if self.splits else 0
            if rows:
                lines[-1] += (
                    f"; {self.names[at - 1]} split by rows: stage {i + 1} runs it for {rows} of every {self.rows} "
                    f"rows of each micro-batch, stage {i} for the rest, its gradients summed between them"
                )
            if k:
                lines[-1] += (
                    f"; {self.names[at - 1]} alternates: stage {i + 1} runs it for {k} of {self.micro_batches} "
                    f"micro-batches, stage {i} for the rest (each charged its share), its gradients summed between them"
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
    alternable: Sequence[int | None] | None = None,
    micro_batches: int = 1,
    alternation_gain: float = ALTERNATION_GAIN,
    split_rows: int = 0,
) -> Partition:
    """The contiguous cut of `names` into `stages` stages whose slowest stage (compute + transfers) is fastest.

    Args:
        names: the units (layers) in a topological order.
        costs: seconds of forward+backward per unit.
        cut_bytes: ``len(names) - 1`` entries; entry i: bytes crossing a cut between ``names[i]`` and
            ``names[i + 1]`` each step, or None where no cut may go.
        stages: S >= 1.
        seconds_per_byte: what one byte's transfer costs.
        alternable: per unit, None where it may not alternate between two stages, else the bytes of its
            weights (their gradients are summed between the two stages each step). None: no unit may.
        micro_batches: M, the micro-batches an alternating layer's are shared out of (odd: none alternates).
        alternation_gain: how much faster (a share) alternating must make the slowest stage to be chosen.
        split_rows: where >= 2, the `alternable` layer at a cut is split by the rows of each micro-batch (these
            many: :mod:`rdkeras.pipeline.cut.split`) instead of alternating by micro-batch.
    """
    n = len(names)
    _check(names, costs, cut_bytes, stages, seconds_per_byte)
    if alternable is not None and len(alternable) != n:
        raise ValueError(f"{len(alternable)} alternation entries for {n} layers: give one per layer")
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
    plain = _partition(names, bounds, costs, cut_bytes, edge)
    if alternable is None or stages == 1 or all(a is None for a in alternable):
        return plain
    if split_rows >= 2:  # k of every `split_rows` rows, in every micro-batch
        mixed = _share(
            plain, costs, cut_bytes, seconds_per_byte, alternable, split_rows, range(split_rows), micro_batches
        )
        mixed = dataclasses.replace(mixed, splits=mixed.shares, shares=(), micro_batches=1, rows=split_rows)
    elif micro_batches >= 2:  # k of every M micro-batches, k = 0 or M / 2
        whole = (0, micro_batches // 2) if micro_batches % 2 == 0 else (0,)
        mixed = _share(plain, costs, cut_bytes, seconds_per_byte, alternable, micro_batches, whole, micro_batches)
        mixed = dataclasses.replace(mixed, micro_batches=micro_batches)
    else:
        return plain
    return mixed if mixed.slowest < plain.slowest * (1 - alternation_gain) else plain


def _share(
    plain: Partition,
    costs: Sequence[float],
    cut_bytes: Sequence[int | None],
    seconds_per_byte: float,
    alternable: Sequence[int | None],
    whole: int,
    options: Sequence[int],
    micro_batches: int,
) -> Partition:
    """`plain` with the layer before each cut shared with the stage after it, which takes k of every `whole` parts
    of it (micro-batches or rows), k among `options`: each cut in turn (twice over) moves to the position and k
    that make the slower of its two stages fastest, its neighbours held. The result's `shares` are those k. A
    stage's costs are per micro-batch: the shared layer's gradient sum, once a step, counts 1/M."""
    bounds = list(plain.bounds)
    shares = [0] * (len(bounds) - 2)

    def side(p: int, k: int) -> tuple[float, float]:
        """(compute the later stage takes, transfer seconds) at a cut at p whose layer p - 1 runs there for k of
        every `whole` parts: each part sends what crosses where it cuts."""
        q = k / whole
        sent = (1 - q) * float(cut_bytes[p - 1] or 0) + (q * float(cut_bytes[p - 2] or 0) if k else 0.0)
        sync = float(alternable[p - 1] or 0) / max(1, micro_batches) if k else 0.0  # its gradients' sum, per step
        return q * float(costs[p - 1]), (sent + sync) * seconds_per_byte

    def stage(s: int) -> tuple[float, float]:
        a, b = bounds[s], bounds[s + 1]
        compute, transfer = float(sum(costs[a:b])), 0.0
        if s > 0:
            taken, t = side(a, shares[s - 1])
            compute, transfer = compute + taken, transfer + t
        if s < len(shares):
            handed, t = side(b, shares[s])
            compute, transfer = compute - handed, transfer + t
        return compute, transfer

    def possible(c: int, p: int, k: int) -> bool:
        lo, hi = bounds[c], bounds[c + 2]
        if cut_bytes[p - 1] is None or (c + 1 < len(shares) and shares[c + 1] and p >= hi - 1):
            return False  # (the next cut's alternating layer must leave its first stage a layer of its own)
        # An alternating layer: both cuts around it possible, its first stage keeping a layer of its own.
        return not k or (alternable[p - 1] is not None and p - 1 > lo and cut_bytes[p - 2] is not None)

    for _ in range(2):
        for c in range(len(shares)):
            tried = []
            for p in range(bounds[c] + 1, bounds[c + 2]):
                for k in options:
                    if possible(c, p, k):
                        bounds[c + 1], shares[c] = p, k
                        tried.append((max(sum(stage(c)), sum(stage(c + 1))), k, p))
            _, shares[c], bounds[c + 1] = min(tried)  # ties: fewer parts moved, then the earlier cut
    parts = [stage(s) for s in range(len(bounds) - 1)]
    return dataclasses.replace(
        plain,
        bounds=tuple(bounds),
        compute=tuple(c for c, _ in parts),
        transfer=tuple(t for _, t in parts),
        cut_bytes=tuple(int(cut_bytes[p - 1] or 0) for p in bounds[1:-1]),
        shares=tuple(shares) if any(shares) else (),
    )


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
