"""What the paper suite runs inside each worker: the seed's models on synthetic data, timed.

Model sizes come from the recipes' model configs (``conf/model/NAME.yaml``),
optionally overridden; the data is synthetic (random inputs and labels, as
TensorFlow's tf_cnn_benchmarks), shaped from the model. Every worker is pinned
to one core with one TensorFlow thread for math, so per-worker compute is the
same in every configuration and only communication differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import itertools
import os
import time
from typing import Any

import numpy as np

from rdkeras import cluster, introspect, options

SEED_MODELS = ("vgg16", "lstm", "fcn5", "alexnet", "inception_v3", "gru")

# Sizes for the test's tiny run (seconds per configuration, not meaning).
TINY_SIZES: dict[str, dict[str, Any]] = {
    "fcn5": {"input_dim": 256, "hidden": 128},
    "lstm": {"vocab_size": 200, "seq_len": 8, "embed_dim": 16, "hidden": 16},
    "gru": {"vocab_size": 200, "seq_len": 8, "embed_dim": 16, "hidden": 16},
    "vgg16": {"image_size": 32, "width": 0.0625, "fc_units": 64},
    "alexnet": {"image_size": 64, "width": 0.0625},
    "inception_v3": {"image_size": 75},
}


PROBE = {"_target_": "rdkeras.bench.workloads.probe_model"}


def probe_model() -> Any:
    """A 300-parameter MLP: its distributed step minus its local step is the fixed cost of a distributed step
    (the exchange's hops through Python and TensorFlow), which the scale model needs."""
    import keras

    inputs = keras.Input((16,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="fc1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, activation="softmax", name="predictions")(hidden), name="probe")


def model_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recipe's model config (``conf/model/NAME.yaml``) with `overrides` applied."""
    from omegaconf import OmegaConf

    from rdkeras.train.config import config_dirs

    if name == "probe":
        return dict(PROBE)
    path = config_dirs()[0] / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no model config {path.name}; the seed's models are {', '.join(SEED_MODELS)}")
    cfg: dict[str, Any] = OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[assignment]
    assert isinstance(cfg, dict)
    unknown = set(overrides or {}) - set(cfg)
    if unknown:
        raise ValueError(
            f"model {name} has no option(s) {sorted(unknown)}; it has {sorted(k for k in cfg if k[0] != '_')}"
        )
    cfg.update(overrides or {})
    return cfg


def build_model(cfg: dict[str, Any]) -> Any:
    """The Keras model a model config describes (its ``_target_`` called with the other keys)."""
    module, func = cfg["_target_"].rsplit(".", 1)
    return getattr(importlib.import_module(module), func)(**{k: v for k, v in cfg.items() if k != "_target_"})


def synthetic_data(model: Any, samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and class labels shaped for `model` (token ids where its input is an integer)."""
    import keras

    rng = np.random.default_rng(seed)
    inp, out = model.inputs[0], model.outputs[0]
    shape = (samples, *inp.shape[1:])
    x: np.ndarray
    if "int" in str(inp.dtype):
        vocab = next(layer.input_dim for layer in model.layers if isinstance(layer, keras.layers.Embedding))
        x = rng.integers(0, vocab, shape).astype(np.int32)
    else:
        x = rng.random(shape, dtype=np.float32)
    y = rng.integers(0, out.shape[-1], (samples, *out.shape[1:-1])).astype(np.int32)
    return x, y


def forward_flops(model: Any) -> int:
    """Multiply-adds x 2 of one example's forward pass, from the layers' shapes (Dense, Conv2D, LSTM,
    GRU; pooling, normalization and activations are negligible and not counted)."""
    import keras

    total = 0
    for layer in model.layers:
        try:
            ins, outs = layer.input.shape, layer.output.shape
        except (AttributeError, ValueError):
            continue
        if isinstance(layer, keras.layers.Dense):
            positions = int(np.prod(ins[1:-1])) if len(ins) > 2 else 1
            total += 2 * ins[-1] * layer.units * positions
        elif isinstance(layer, keras.layers.Conv2D):
            kh, kw = layer.kernel_size
            total += 2 * kh * kw * ins[-1] * layer.filters * outs[1] * outs[2] // layer.groups
        elif isinstance(layer, (keras.layers.LSTM, keras.layers.GRU)):
            gates = 4 if isinstance(layer, keras.layers.LSTM) else 3
            total += 2 * gates * (ins[-1] + layer.units) * layer.units * ins[1]
    return int(total)


def pin_and_thread(rank: int, inter_op: int) -> None:
    """This worker on one core (rank mod cores), TensorFlow with one math thread."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)


def next_job(strategy: Any, i: int) -> Any:
    """Before closing a strategy: rank 0 picks the next one's rendezvous port and tells everyone; returns the
    cluster to give the next strategy (``RDMAStrategy(cluster=...)``)."""
    from rdkeras.launch import free_port

    mine = str(free_port()).encode() if strategy.worker_index == 0 else None
    (port,) = strategy.engine.exchange(f"next_port/{i}", mine, [0])
    return dataclasses.replace(strategy.cluster, master_port=int(port))


def timed_fit(model: Any, x: Any, y: Any, batch: int, warmup: int, counters: Any = None) -> dict[str, Any]:
    """fit() once over (x, y); the steps after `warmup` are timed, with the traffic over them of `counters` (an
    :class:`rdkeras.introspect.Inspection`, or anything else whose ``traffic()`` counts: an engine).

    ``step_seconds`` is the median step (from one batch's end to the next): robust to the bursts of other
    work on a shared machine, which a mean is not. ``mean_step_seconds`` is the mean.
    """
    import keras

    marks: dict[str, Any] = {"ends": []}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, b: int, logs: Any = None) -> None:
            if b == warmup:
                marks["t0"] = time.perf_counter()
                marks["before"] = counters.traffic() if counters is not None else None

        def on_train_batch_end(self, b: int, logs: Any = None) -> None:
            if b >= warmup - 1:  # the last one wins; epoch-end work stays outside
                marks["ends"].append(time.perf_counter())
            marks["steps"] = b + 1 - warmup

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
    ends = marks["ends"]
    steps = [b - a for a, b in itertools.pairwise(ends)]
    out: dict[str, Any] = {
        "step_seconds": float(np.median(steps)),
        "mean_step_seconds": (ends[-1] - marks["t0"]) / marks["steps"],
        "steps": marks["steps"],
    }
    if counters is not None:
        after = counters.traffic()
        for key in ("bytes_written", "bytes_received", "wait_seconds", "copy_seconds", "wire_seconds",
                    "exchange_seconds"):  # fmt: skip
            if key in after:
                out[f"{key}_per_step"] = (after[key] - marks["before"][key]) / marks["steps"]
    return out


def tensor_bytes(model: Any) -> list[int]:
    """Each trainable variable's float32 gradient bytes (the sum: the bytes a step exchanges)."""
    return [int(np.prod(w.shape)) * 4 for w in model.trainable_weights]


def _compiled(config: dict[str, Any]) -> Any:
    """A throughput run's model, seeded and compiled alike wherever it is timed."""
    import keras

    keras.utils.set_random_seed(1)
    model = build_model(config)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy", jit_compile=False)
    return model


def _mode_groups(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Consecutive runs of one data-parallel mode, in order (each group shares one RDMAStrategy)."""
    groups: list[list[dict[str, Any]]] = []
    for run in runs:
        if groups and groups[-1][0]["mode"] == run["mode"]:
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _time_run(
    run: dict[str, Any], strategy: Any, workers: int, transport: str, warmup: int, steps: int
) -> dict[str, Any]:
    """One run: its model compiled (under `strategy` where distributed), fit timed, and what it measured."""
    if strategy:  # read when the model is attached (None: the transport's default)
        strategy.overlap_bytes = run.get("overlap")
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _compiled(run["config"])
    warm, timed_steps = run.get("warmup", warmup), run.get("steps", steps)
    x, y = synthetic_data(model, run["batch"] * workers * (warm + timed_steps))
    timed = timed_fit(model, x, y, run["batch"] * workers, warm, introspect.inspect(strategy) if strategy else None)
    params = int(model.count_params())
    return {
        **{k: v for k, v in run.items() if k != "config"},
        **timed,
        "rate": 1.0 / timed["step_seconds"],
        "params": params,
        "gradient_bytes": sum(tensor_bytes(model)),
        "tensors": len(model.trainable_weights),
        "tensor_bytes": tensor_bytes(model),
        "forward_flops": forward_flops(model),
        "workers": workers,
        "transport": transport,
    }


def throughput_rank(
    runs: list[dict[str, Any]],
    distributed: bool,
    warmup: int,
    steps: int,
    inter_op: int = 1,
    compute_around: bool = False,
) -> dict:
    """Times model.fit for each run ({"mode", "model", "config", "batch", "overlap"}, and optionally its own
    "warmup" and "steps"), in order.

    `batch` is the per-worker batch (the seed's convention): fit gets the global batch, batch x workers.
    Consecutive runs with the same data-parallel mode share one RDMAStrategy. Returns this rank's results.
    With `compute_around` (distributed), each model is timed without distribution in these same processes
    before and after the runs, every rank at once (``compute_before_s``, ``compute_after_s``, and their mean
    ``compute_s``; time-shared where ranks outnumber cores, as their steps are): the compute of their steps in the
    same minute and processes -- what a prediction of these runs needs on a shared machine, whose speed moves
    by tens of percent from one minute to the next.
    """
    options.quiet_tensorflow_logs(level=3)
    rank = cluster.resolve().rank
    pin_and_thread(rank, inter_op)

    import rdkeras

    results: list[dict[str, Any]] = []
    groups = _mode_groups(runs)
    before = _compute_seconds(runs, warmup, steps) if distributed and compute_around else {}
    transport = "none"
    job = None  # the cluster the next strategy joins (None: the environment's)
    for g, group in enumerate(groups):
        strategy = rdkeras.RDMAStrategy(mode=group[0]["mode"], cluster=job) if distributed else None
        workers = strategy.num_workers if strategy else 1
        transport = strategy.transport if strategy else "none"
        for run in group:
            results.append(_time_run(run, strategy, workers, transport, warmup, steps))
            gc.collect()
        if strategy:
            if g + 1 < len(groups):
                job = next_job(strategy, g)
            strategy.close()
    if before:  # and once more after the runs: their compute is the mean of the two, which bracket them
        after = _compute_seconds(runs, warmup, steps)
        for r in results:
            b, a = before[r["model"]], after[r["model"]]
            r.update(compute_before_s=b, compute_after_s=a, compute_s=(b + a) / 2)
    return {"rank": rank, "results": results}


def _compute_seconds(runs: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, float]:
    """Each run's model timed without distribution, in this process (every rank at once): seconds a step."""
    compute: dict[str, float] = {}
    for run in runs:
        if run["model"] in compute:
            continue
        model = _compiled(run["config"])
        warm, timed_steps = run.get("warmup", warmup), max(3, run.get("steps", steps) // 2)
        x, y = synthetic_data(model, run["batch"] * (warm + timed_steps))
        compute[run["model"]] = timed_fit(model, x, y, run["batch"], warm)["step_seconds"]
        del model, x, y
        gc.collect()
    return compute


def convergence_rank(
    task: str,
    steps: int,
    batch: int,
    distributed: bool,
    limit: int | None = None,
    inter_op: int = 1,
    compression: str | None = None,
) -> dict:
    """Trains a real-data recipe's model for `steps` steps and returns (seconds, loss) after every step.

    task "fashion_mnist_cnn": the 2-conv CNN on Fashion-MNIST (the CIFAR stand-in), loss;
    task "lstm_lm": the character LSTM on Shakespeare (the Seq2Seq stand-in), perplexity = exp(loss).
    `batch` is per worker. Every worker sees the same data in the same order as one process would.
    `compression`: the gradients travel so everywhere (these runs share one host).
    """
    options.quiet_tensorflow_logs(level=3)
    rank = cluster.resolve().rank
    pin_and_thread(rank, inter_op)
    import keras

    import rdkeras
    from rdkeras import data as datasets

    # The exchange after backprop, for every transport alike.
    strategy = (
        rdkeras.RDMAStrategy(overlap_bytes=0, compression=compression, compress_within_hosts=bool(compression))
        if distributed
        else None
    )
    workers = strategy.num_workers if strategy else 1
    global_batch = batch * workers
    if task == "fashion_mnist_cnn":
        data = datasets.fashion_mnist(limit=limit or steps * global_batch)
        cfg = model_config("fashion_cnn")
        lr = 1e-3
    elif task == "lstm_lm":
        data = datasets.shakespeare(limit=limit or steps * global_batch)
        cfg = model_config("char_lm", {"vocab_size": data.info["vocab_size"]})
        lr = 3e-3
    else:
        raise ValueError(f"unknown convergence task {task!r}: fashion_mnist_cnn or lstm_lm")
    n = min(len(data.x), steps * global_batch)
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(1)
        model = build_model(cfg)
        model.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy", jit_compile=False)
    curve: list[tuple[float, float]] = []

    class Curve(keras.callbacks.Callback):
        def on_train_batch_end(self, b: int, logs: Any = None) -> None:
            # Time from the end of the first step: TensorFlow's tracing (seconds, alike for every transport) is
            # not training. The loss Keras logs is the running mean over the epoch.
            now = time.perf_counter()
            if b == 0:
                self.t0 = now
            curve.append((now - self.t0, float(logs["loss"])))

    model.fit(data.x[:n], data.y[:n], batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[Curve()])
    transport = strategy.transport if strategy else "none"
    if strategy:
        strategy.close()
    return {
        "rank": rank,
        "task": task,
        "curve": curve,
        "transport": transport,
        "workers": workers,
        "global_batch": global_batch,
        "samples": n,
        "data": data.description,
    }
