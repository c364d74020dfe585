"""Across hosts: the flat ring, ``auto`` (hierarchical) and ``auto`` with bf16 gradients, 2 emulated hosts x 2 workers.

Two network namespaces on a veth pair stand for two hosts (``rdkeras.testing.netns``; root and iproute2),
the link shaped to ``--rate`` (a ``tc tbf`` limit on each end) and then unshaped. On each, side by side in
one run: one allreduce of ``--mb`` MB of float32 gradients (the median of ``--reps``), and a data-parallel
training step of a model with that many gradient bytes (Dense 2048 -> 4096 -> 2048 by default), with
``algorithm="ring"``, ``algorithm="auto"`` (hierarchical here), ``auto`` with ``compression="bf16"``, and the
baselines' flat rings (RPC over tcp, gRPC); then the same training in one process, whose weights every float32
run must equal. rdkeras's transport is what ``auto`` picks there: shm inside a host, tcp between (``shm+tcp``).
``python -m rdkeras.bench paper`` runs it as its "hosts" figure. The flat ring sends 2(N-1)/N of the bytes over
every link, so 1.5x the gradient each way between the hosts at 2 x 2; the hierarchical one sends each host's
sum once (1.0x), in bf16 half that (0.5x): the bounds on their speed-ups over a saturated link are 1.5x and 3x.
``--rounds N`` runs the configurations N times in turn: this machine's speed moves ±15% between runs, so the
speed-ups are then the median of each round's ratio, measured minutes apart rather than across the whole run.
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

from rdkeras.bench import add_rounds
from rdkeras.bench.hosts_summary import BASELINES, BOUNDS, CONFIGS, _add_round, describe_parts, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="1gbit", help="the link between the hosts, in tc's units (then unshaped)")
    p.add_argument("--mb", type=float, default=64.0, help="megabytes of float32 gradients the allreduce sums")
    p.add_argument("--reps", type=int, default=5, help="timed allreduces (and training steps) per configuration")
    add_rounds(p, "speed-ups are the median of the rounds' ratios (the machine's speed drifts between runs)")
    p.add_argument("--no-fit", action="store_true", help="the allreduce only, no training step")
    p.add_argument(
        "--overlap-bytes", type=int, default=None, help="the step's gradient buckets (0: one exchange after backprop)"
    )
    p.add_argument("--rates", default=None, help="comma-separated links to measure (default: --rate, then unshaped)")
    p.add_argument("--no-baselines", action="store_true", help="rdkeras only (no RPC and gRPC rings)")
    p.add_argument("--out", default="bench-results", help="folder for hosts.json")
    p.add_argument("--timeout", type=float, default=900)


def rank_main(
    algorithm: str,
    nbytes: int,
    reps: int,
    fit: bool,
    overlap_bytes: int | None = None,
    compression: str | None = None,
    allreduce: bool = True,
) -> dict:
    """In each worker: seconds per allreduce (and per training step); rank 0 returns them."""
    from rdkeras import cluster, options

    options.quiet_tensorflow_logs(level=3)
    rank = cluster.resolve().rank
    out: dict[str, Any] = {}
    if fit:  # before TensorFlow starts: the cores shared by this host's workers
        import tensorflow as tf

        threads = max(1, (os.cpu_count() or 1) // cluster.resolve().local_world_size)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if allreduce:
        out.update(_engine_seconds(algorithm, nbytes, reps, compression, compute=fit, bucket_bytes=overlap_bytes))
    if fit:
        out.update(_step_seconds(algorithm, nbytes, reps, overlap_bytes, compression))
    return out if rank == 0 else {}


def _engine_seconds(
    algorithm: str, nbytes: int, reps: int, compression: str | None, compute: bool, bucket_bytes: int | None = None
) -> dict[str, list[float]]:
    """Seconds per allreduce; with `bucket_bytes`, then per allreduce of the same bytes in buckets of that size as an
    overlapped step sends them, on one lane and on ``EXCHANGE_LANES``; with `compute`, then seconds per step of the
    same model trained undistributed on this worker's share of the batch, every worker at once (what a step costs
    beyond its exchange)."""
    import rdkeras
    from rdkeras.parallel.collectives import EXCHANGE_LANES, Collectives

    out: dict[str, list[float]] = {}

    with rdkeras.Engine() as engine:
        collectives = Collectives(engine, 64 << 20, algorithm=algorithm, compression=compression)
        grads = np.full(nbytes // 4, 1.0 + engine.rank, np.float32)
        # Warm-up (groups set up, pages touched); the sum (2.5) is exact in bf16 too.
        (first,) = collectives.allreduce([grads], average=True, compress=True)
        expected = np.float32(sum(1.0 + r for r in range(engine.world_size)) / engine.world_size)
        if not np.all(first == expected):
            raise AssertionError(f"{algorithm}: the allreduce gave {first[:4]}..., not {expected}")
        times = []
        for _ in range(reps):
            engine.barrier()
            started = time.perf_counter()
            collectives.allreduce([grads], average=True, compress=True)
            times.append(time.perf_counter() - started)
        out["allreduce"] = times
        if bucket_bytes and bucket_bytes < grads.nbytes:
            for lanes, key in ((1, "buckets_one_lane"), (EXCHANGE_LANES, "buckets_lanes")):
                out[key] = _bucketed_seconds(engine, collectives, grads, bucket_bytes, lanes, reps, expected)
        if compute:
            model, x = _model_and_data(nbytes, reps, 32 // engine.world_size)
            engine.barrier()  # every worker computing at once, as in a distributed step
            alone = _fit_seconds(model, x, 32 // engine.world_size)
            out["compute"], out["compute_cpu"] = alone["step"], alone["cpu"]
        engine.barrier()
    return out


def _bucketed_seconds(
    engine: Any, collectives: Any, grads: np.ndarray, bucket_bytes: int, lanes: int, reps: int, expected: Any
) -> list[float]:
    """Seconds per allreduce of `grads` in buckets of `bucket_bytes` through a BucketPipeline of `lanes` lanes (as
    GradientAllreduce runs them, each bucket on rings of its own), the first call (rings set up) left out."""
    from rdkeras.parallel.collectives import BucketPipeline

    buckets = np.split(grads, range(bucket_bytes // 4, grads.size, bucket_bytes // 4))
    purpose = f"lanes{lanes}/"
    pipeline = BucketPipeline(
        lambda _e, b, arrays: collectives.allreduce(arrays, True, f"{purpose}{b}", compress=True),
        f"bench-{lanes}-lanes",
        engine.timeout,
        prepare=lambda _e, b, arrays: collectives.prepare(arrays, f"{purpose}{b}", compress=True),
        lanes=lanes,
    )
    times = []
    try:
        for call in range(reps + 1):
            engine.barrier()
            started = time.perf_counter()
            for b, bucket in enumerate(buckets):
                pipeline.start(call, b, [bucket])
            last = pipeline.wait(call, len(buckets))[-1][0]
            times.append(time.perf_counter() - started)
            if not np.all(last == expected):
                raise AssertionError(f"{lanes} lane(s): the bucketed allreduce gave {last[:4]}..., not {expected}")
    finally:
        pipeline.close()
    return times[1:]


def _model_and_data(nbytes: int, reps: int, batch: int) -> tuple[Any, np.ndarray]:
    """The Dense width -> hidden -> width model whose two kernels hold `nbytes` of gradients, compiled, and
    reps + 1 batches of inputs."""
    import keras

    width = 2048
    hidden = max(1, int(nbytes / 4 / (2 * width)))  # two width x hidden kernels hold the gradient bytes
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(hidden), keras.layers.Dense(width)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model, np.random.default_rng(0).standard_normal((batch * (reps + 1), width)).astype(np.float32)


def _fit_seconds(model: Any, x: np.ndarray, batch: int, view: Any = None) -> dict[str, list]:
    """Per training step of one epoch of `x` (the first step, tracing, left out): its seconds ("step"), the
    machine's CPU seconds by kind over it ("cpu", :func:`machine_cpu_seconds`), and with `view` (the strategy's
    :class:`rdkeras.introspect.Inspection`) its seconds inside its exchange ops, their work and waits ("inside")."""
    import keras

    out: dict[str, list] = {"step": [], "cpu": [], "inside": []}

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.cpu = machine_cpu_seconds()
            self.exchanged = view.traffic()["exchange_seconds"] if view is not None else 0.0
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            out["step"].append(time.perf_counter() - self.began)
            cpu = machine_cpu_seconds()
            out["cpu"].append({k: cpu[k] - self.cpu[k] for k in cpu})
            if view is not None:
                out["inside"].append(view.traffic()["exchange_seconds"] - self.exchanged)

    model.fit(x, x, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    return {k: v[1:] for k, v in out.items() if v}


def machine_cpu_seconds() -> dict[str, float]:
    """CPU seconds the whole machine has spent so far in user code, in the kernel for processes, and in
    interrupts and softirqs (/proc/stat; the emulated hosts share these cores, their network stack included)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return {"user": (user + nice) / hz, "system": system / hz, "interrupts": (irq + softirq) / hz}


