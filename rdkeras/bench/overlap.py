"""Communication overlapping backprop, on an emulated network where the wire (not the CPU) is the limit.

Two workers in two network namespaces joined by a veth pair capped with ``tc tbf`` (rdkeras.testing.netns),
transport tcp, 250 Mbit/s by default (``rate``): slow enough that the wire, not the CPU the communication itself
needs (the kernel's TCP copies, the ring's sums, the waiting thread's wake-ups, all on the core that computes),
is the limit. Measured on the Intel Xeon VM: six 1024-wide layers on 1024 inputs at 500 Mbit/s, the overlapped
step was 1.23 x max(compute, communication), the last bucket about 0.1 x of it and that CPU most of the rest;
eight at 250 Mbit/s (the batch, and so the compute, about twice as large for the same bytes), 1.13-1.22 x,
0.2 s of it the last bucket.
The model is an MLP of eight equal 1024-wide layers (``width``) on 256 input features (a quarter of the
width), a gradient bucket per layer (4 MB, collectives.BUCKET_BYTES, at that width): every bucket is ready
at a different point of the backward pass, and the first layer's, the last one backprop produces -- what no
overlap can hide, the least an overlapped step exceeds the compute by -- is the smallest, as in most
networks (a quarter of the others: with 1024 inputs it was as large as they and left 0.2 s exposed).
The workers choose the per-worker batch from their own compute times at two batch sizes, then at the one
a line through them gives (a line through the nearest two decides), so that one step's gradient bytes take
about 0.6 x one step's compute on the wire: similar sizes, the communication no longer than the backward
pass it can hide behind. The quick run halves the width: a quarter of the bytes and of the compute.

Measured in the same two processes, one after another: compute alone (the same model without
distribution), communication alone (the same bucketed ring allreduces without the model), then training
with the exchange after the backward pass and with it overlapped (allreduce and parameter servers),
alternately, twice each, and compute alone again (the better of each pair counts).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from rdkeras import cluster, options

WIDTH, LAYERS = 1024, 8  # the full run's; the quick one halves the width (a quarter of the bytes and compute)
BATCH = 256  # BATCH and 4 x BATCH: the batch sizes the workers time first (smaller ones underrate the slope)
TARGET_COMM_SHARE = 0.6  # communication / compute, by the choice of the batch
MAX_RATE = 2.5e8  # rate="auto": 250 Mbit/s


def _features(width: int) -> int:
    return max(1, width // 4)


def _model(width: int) -> Any:
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((_features(width),), name="features")
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(width, activation="relu", name=f"fc{i + 1}")(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="overlap_mlp")


def _compile(model: Any) -> Any:
    import keras

    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def _fit_seconds(model: Any, batch: int, steps: int, warmup: int = 3) -> float:
    from rdkeras.bench.workloads import timed_fit

    rng = np.random.default_rng(0)
    x = rng.random((batch * (steps + warmup), model.input_shape[-1]), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    return timed_fit(model, x, y, batch, warmup)["step_seconds"]


def _toward(timed: dict[int, float], goal: float) -> int:
    """The batch (a multiple of 16) whose step takes `goal` seconds, on the line through the two timed
    batches nearest to it."""
    (b0, t0), (b1, t1) = sorted(timed.items(), key=lambda kv: abs(kv[1] - goal))[:2]
    per_example = max(1e-9, (t1 - t0) / (b1 - b0)) if b1 != b0 else t0 / b0
    return int(math.ceil(max(16.0, b0 + (goal - t0) / per_example) / 16) * 16)


def _propose_batch(model: Any, steps: int, goal: float) -> tuple[float, dict[str, Any]]:
    """The batch whose step this process computes in `goal` seconds, from its times at two batch sizes and
    then at the one they point to; and those times."""
    t = {b: _fit_seconds(model, b, max(3, steps // 2)) for b in (BATCH, 4 * BATCH)}
    # Then once more through the batch that proposes: the time per example changes with the batch as
    # activations outgrow the caches (one line from 256 and 1024 rows to ~4000 was a third off either way).
    first = _toward(t, goal)
    t[first] = _fit_seconds(model, first, max(3, steps // 2))
    return float(_toward(t, goal)), {"compute_s": {str(b): v for b, v in t.items()}, "goal_compute_s": goal}


def _comm_alone(strategy: Any, model: Any, bucket_bytes: int, steps: int) -> tuple[float, int]:
    """The median time of one step's bucketed ring allreduces without the model (after two), and the buckets."""
    from rdkeras.parallel import collectives

    grads = [np.zeros(w.shape, np.float32) for w in model.trainable_weights]
    coll = strategy.collectives
    buckets = collectives.reverse_buckets([a.nbytes for a in grads], bucket_bytes)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        for b, members in enumerate(buckets):
            coll.allreduce([grads[i] for i in members], True, purpose=f"grads{b}")
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:])), len(buckets)


