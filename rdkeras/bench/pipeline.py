"""Pipeline parallelism: one process on one core against 2 stages (one core each), by micro-batches.

For each model -- VGG-16 as in ``bench fit`` (32 px, width x0.25), a plain VGG-style convnet
(six 3x3 convolutions in three blocks, no BatchNorm), FCN-5 -- in one run: one process on one
core with the whole batch, and the same process computing the batch as M micro-batches (what
micro-batching costs the compute itself); then 2 stages, one core and one TensorFlow thread
each, with the automatic cut (and a hand cut for the convnets) under 1F1B and GPipe, for M in
1/4/8/16, and the automatic cut under 1F1B with every weight gradient per micro-batch ("1f1b/mb":
what deferring Dense and convolution layers' weight gradients saves). Per configuration and stage:
the median step; the stage's compute as the step runs it, timed alone in the same process afterwards:
its passes (forward and backward over M micro-batches) and its tail (the deferred layers' weight
gradients, once over the whole batch after the last backward pass); the time its receives waited,
and the rest (the hops into and out of TensorFlow, the loss, the update). The ideal step for those
computes ((M + S - 1) x the slowest stage's passes per micro-batch, then the largest tail),
measured / ideal, and the speed-up over one process fitting the same model on rank 0's core just before and just
after that configuration, measured, ideal and balanced (the ideal for the same work spread evenly over the stages:
no cut of these computes does better). A PNG plots speed-up against micro-batches, measured and ideal, with
the one-process line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from rdkeras import options
from rdkeras.bench import add_rounds, cut_after, pin_one_core
from rdkeras.bench.workloads import timed_fit

MODELS = ("vgg16", "vggstyle", "fcn5")
HAND_CUTS = {"vgg16": "block3_pool", "vggstyle": "pool2"}  # cut after this layer (hand placement)
STAGES = 2
AUTOMATIC = ("auto", "alternate", "split")  # --cuts that leave the cut to rdkeras


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"any of {', '.join(MODELS)}")
    p.add_argument("--micro-batches", default="1,4,8,16")
    p.add_argument("--schedules", default="1f1b,gpipe")
    p.add_argument(
        "--per-micro-batch",
        default="auto",
        help="configurations (cut names, or 'auto'/'none') also run with every weight gradient per micro-batch, "
        "as before Dense and convolution layers' were deferred to the step's end",
    )
    p.add_argument(
        "--cuts", default=None, help="comma-separated: 'auto', 'alternate' (the automatic cut with alternate_layers), "
        "'split' (with split_layers) and/or layer names to cut after (default: auto and the model's hand cut)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=64, help="the global batch (every configuration)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    add_rounds(
        p, "each one's row is its median round by speed-up (over its own one-process reference), with the rounds' range"
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, M in 4/8, 1F1B, the automatic cut only")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--timeout", type=float, default=900)


def build(name: str) -> Any:
    import keras

    from rdkeras.models import fcn5, vgg16

    if name == "vgg16":
        model = vgg16(image_size=32, width=0.25)
    elif name == "fcn5":
        model = fcn5(input_dim=4096, hidden=1024, num_classes=10)
    else:
        x = inputs = keras.Input((32, 32, 3), name="image")
        for block, filters in enumerate((32, 64, 128), start=1):
            for i in (1, 2):
                x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{block}_{i}")(x)
            x = keras.layers.MaxPooling2D(name=f"pool{block}")(x)
        x = keras.layers.Flatten(name="flatten")(x)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="predictions")(x), name=name)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", jit_compile=False)
    return model


def _data(name: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (rows, 4096) if name == "fcn5" else (rows, 32, 32, 3)
    return rng.random(shape, dtype=np.float32), rng.integers(0, 10, rows)


def _compute(model: Any, rows: int, micro: int, repeats: int = 7) -> float:
    """Seconds of `model`'s forward and backward over `micro` micro-batches of `rows` rows (gradients summed)."""
    import keras
    import tensorflow as tf

    from rdkeras.pipeline.cut import timing

    feed = tf.constant(np.random.default_rng(1).random((rows, *model.inputs[0].shape[1:]), dtype=np.float32))

    @tf.function(jit_compile=False)
    def passes(inputs: Any) -> Any:
        total = None
        for _ in range(micro):
            with tf.GradientTape() as tape:
                objective = tf.add_n([tf.reduce_sum(o) for o in keras.tree.flatten(model(inputs, training=True))])
            grads = tape.gradient(objective, model.trainable_variables)
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        return total

    return timing.median_seconds(passes, [feed], repeats)