def _step_seconds(
    algorithm: str, nbytes: int, reps: int, overlap_bytes: int | None, compression: str | None
) -> dict[str, Any]:
    import rdkeras
    from rdkeras import introspect

    strategy = rdkeras.RDMAStrategy(algorithm=algorithm, overlap_bytes=overlap_bytes, compression=compression)
    view = introspect.inspect(strategy)
    with strategy.scope():
        model, x = _model_and_data(nbytes, reps, 32)  # the global batch, whatever the number of workers
    timed = _fit_seconds(model, x, 32, view)
    plan = view.plan
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    strategy.close()
    # A strided sample of the weights: enough to compare runs, small enough for JSON.
    return {
        **timed,
        "plan": plan.algorithm if plan else None,
        "weights": weights[::997].tolist(),
    }


def measure(
    rates: list[str | None],
    mb: float,
    reps: int,
    *,
    fit: bool = True,
    overlap_bytes: int | None = None,
    baselines: bool = True,
    timeout: float = 900,
    rounds: int = 1,
) -> dict[str, Any]:
    """Every configuration on each link (None: unshaped), `rounds` times in turn, then one process: {"rows": link ->
    label -> rank 0's figures, each round's appended (and "rounds": each round's median allreduce and step),
    "one_process": ..., "mb", "reps"}; {"skipped": why} where namespaces cannot be made, {"error": ...} where a
    run failed."""
    from rdkeras.bench import run_ranks, run_ranks_on_hosts
    from rdkeras.testing import netns

    why = netns.why_not()
    if why is not None:
        return {"skipped": f"two network namespaces are needed ({why})"}
    nbytes = int(mb * (1 << 20))
    rows: dict[str, dict[str, Any]] = {}
    for rate in rates:
        link = rate or "unshaped"
        with netns.hosts(2, rate=rate) as hosts:
            for label, algorithm, compression, transport in [c for _ in range(rounds) for c in CONFIGS]:
                if label in BASELINES and not baselines:
                    continue
                kwargs = {"algorithm": algorithm, "nbytes": nbytes, "reps": reps, "fit": fit,
                          "overlap_bytes": overlap_bytes, "compression": compression}  # fmt: skip
                env = {"RDKERAS_TRANSPORT": transport} if transport else None
                ranks = run_ranks_on_hosts(
                    "hosts", f"{label} at {link}", "rdkeras.bench.hosts:rank_main", 4, kwargs, hosts, env=env,
                    timeout=timeout,
                )  # fmt: skip
                if ranks is None:
                    return {"error": f"{label} at {link} failed (its output is printed above)"}
                _add_round(rows.setdefault(link, {}).setdefault(label, {"rounds": []}), ranks[0].value)
    one = None
    if fit:  # the same training in one process: what every float32 run must equal
        kwargs = {"algorithm": "auto", "nbytes": nbytes, "reps": reps, "fit": True, "allreduce": False}
        ranks = run_ranks("hosts", "one process", "rdkeras.bench.hosts:rank_main", 1, kwargs, timeout=timeout)
        if ranks is None:
            return {"error": "the one-process run failed (its output is printed above)"}
        one = ranks[0].value
    return {"rows": rows, "one_process": one, "mb": mb, "reps": reps}


