"""Training throughput: per-worker mini-batches/s of model.fit, alone and on N workers.

``--parallel model`` (VGG-16 split over 2 workers) measures model parallelism
instead: one process alone, then the pipeline over rdkeras (static edges) and
over ``transport=grpc``, each with and without micro-batching.

Configurations, measured one after another in one run: 1 worker without any
communication (plain Keras), N such workers side by side (no communication:
what the host's shared memory bandwidth leaves each), N workers on rdkeras for
each native transport,
and N workers on ``transport=grpc`` (the RPC baseline). Every worker is pinned
to its own core and TensorFlow uses one thread per worker in every
configuration, so per-worker compute is the same and only communication differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rdkeras import introspect, options
from rdkeras.bench import cut_after, pin_one_core

# (input/output width, hidden width): FCN-5 is input -> 3 x hidden (sigmoid) -> softmax output.
FCN5_SIZES = {"small": (4096, 1024), "full": (26752, 2048)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="fcn5", choices=["fcn5", "vgg16"], help="fcn5 (5-layer fully connected), vgg16")
    p.add_argument("--parallel", default="data", choices=["data", "model"], help="model: the layers split over workers")
    p.add_argument(
        "--split",
        default="block5_pool,block3_pool",
        help="model parallel: cut after each of these layers in turn (block5_pool = features | classifier)",
    )
    p.add_argument("--micro-batches", default="1,4", help="model parallel: micro-batch counts to measure")
    p.add_argument("--image-size", type=int, default=32, help="vgg16 input size (224 in the paper)")
    p.add_argument("--width", type=float, default=0.25, help="vgg16 channel multiplier (1.0 in the paper)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="per-worker batch (the seed's convention); fit gets the global batch, this x workers (model "
        "parallel: the pipeline's batch)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--full", action="store_true", help="the paper's sizes (FCN-5 26752-2048x3-26752, 118 M params)")
    p.add_argument("--transports", default="shm,tcp,grpc")
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--timeout", type=float, default=1800)


def rank_main(distributed: bool, width: int, hidden: int, batch: int, steps: int, warmup: int) -> dict:
    options.quiet_tensorflow_logs(level=3)
    pin_one_core()
    import keras

    import rdkeras
    from rdkeras.models import fcn5

    strategy = rdkeras.RDMAStrategy() if distributed else None
    workers = strategy.num_workers if strategy else 1
    rng = np.random.default_rng(0)
    samples = batch * workers * (steps + warmup)
    x = rng.random((samples, width), dtype=np.float32)
    y = rng.integers(0, width, samples)
    import contextlib

    with strategy.scope() if strategy else contextlib.nullcontext():
        model = fcn5(width, hidden)  # the same network as the fcn5 recipe
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", jit_compile=False)

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            if b == warmup:
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, b, logs=None):
            self.t1 = time.perf_counter()  # the last one wins; epoch-end work stays outside

    clock = Clock()
    # batch_size is the global batch: `batch` rows per worker, as in the seed's figures.
    model.fit(x, y, batch_size=batch * workers, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    rate = steps / (clock.t1 - clock.t0)
    params = model.count_params()
    transport = strategy.transport if strategy else "none"
    if strategy:
        strategy.close()
    return {"rate": rate, "params": params, "transport": transport}


def model_parallel_rank(
    split: str, micro: int, image_size: int, width: float, batch: int, steps: int, warmup: int, distributed: bool
) -> dict:
    """One worker of a 2-stage VGG-16 pipeline cut after layer `split` (or the whole model alone)."""
    options.quiet_tensorflow_logs(level=3)
    pin_one_core()
    import contextlib

    import keras

    import rdkeras
    from rdkeras.models import vgg16

    names = [layer.name for layer in vgg16(image_size=image_size, width=width).layers[1:]]
    placement: Any = "auto" if split == "auto" else cut_after(names, split)  # auto: the cut rdkeras measures
    strategy = (
        rdkeras.RDMAStrategy(parallelism="model", placement=placement, stages=2, micro_batches=micro)
        if distributed
        else None
    )
    rng = np.random.default_rng(0)
    x = rng.random((batch * (steps + warmup), image_size, image_size, 3), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = vgg16(image_size=image_size, width=width)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", jit_compile=False)
    clock = _Clock(warmup)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    result = {"rate": steps / (clock.t1 - clock.t0), "params": model.count_params()}
    if strategy:
        edge = introspect.inspect(strategy).plan.edges[0]
        result["edge"] = f"{edge.producer} {edge.shape} {edge.transfer}"
        result["edge_bytes"] = edge.bytes_per_step
        strategy.close()
    return result


class _Clock:
    def __new__(cls, warmup: int) -> Any:
        import keras

        class Clock(keras.callbacks.Callback):
            def on_train_batch_begin(self, b, logs=None):
                if b == warmup:
                    self.t0 = time.perf_counter()

            def on_train_batch_end(self, b, logs=None):
                self.t1 = time.perf_counter()

        return Clock()


def run_model_parallel(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    if args.model != "vgg16":
        raise SystemExit("bench fit: --parallel model measures vgg16 (pass --model vgg16)")
    steps = max(4, args.steps // 2) if args.quick else args.steps
    common = {"image_size": args.image_size, "width": args.width, "batch": args.batch_size, "steps": steps}
    common["warmup"] = 3
    splits = args.split.split(",")
    micros = [int(m) for m in args.micro_batches.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    rows = []

    def measure(label: str, workers: int, **kw) -> dict | None:
        print(f"[fit] {label} ...", flush=True)
        env = {"RDKERAS_TRANSPORT": kw.pop("transport")} if workers > 1 else {"RDKERAS_WORLD_SIZE": ""}
        ranks = run_ranks(
            "fit",
            label,
            "rdkeras.bench.fit:model_parallel_rank",
            workers,
            {**common, **kw},
            env=env,
            timeout=args.timeout,
        )
        if ranks is None:
            return None
        return {"config": label, "rate": min(r.value["rate"] for r in ranks), **ranks[0].value}

    alone = measure("1 process (whole model, 1 core)", 1, split=splits[0], micro=1, distributed=False)
    if alone is None:
        return 1
    rows.append({**alone, "transport": "none", "split": "-", "micro": 1})
    for split in splits:
        for micro in micros:
            for t in transports:
                r = measure(
                    f"2 workers, cut after {split}, {micro} micro, {t}",
                    2,
                    split=split,
                    micro=micro,
                    distributed=True,
                    transport=t,
                )
                if r is None:
                    return 1
                rows.append({**r, "transport": t, "split": split, "micro": micro})
    _print_model_parallel(rows, alone, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit_model_parallel.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {out / 'fit_model_parallel.json'}")
    return 0


def _print_model_parallel(rows: list[dict], alone: dict, args: argparse.Namespace) -> None:
    """Each pipeline configuration's rate against one process alone and against gRPC at the same cut."""
    print(
        f"\nmodel-parallel model.fit: VGG-16 {args.image_size}x{args.image_size}, width x{args.width} "
        f"({alone['params'] / 1e6:.1f} M params), pipeline batch {args.batch_size}, 2 workers pinned to one core each"
    )
    print(
        f"{'configuration':<48} {'cut edge (per micro-batch)':<34} {'batches/s':>9} {'x 1 process':>11} {'x grpc':>7}"
    )
    for r in rows:
        grpc = next(
            (
                g["rate"]
                for g in rows
                if g["transport"] == "grpc" and g["split"] == r["split"] and g["micro"] == r["micro"]
            ),
            None,
        )
        xg = f"{r['rate'] / grpc:.2f}" if grpc and r["transport"] not in ("grpc", "none") else "-"
        print(
            f"{r['config']:<48} {r.get('edge', '-'):<34} {r['rate']:>9.2f} {r['rate'] / alone['rate']:>11.2f} {xg:>7}"
        )


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    if args.parallel == "model":
        return run_model_parallel(args)
    if args.model != "fcn5":
        raise SystemExit("bench fit: data parallelism is measured on fcn5")

    width, hidden = FCN5_SIZES["full" if args.full else "small"]
    steps = max(4, args.steps // 2) if args.quick else args.steps
    # The first steps trace the function, create the ring and fault its pages in: not timed.
    common = {"width": width, "hidden": hidden, "batch": args.batch_size, "steps": steps, "warmup": 5}
    n = args.workers
    # "independent": N plain-Keras processes side by side, no communication --
    # what this host's shared memory bandwidth and caches leave each of N workers.
    configs = [("1 worker, no communication", 1, "none"), (f"{n} independent, no comm.", n, "independent")]
    configs += [(f"{n} workers, rdkeras {t}", n, t) for t in args.transports.split(",")]
    rows = []
    for label, workers, transport in configs:
        print(f"[fit] {label} ...", flush=True)
        distributed = transport not in ("none", "independent")
        env = {"RDKERAS_TRANSPORT": transport} if distributed else {"RDKERAS_WORLD_SIZE": ""}
        ranks = run_ranks(
            "fit",
            label,
            "rdkeras.bench.fit:rank_main",
            workers,
            {"distributed": distributed, **common},
            env=env,
            timeout=args.timeout,
        )
        if ranks is None:
            return 1
        rate = min(r.value["rate"] for r in ranks)  # the slowest worker sets the pace
        rows.append(
            {
                "config": label,
                "transport": transport,
                "workers": workers,
                "per_worker_batches_per_s": rate,
                "params": ranks[0].value["params"],
            }
        )

    _print_data_parallel(rows, width, hidden, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {out / 'fit.json'}")
    return 0


def _print_data_parallel(rows: list[dict], width: int, hidden: int, args: argparse.Namespace) -> None:
    """Each configuration's per-worker rate against one worker, N independent ones and gRPC; the targets."""
    n = args.workers
    rate = {r["transport"]: r["per_worker_batches_per_s"] for r in rows}
    params = rows[0]["params"]
    print(
        f"\nmodel.fit throughput: FCN-5 {width}-{hidden}x3-{width} ({params / 1e6:.1f} M params, "
        f"{params * 4 / 1e6:.0f} MB of gradients per step), per-worker batch {args.batch_size} "
        f"(global {args.batch_size * n}), 1 core per worker"
    )
    print(f"{'configuration':<32} {'batches/s per worker':>21} {'x 1 worker':>11} {'x independent':>14} {'x grpc':>7}")
    for r in rows:
        v = r["per_worker_batches_per_s"]
        xg = f"{v / rate['grpc']:.1f}" if "grpc" in rate and r["transport"] in ("shm", "tcp") else "-"
        print(f"{r['config']:<32} {v:>21.2f} {v / rate['none']:>11.2f} {v / rate['independent']:>14.2f} {xg:>7}")
    if "shm" in rate and "grpc" in rate:
        ratio, speedup = rate["shm"] / rate["none"], rate["shm"] / rate["grpc"]
        print("\nTargets")
        print(
            f"  [{'met' if ratio >= 0.9 else 'MISSED'}] rdkeras shm >= 0.9 x one worker's rate: {ratio:.2f} "
            f"({rate['shm'] / rate['independent']:.2f} x {n} independent workers sharing this host)"
        )
        print(f"  [{'met' if speedup >= 3 else 'MISSED'}] rdkeras shm >= 3 x grpc: {speedup:.1f}x")