def alone_rank(model: str, batch: int, steps: int, warmup: int, micro_batches: list[int]) -> dict:
    """One process on one core: the step of ``fit``, and the whole model's compute in M micro-batches."""
    options.quiet_tensorflow_logs(level=3)
    pin_one_core()
    m = build(model)
    x, y = _data(model, batch * (steps + warmup))
    step = timed_fit(m, x, y, batch, warmup)["step_seconds"]  # the median step: one the VM stalled does not move it
    compute = {micro: _compute(m, batch // micro, micro) for micro in sorted({1, *micro_batches})}
    return {"step": step, "compute": compute, "params": m.count_params()}


def stage_rank(
    model: str, cut: str, micro: int, schedule: str, batch: int, steps: int, warmup: int, defer: bool = True
) -> dict:
    """One stage of a 2-stage pipeline: its step, compute, waiting; the plan's cut. Rank 0 also times one
    process on its core just before and just after (the reference side by side: the VM's speed drifts)."""
    import rdkeras
    from rdkeras import cluster

    options.quiet_tensorflow_logs(level=3)
    rank = cluster.resolve().rank
    pin_one_core()
    x, y = _data(model, batch * (steps + warmup))
    alone: list[float] = []
    if rank == 0:  # (rank 1 waits in the rendezvous meanwhile)
        alone.append(timed_fit(build(model), x, y, batch, warmup)["step_seconds"])
    placement: Any = "auto"
    if cut not in AUTOMATIC:
        import keras

        names = [layer.name for layer in build(model).layers if not isinstance(layer, keras.layers.InputLayer)]
        placement = cut_after(names, cut)
    strategy = rdkeras.RDMAStrategy(
        parallelism="pipeline",
        placement=placement,
        stages=STAGES,
        micro_batches=micro,
        schedule=schedule,
        defer_weight_gradients=defer,
        alternate_layers=cut == "alternate",
        split_layers=cut == "split",
    )
    with strategy.scope():
        m = build(model)
    timed = timed_fit(m, x, y, batch, warmup, strategy.engine)
    plan = strategy.plan
    assert plan is not None
    from rdkeras.pipeline import build_stage
    from rdkeras.pipeline.cut import timing

    # This worker's layers as a model (the same layers, not copies); where layers alternate, each micro-batch
    # plan's, run for as many micro-batches as follow it.
    uses = plan.micro_plans or [plan] * micro
    graph = plan.model  # (the user's model, or the split model over its layers)
    compute = tail = 0.0
    for turn in range(STAGES):  # one stage at a time: alone on the machine, as one process was
        if turn == rank:
            for p in {id(p): p for p in uses}.values():
                stage = build_stage(graph, p, rank)
                if stage.model is not None:
                    passes, deferred = timing.stage_compute(stage, batch // micro, sum(q is p for q in uses))
                    compute, tail = compute + passes + deferred, tail + deferred
        strategy.engine.barrier(f"compute {turn}")
    strategy.close()
    if rank == 0:
        alone.append(timed_fit(build(model), x, y, batch, warmup)["step_seconds"])
    return {
        "stage": rank,
        "alone": float(np.mean(alone)) if alone else None,  # the two bracket this configuration
        "step": timed["step_seconds"],
        "compute": compute,
        "tail": tail,  # (of compute) the deferred weight gradients, once a step after the last backward
        "waiting": timed["wait_seconds_per_step"],
        "layers": plan.layers_of(rank),
        "alternates": sorted(plan.partition.alternates) if plan.micro_plans and plan.partition else [],
        "splits": sorted(plan.partition.split_layers) if graph is not m and plan.partition else [],
        "stashed": plan.stashed.get(rank),
        "deferred": plan.deferred_of(rank),
        "activation_bytes": plan.activation_bytes.get(rank),
        "cut_bytes": sum(e.bytes_per_step or 0 for e in plan.edges if e.kind == "activation"),
    }


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    steps = max(4, args.steps // 2) if args.quick else args.steps
    # A pipeline's first steps run slower than the rest (vggstyle, 8 micro-batches: 116 ms median over its
    # first 10 steps, 104-107 ms over each next 10, one process flat from its first): time after 10.
    warmup = 10
    micros = [4, 8] if args.quick else [int(m) for m in args.micro_batches.split(",")]
    schedules = ["1f1b"] if args.quick else args.schedules.split(",")
    batch = args.batch_size
    if any(batch % m for m in micros):
        raise SystemExit(f"bench pipeline: --batch-size {batch} does not split into {micros} micro-batches")
    results: dict[str, Any] = {"batch": batch, "steps": steps, "models": {}}
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"bench pipeline: --models takes {', '.join(MODELS)}, not {model!r}")
        print(f"[pipeline] {model}: one process, one core ...", flush=True)
        env = {"RDKERAS_WORLD_SIZE": ""}
        ranks = run_ranks("pipeline", f"{model} alone", "rdkeras.bench.pipeline:alone_rank", 1,
                          {"model": model, "batch": batch, "steps": steps, "warmup": warmup,
                           "micro_batches": micros}, env=env, timeout=args.timeout)  # fmt: skip
        if ranks is None:
            return 1
        alone = ranks[0].value
        alone["compute"] = {int(k): v for k, v in alone["compute"].items()}
        by_config: dict[tuple, dict] = {}
        if args.cuts:
            cuts = args.cuts.split(",")
        else:
            cuts = ["auto"] if args.quick or model not in HAND_CUTS else ["auto", HAND_CUTS[model]]
        both = args.per_micro_batch.split(",")
        configs = [(cut, schedule, True) for cut in cuts for schedule in schedules]
        configs += [(cut, schedules[0], False) for cut in cuts if cut in both]
        runs = [(r, *c, m) for r in range(max(1, args.rounds)) for c in configs for m in micros]
        for turn, cut, schedule, defer, micro in runs:
            if not defer and micro == 1:
                continue  # one micro-batch defers nothing
            label = f"{model}, cut {cut}, {_name(schedule, defer)}, {micro} micro-batches"
            if args.rounds > 1:
                label += f", round {turn + 1} of {args.rounds}"
            print(f"[pipeline] {label} ...", flush=True)
            ranks = run_ranks("pipeline", label, "rdkeras.bench.pipeline:stage_rank", STAGES,
                              {"model": model, "cut": cut, "micro": micro, "schedule": schedule,
                               "batch": batch, "steps": steps, "warmup": warmup, "defer": defer},
                              env={"RDKERAS_TRANSPORT": "shm"}, timeout=args.timeout)  # fmt: skip
            if ranks is None:
                return 1
            key = (cut, _name(schedule, defer), micro)
            row = by_config.setdefault(key, {"cut": cut, "schedule": key[1], "micro": micro, "rounds": []})
            row["rounds"].append([r.value for r in ranks])
        rows = [median_round(row, alone) for row in by_config.values()]
        results["models"][model] = {"alone": alone, "pipelines": rows}
        _print(model, alone, rows, batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "pipeline.png")
    print(f"\nwrote {out / 'pipeline.json'} and {out / 'pipeline.png'}")
    return 0


def _name(schedule: str, defer: bool) -> str:
    """A configuration's schedule as the table shows it ("/mb": every weight gradient per micro-batch)."""
    return schedule if defer else f"{schedule}/mb"


def ideal_step(computes: list[float], micro: int, tails: list[float] | None = None) -> float:
    """The pipeline's step for these stage computes (each over `micro` micro-batches, of which `tails` are the
    deferred weight gradients each stage computes once after its last backward pass): it fills and drains,
    (M + S - 1) micro-batches of the slowest stage's passes, then waits for the largest tail -- the first stage's
    runs after every other stage's last pass, with nothing left to overlap it."""
    tails = tails or [0.0] * len(computes)
    passes = [c - t for c, t in zip(computes, tails, strict=True)]
    return (micro + len(computes) - 1) * max(passes) / micro + max(tails)


def balanced_step(computes: list[float], micro: int, tails: list[float] | None = None) -> float:
    """:func:`ideal_step` with the same work (passes and tails) spread evenly over the stages: the best step any cut of
    these computes could reach (one that balanced them exactly), so a target above it is out of the cut's reach."""
    tails = tails or [0.0] * len(computes)
    n = len(computes)
    return ideal_step([sum(computes) / n] * n, micro, [sum(tails) / n] * n)


def median_round(row: dict, alone: dict) -> dict:
    """A configuration's row over its rounds: its stages are the median round's by speed-up (the lower of the two
    middle ones for an even count); "speedups": every round's, in order."""
    rounds = row["rounds"]
    speedups = [_summary({**row, "stages": stages}, alone)["speedup"] for stages in rounds]
    median = sorted(range(len(rounds)), key=lambda i: speedups[i])[(len(rounds) - 1) // 2]
    return {**row, "stages": rounds[median], "speedups": speedups}


def _summary(row: dict, alone: dict) -> dict[str, float]:
    stages = row["stages"]
    step = max(s["step"] for s in stages)
    computes, tails = [s["compute"] for s in stages], [s.get("tail", 0.0) for s in stages]
    ideal = ideal_step(computes, row["micro"], tails)
    balanced = balanced_step(computes, row["micro"], tails)
    one = stages[0].get("alone") or alone["step"]  # this configuration's own reference
    return {"step": step, "ideal": ideal, "alone": one, "speedup": one / step, "ideal_speedup": one / ideal,
            "balanced_speedup": one / balanced}  # fmt: skip


def _print(model: str, alone: dict, rows: list[dict], batch: int) -> None:
    ms = 1000.0
    compute = alone["compute"]
    tax = ", ".join(f"M={m} {compute[m] * ms:.1f} ms ({compute[m] / compute[1]:.2f}x)" for m in sorted(compute))
    print(f"\n{model} ({alone['params'] / 1e6:.1f} M params), global batch {batch}, one process on one core: "
          f"{alone['step'] * ms:.1f} ms a step of fit; forward+backward in M micro-batches: {tax}")  # fmt: skip
    print(f"{'cut':<12} {'schedule':<9} {'M':>3} {'step ms':>8} {'1 proc':>7} {'ideal':>7} {'meas/ideal':>10} "
          f"{'x 1 proc':>8} {'x ideal':>7} {'x balanced':>10}   per stage: passes + tail / waiting / rest ms; "
          "stashed")  # fmt: skip
    for row in rows:
        s = _summary(row, alone)
        parts = "  ".join(
            f"s{st['stage']} {(st['compute'] - st.get('tail', 0.0)) * ms:.1f}+{st.get('tail', 0.0) * ms:.1f}/"
            f"{st['waiting'] * ms:.1f}/"
            f"{(st['step'] - st['compute'] - st['waiting']) * ms:.1f}; {st['stashed']}"
            for st in row["stages"]
        )
        spread = row.get("speedups") or []
        rounds = f"   rounds {min(spread):.2f}-{max(spread):.2f}x ({len(spread)})" if len(spread) > 1 else ""
        print(f"{row['cut']:<12} {row['schedule']:<9} {row['micro']:>3} {s['step'] * ms:>8.1f} "
              f"{s['alone'] * ms:>7.1f} {s['ideal'] * ms:>7.1f} {s['step'] / s['ideal']:>10.2f} "
              f"{s['speedup']:>8.2f} {s['ideal_speedup']:>7.2f} {s['balanced_speedup']:>10.2f}   "
              f"{parts}{rounds}")  # fmt: skip
    for row in rows:
        if row["cut"] not in AUTOMATIC or row["schedule"] != rows[0]["schedule"]:
            continue  # the automatic cut (chosen per number of micro-batches: the layers are timed at its rows)
        for st in row["stages"]:
            shown = ", ".join(st["layers"][:2]) + (", ..., " + st["layers"][-1] if len(st["layers"]) > 2 else "")
            shared = (st.get("alternates") or []) if st["stage"] == 0 else []
            alternates = f" ({', '.join(shared)} alternating with the next stage)" if shared else ""
            split = (st.get("splits") or []) if st["stage"] == 0 else []
            alternates += f" ({', '.join(split)} split by rows with the next stage)" if split else ""
            print(f"  cut {row['cut']}, {row['micro']} micro-batches: stage {st['stage']}: {shown}{alternates}")


def _plot(results: dict, path: Path) -> None:
    from rdkeras.bench.figures.common import pyplot, save_png

    plt = pyplot()
    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        data = results["models"][model]
        alone = data["alone"]
        for (cut, schedule), style in zip(
            sorted({(r["cut"], r["schedule"]) for r in data["pipelines"]}), ("o-", "s-", "^-", "v-", "D-"), strict=False
        ):
            rows = [r for r in data["pipelines"] if r["cut"] == cut and r["schedule"] == schedule]
            micros = [r["micro"] for r in rows]
            line = ax.plot(micros, [_summary(r, alone)["speedup"] for r in rows], style, label=f"{cut}, {schedule}")
            ax.plot(micros, [_summary(r, alone)["ideal_speedup"] for r in rows], ":", color=line[0].get_color(),
                    label=f"ideal for its computes ({cut}, {schedule})")  # fmt: skip
        micros = sorted({r["micro"] for r in data["pipelines"]})
        ax.plot(micros, [STAGES * m / (m + STAGES - 1) for m in micros], "k--", label="GPipe bound 2M/(M+1)")
        ax.axhline(1.0, color="grey", lw=1, label="one process, one core")
        ax.set(title=model, xlabel="micro-batches", ylabel="speed-up over one process", xscale="log", xticks=micros)
        ax.set_xticklabels([str(m) for m in micros])
        ax.legend(fontsize=6)
    save_png(fig, path)