# Lists a round appends to.


def run(args: argparse.Namespace) -> int:
    rates = [r or None for r in args.rates.split(",")] if args.rates else [args.rate, None]
    measured = measure(
        rates, args.mb, args.reps, fit=not args.no_fit, overlap_bytes=args.overlap_bytes, rounds=args.rounds,
        baselines=not args.no_baselines, timeout=args.timeout,
    )  # fmt: skip
    if "skipped" in measured or "error" in measured:
        print(f"bench hosts: {measured.get('skipped') or measured.get('error')}")
        return 2 if "skipped" in measured else 1
    _report(measured, args)
    return 0


def _report(measured: dict[str, Any], args: argparse.Namespace) -> None:
    from rdkeras.introspect import EXCHANGE_LANES

    summary = summarize(measured)
    rounds = (
        f" in each of {args.rounds} rounds (speed-ups: the median of the rounds' ratios)" if args.rounds > 1 else ""
    )
    print(f"\n2 hosts x 2 workers (network namespaces), {args.mb:g} MB of float32 gradients; median of {args.reps}"
          f"{rounds}")  # fmt: skip
    for link in measured["rows"]:
        for what in ("allreduce", "step"):
            part = summary.get(f"{link}/{what}")
            if not part:
                continue
            print(f"\n{link}, {what}: seconds (speed-up over the flat ring; bound)")
            for label, sec in part["seconds"].items():
                bound = f"; bound {BOUNDS[label]:g}x" if label in BOUNDS else ""
                print(f"  {label:<14} {sec:8.3f} s ({part['speedup'][label]:.2f}x{bound})")
        bucketed = {label: row for label, row in measured["rows"][link].items() if row.get("buckets_lanes")}
        if bucketed:
            mib = args.overlap_bytes / (1 << 20)
            print(f"\n{link}, the allreduce in {mib:g} MiB buckets (as an overlapped step sends them): seconds "
                  "(x the allreduce in one call)")  # fmt: skip
            for label, row in bucketed.items():
                one = statistics.median(row["allreduce"])
                lanes = [statistics.median(row[k]) for k in ("buckets_one_lane", "buckets_lanes")]
                print(f"  {label:<14} one lane {lanes[0]:.3f} s ({one / lanes[0]:.2f}x), "
                      f"{EXCHANGE_LANES} lanes {lanes[1]:.3f} s ({one / lanes[1]:.2f}x)")  # fmt: skip
        parts = summary.get(f"{link}/parts")
        if parts:
            print(f"\n{link}, where a step goes: step = allreduce + compute alone (4 workers at once) + the rest")
            for label, p in parts.items():
                print(f"  {label:<14} {describe_parts(p)}")
        for label, diff in summary.get(f"{link}/weights", {}).items():
            print(f"  {label}: weights differ from one process's by at most {diff:.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.json").write_text(json.dumps({**measured, "summary": summary}, indent=1))
    print(f"raw figures in {out / 'hosts.json'}")
