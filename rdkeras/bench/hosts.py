"""Across hosts: the flat ring against the hierarchical allreduce, 2 emulated hosts x 2 workers.

Two network namespaces on a veth pair stand for two hosts (``rdkeras.testing.netns``; root and iproute2),
the link shaped to ``--rate`` (a ``tc tbf`` limit on each end) and then unshaped. On each, side by side in
one run: one allreduce of ``--mb`` MB of float32 gradients (the median of ``--reps``), and a data-parallel
training step of a model with that many gradient bytes (Dense 2048 -> 4096 -> 2048 by default), with
``algorithm="ring"`` and ``algorithm="hierarchical"``. The transport is what ``auto`` picks there: shm
inside a host, tcp between (``shm+tcp``). The flat ring sends 2(N-1)/N of the bytes over every link, so
1.5x the gradient each way between the hosts at 2 x 2; the hierarchical one sends each host's sum once
(1.0x): the bound on its speed-up over a saturated link is 1.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

ALGORITHMS = ("ring", "hierarchical")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="1gbit", help="the link between the hosts, in tc's units (then unshaped)")
    p.add_argument("--mb", type=float, default=64.0, help="megabytes of float32 gradients the allreduce sums")
    p.add_argument("--reps", type=int, default=5, help="timed allreduces (and training steps) per configuration")
    p.add_argument("--no-fit", action="store_true", help="the allreduce only, no training step")
    p.add_argument(
        "--overlap-bytes", type=int, default=None, help="the step's gradient buckets (0: one exchange after backprop)"
    )
    p.add_argument("--rates", default=None, help="comma-separated links to measure (default: --rate, then unshaped)")
    p.add_argument("--out", default="bench-results", help="folder for hosts.json")
    p.add_argument("--timeout", type=float, default=900)


def rank_main(algorithm: str, nbytes: int, reps: int, fit: bool, overlap_bytes: int | None = None) -> dict:
    """In each worker: seconds per allreduce (and per training step); rank 0 returns them."""
    from rdkeras import cluster, options

    options.quiet_tensorflow_logs(level=3)
    rank = cluster.resolve().rank
    out: dict[str, Any] = {"allreduce": _allreduce_seconds(algorithm, nbytes, reps)}
    if fit:
        out.update(_step_seconds(algorithm, nbytes, reps, overlap_bytes))
    return out if rank == 0 else {}


def _allreduce_seconds(algorithm: str, nbytes: int, reps: int) -> list[float]:
    import rdkeras
    from rdkeras.parallel.collectives import Collectives

    with rdkeras.Engine() as engine:
        collectives = Collectives(engine, 64 << 20, algorithm=algorithm)
        grads = np.full(nbytes // 4, 1.0 + engine.rank, np.float32)
        (first,) = collectives.allreduce([grads], average=True)  # warm-up: rings set up, pages touched
        expected = np.float32(sum(1.0 + r for r in range(engine.world_size)) / engine.world_size)
        if not np.all(first == expected):
            raise AssertionError(f"{algorithm}: the allreduce gave {first[:4]}..., not {expected}")
        times = []
        for _ in range(reps):
            engine.barrier()
            started = time.perf_counter()
            collectives.allreduce([grads], average=True)
            times.append(time.perf_counter() - started)
        engine.barrier()
    return times


def _step_seconds(algorithm: str, nbytes: int, reps: int, overlap_bytes: int | None) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import rdkeras
    from rdkeras import cluster

    threads = max(1, (os.cpu_count() or 1) // cluster.resolve().local_world_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    width = 2048
    hidden = max(1, int(nbytes / 4 / (2 * width)))  # two width x hidden kernels hold the gradient bytes
    strategy = rdkeras.RDMAStrategy(algorithm=algorithm, overlap_bytes=overlap_bytes)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(hidden), keras.layers.Dense(width)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    batch = 8 * strategy.num_workers
    x = np.random.default_rng(0).standard_normal((batch * (reps + 1), width)).astype(np.float32)
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            times.append(time.perf_counter() - self.began)

    model.fit(x, x, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    plan = strategy.plan
    digest = float(sum(np.abs(w).sum() for w in model.get_weights()))
    strategy.close()
    return {"step": times[1:], "plan": plan.algorithm if plan else None, "weights": digest}


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks_on_hosts
    from rdkeras.testing import netns

    why = netns.why_not()
    if why is not None:
        print(f"bench hosts: two network namespaces are needed ({why})")
        return 2
    nbytes = int(args.mb * (1 << 20))
    rows: dict[str, dict[str, Any]] = {}
    rates = [r or None for r in args.rates.split(",")] if args.rates else [args.rate, None]
    for rate in rates:
        link = rate or "unshaped"
        with netns.hosts(2, rate=rate) as hosts:
            for algorithm in ALGORITHMS:
                kwargs = {"algorithm": algorithm, "nbytes": nbytes, "reps": args.reps, "fit": not args.no_fit,
                          "overlap_bytes": args.overlap_bytes}  # fmt: skip
                ranks = run_ranks_on_hosts(
                    "hosts", f"{algorithm} at {link}", "rdkeras.bench.hosts:rank_main", 4, kwargs, hosts,
                    timeout=args.timeout,
                )  # fmt: skip
                if ranks is None:
                    return 1
                rows.setdefault(link, {})[algorithm] = ranks[0].value
    _report(rows, args)
    return 0


def _report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n2 hosts x 2 workers (network namespaces), {args.mb:g} MB of float32 gradients; median of {args.reps}")
    print(f"{'link':>10} {'what':>10} {'ring s':>8} {'hier. s':>8} {'speed-up':>9}")
    summary: dict[str, Any] = {}
    for link, by in rows.items():
        for what in ("allreduce", "step"):
            if what not in by["ring"]:
                continue
            ring, hier = (statistics.median(by[a][what]) for a in ALGORITHMS)
            summary[f"{link}/{what}"] = {"ring_s": ring, "hierarchical_s": hier, "speedup": ring / hier}
            print(f"{link:>10} {what:>10} {ring:8.3f} {hier:8.3f} {ring / hier:8.2f}x")
        if "weights" in by["ring"]:
            same = abs(by["ring"]["weights"] - by["hierarchical"]["weights"]) <= 1e-5 * abs(by["ring"]["weights"])
            summary[f"{link}/same_weights"] = same
            print(f"{link:>10} the two algorithms' weights agree within 1e-5: {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(f"raw figures in {out / 'hosts.json'}")
