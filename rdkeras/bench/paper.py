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

from rdkeras import options
from rdkeras.bench import clusters, measure, workloads
from rdkeras.bench.analysis import analyze
from rdkeras.bench.labels import MB

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
        "hosts": {"mb": 4, "reps": 2, "rates": [None]},
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
        "hosts": {"mb": 16, "reps": 3, "rates": ["1gbit", None]},
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
        "hosts": {"mb": 64, "reps": 5, "rates": ["1gbit", None]},
        "settle_s": 60,
    },
}
FIGURES = ("sendrecv", "throughput", "convergence", "scalability", "overlap", "hosts")


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


def run(args: argparse.Namespace) -> int:
    options.quiet_tensorflow_logs(level=3)  # the workers inherit it too
    from rdkeras.bench import report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads(Path(args.from_json).read_text()) if args.from_json else _measure(args, out)
    # The models' profiles for the at-scale projections, counted once (a rebuild from JSON reuses them).
    profiles = (results.get("scale_model") or {}).get("at_scale", {}).get("profiles")
    results["scale_model"] = analyze(results)
    results["scale_model"]["at_scale"] = clusters.analyze(profiles)
    _save(results, out)
    text = report.write(results, out)
    print(text)
    print(f"\nwrote {out / 'results.json'}, {out / 'report.md'} and the figures' PNGs")
    return 0


def _measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every figure asked for, in turn, each after the CPUs settle; results.json saved after each."""
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    preset = PRESETS[name]
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = set(figures) - set(FIGURES)
    if unknown:
        raise SystemExit(f"bench paper: unknown figure(s) {sorted(unknown)}; choose from {', '.join(FIGURES)}")
    names = [m.strip() for m in args.models.split(",")] if args.models else preset["models"]
    workers = args.workers or max(2, len(os.sched_getaffinity(0)))
    command = "python -m rdkeras.bench paper" + {"tiny": " --tiny", "quick": " --quick", "full": ""}[name]
    results: dict[str, Any] = {
        "preset": name,
        "command": command,
        "figures": figures,
        "machine": _machine(),
        "python": platform.python_version(),
        "loads": {},
    }
    started = time.time()
    steps = [
        ("sendrecv", lambda: measure.sendrecv(preset, args)),
        ("throughput", lambda: measure.throughput(preset, args, names, workers)),
        ("convergence", lambda: measure.convergence(preset, args, workers)),
        # Before the scalability figure: its 8-worker runs leave a loaded machine behind.
        ("overlap", lambda: measure.overlap(preset, args)),
        ("hosts", lambda: measure.hosts(preset, args)),
        ("scalability", lambda: measure.scalability(preset, args, results.get("throughput"))),
    ]
    for part, take in steps:
        if part not in figures:
            continue
        settled = _settle(preset["settle_s"])
        before = _machine()
        t0 = time.time()
        results[part] = take()
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
        results["emulated"] = measure.emulated(preset, args, names, rate)
    measured = {r["model"] for r in (results.get("throughput") or {}).get("runs", [])} & set(measure.PUBLISHED)
    results["published_models"] = measure.published_models(sorted(measured) or names)
    results["seconds"] = time.time() - started
    return results