def overlap_rank(steps: int, batch: int = 0, rate_bits: float = MAX_RATE, width: int = WIDTH) -> dict:
    """Inside each of the two workers (see the module docstring). `batch` 0: the per-worker batch is chosen
    here, from this process's own compute times at two batch sizes and the one they point to, so that one
    step's gradient bytes take TARGET_COMM_SHARE x the compute on a link of `rate_bits`; the workers agree
    on the larger choice."""
    options.quiet_tensorflow_logs(level=3)
    from rdkeras.bench.workloads import next_job, pin_and_thread, tensor_bytes

    rank = cluster.resolve().rank
    pin_and_thread(rank, 2)  # the start ops need an executor thread beside the one running backprop
    import rdkeras
    from rdkeras import introspect
    from rdkeras.parallel import collectives

    out: dict[str, Any] = {"rank": rank}
    model = _compile(_model(width))
    bucket_bytes = width * width * 4  # a bucket per layer, as the product's 4 MB buckets give at width 1024
    gradient_bytes = sum(tensor_bytes(model))
    proposal = float(batch)
    if not batch:
        proposal, out["calibration"] = _propose_batch(model, steps, gradient_bytes * 8 / rate_bits / TARGET_COMM_SHARE)
    jobs = iter(range(10))
    strategy = rdkeras.RDMAStrategy()
    (agreed,) = strategy.collectives.allreduce([np.array([proposal, -proposal])], average=False)
    batch = int(math.ceil(max(proposal, -float(agreed[1]) - proposal) / 16) * 16)  # the larger proposal
    job = next_job(strategy, next(jobs))
    strategy.close()
    out["batch"], out["gradient_bytes"] = batch, gradient_bytes
    out["compute_s"] = _fit_seconds(model, batch, steps)
    for mode in ("allreduce", "ps"):
        strategy = rdkeras.RDMAStrategy(mode=mode, cluster=job)
        workers = strategy.num_workers
        if mode == "allreduce":  # the same bucketed ring calls the overlapped step makes, without the model
            out["comm_s"], out["buckets"] = _comm_alone(strategy, model, bucket_bytes, steps)
        for _trial in range(2):
            for label, bucket in (("sequential", 0), ("overlapped", bucket_bytes)):
                strategy.overlap_bytes = bucket
                existing = set(map(id, collectives.pipelines()))
                with strategy.scope():
                    distributed = _compile(_model(width))
                seconds = _fit_seconds(distributed, batch * workers, steps)
                key = f"{mode}_{label}_s"
                if seconds < out.get(key, float("inf")):
                    out[key] = seconds
                    mine = [p for p in collectives.pipelines() if id(p) not in existing]
                    if mine:
                        out[f"{mode}_breakdown"] = _breakdown(list(mine[0].timeline)[-steps:])
        out[f"{mode}_traffic"] = introspect.inspect(strategy).traffic()
        if mode == "allreduce":
            job = next_job(strategy, next(jobs))
        strategy.close()
    # Compute alone once more, after the trainings: like them, the better of two (this machine's speed
    # moves by tens of percent from one minute to the next).
    out["compute_s"] = min(out["compute_s"], _fit_seconds(model, batch, steps))
    return out


def _breakdown(timeline: list[list[float]]) -> dict[str, float]:
    """Medians over steps of where the overlapped exchange's time went (BucketPipeline.timeline)."""
    if not timeline:
        return {}
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "comm_work_s": med([m[4] for m in timeline]),  # the buckets' allreduces (or pushes), end to end
        "first_start_to_wait_s": med([m[2] - m[0] for m in timeline]),  # backprop left after bucket 0 was ready
        "exposed_s": med([m[3] - m[2] for m in timeline]),  # the wait op blocked: not hidden
        "hidden_s": med([max(0.0, m[1] - m[0]) for m in timeline]),  # done before the wait began
    }


def _bits(rate: str) -> float:
    """tc's rate units ("1gbit", "500mbit", "100kbit") in bits/s."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"rate {rate!r}: use tc's units, e.g. 1gbit or 500mbit")


def measure(steps: int, rate: str | None, delay: str | None, timeout: float, width: int = WIDTH) -> dict[str, Any]:
    """The overlap figure: two namespaces, a `rate` link (auto: 250 Mbit/s); the workers measure everything."""
    from rdkeras.bench import run_ranks_on_hosts
    from rdkeras.testing import netns

    why = netns.why_not()
    if why:
        return {"skipped": f"no emulated network here: {why}"}
    model = f"MLP {_features(width)}-{width}x{LAYERS}"
    out: dict[str, Any] = {"model": model, "workers": 2, "transport": "tcp", "delay": delay}
    batch = 0  # chosen by the workers from their own compute times
    if rate in (None, "", "auto"):
        rate = f"{round(MAX_RATE / 1e6)}mbit"
    bits = _bits(rate)
    out["rate"] = rate
    try:
        with netns.hosts(2, rate=rate, delay=delay) as hosts:
            print(f"[paper] overlap: 2 workers in 2 namespaces, tcp over a {rate} link ...", flush=True)
            ranks = run_ranks_on_hosts(
                "paper",
                "overlap",
                "rdkeras.bench.overlap:overlap_rank",
                2,
                {"steps": steps, "batch": batch, "rate_bits": bits, "width": width},
                hosts,
                env={"RDKERAS_TRANSPORT": "tcp"},
                timeout=timeout,
            )
    except netns.NetnsError as e:
        return {**out, "skipped": str(e)}
    if ranks is None:
        return {**out, "error": "the overlap run failed (its output is above)"}
    values = [r.value for r in ranks]
    out["per_worker_batch"] = values[0]["batch"]
    out["calibration"] = values[0].get("calibration")
    merged = {k: max(v[k] for v in values) for k in values[0] if k.endswith("_s")}  # the slower worker's
    out.update(merged, buckets=values[0].get("buckets"), per_rank=values)
    for mode in ("allreduce", "ps"):
        out[f"{mode}_breakdown"] = values[0].get(f"{mode}_breakdown", {})
    c, m = out["compute_s"], out["comm_s"]
    out["sum_s"], out["max_s"] = c + m, max(c, m)
    for mode in ("allreduce", "ps"):
        out[f"{mode}_overlapped_x_max"] = out[f"{mode}_overlapped_s"] / out["max_s"]
        out[f"{mode}_sequential_x_sum"] = out[f"{mode}_sequential_s"] / out["sum_s"]
    return out
