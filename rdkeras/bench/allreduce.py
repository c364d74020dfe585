"""Allreduce: rdkeras's ring (every transport) vs TensorFlow's and PyTorch's collectives.

Two worker processes, each pinned to its own core, sum a float32 tensor of
1 ... 64 MB. Reported per backend:
time per allreduce and algorithmic bandwidth (tensor bytes / time). Baselines:
TensorFlow's MultiWorkerMirroredStrategy collective (its gRPC ring; no Keras
involved, so no patching) and torch.distributed's gloo where torch is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from rdkeras import cluster, options

MB = 1 << 20
SIZES = [1 * MB, 4 * MB, 16 * MB, 40 * MB, 64 * MB]
LABEL = {
    "shm": "rdkeras shm",
    "tcp": "rdkeras tcp",
    "grpc": "rdkeras grpc",
    "rpc+shm": "RPC over shm",
    "rpc+tcp": "RPC over tcp",
    "tf-grpc": "TF MWMS (gRPC ring)",
    "gloo": "torch gloo",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument(
        "--backends",
        default="shm,tcp,rpc+shm,grpc,tf-grpc,gloo",
        help="comma-separated: rdkeras transports (shm, tcp, rpc+shm, rpc+tcp, grpc, ...), tf-grpc, gloo",
    )
    p.add_argument("--out", default="bench-results", help="folder for allreduce.json")
    p.add_argument("--timeout", type=float, default=900)


def _iters(backend: str, size: int, quick: bool) -> int:
    speed = {"shm": 8e9, "tcp": 1.5e9, "rpc+shm": 2e9, "rpc+tcp": 0.8e9}.get(backend, 0.15e9)
    return int(np.clip((0.1 if quick else 0.4) * speed / size, 2, 50))


def rank_main(backend: str, sizes: list[int], quick: bool, gloo_port: int = 0) -> dict:
    """Runs in each worker; rank 0 returns median seconds per allreduce for every size."""
    rounds = 3 if quick else 5
    place = cluster.resolve()
    rank = place.rank
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:  # every backend alike: one core per worker
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    if backend == "tf-grpc":
        out = _tf_seconds(sizes, quick, rounds)
    elif backend == "gloo":
        out = _gloo_seconds(sizes, quick, rounds, rank, place.world_size, gloo_port)
    else:  # an rdkeras transport
        out = _rdkeras_seconds(backend, sizes, quick, rounds)
    return {str(k): v for k, v in out.items()} if rank == 0 else {}


def _rdkeras_seconds(backend: str, sizes: list[int], quick: bool, rounds: int) -> dict[int, float]:
    import rdkeras

    out = {}
    with rdkeras.Engine(transport=backend) as eng:
        ring = eng.ring("bench", max(sizes) + 4096)
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            ring([x])
            times = []
            for _ in range(rounds):
                eng.barrier()
                t0 = time.perf_counter()
                for _ in range(_iters(backend, size, quick)):
                    (y,) = ring([x])
                times.append((time.perf_counter() - t0) / _iters(backend, size, quick))
            assert y[0] == eng.world_size and y[-1] == eng.world_size
            out[size] = statistics.median(times)
    return out


def _tf_seconds(sizes: list[int], quick: bool, rounds: int) -> dict[int, float]:
    """TensorFlow's MultiWorkerMirroredStrategy ring (its gRPC collective), no Keras involved."""
    options.quiet_tensorflow_logs(level=3)
    import tensorflow as tf

    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    out = {}
    for size in sizes:
        with strategy.scope():
            x = tf.Variable(tf.ones([size // 4], tf.float32))

        def reduce(x=x):
            return tf.distribute.get_replica_context().all_reduce("sum", x.read_value())

        @tf.function
        def step():
            return strategy.experimental_local_results(strategy.run(reduce))[0]

        step().numpy()
        times = []
        for _ in range(rounds):
            step().numpy()  # also a barrier
            t0 = time.perf_counter()
            n = _iters("tf-grpc", size, quick)
            for _ in range(n):
                y = step()
            y = y.numpy()
            times.append((time.perf_counter() - t0) / n)
        assert y[0] == 2
        out[size] = statistics.median(times)
    return out


def _gloo_seconds(sizes: list[int], quick: bool, rounds: int, rank: int, world: int, port: int) -> dict[int, float]:
    """torch.distributed's gloo allreduce."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    out = {}
    for size in sizes:
        x = torch.ones(size // 4)
        dist.all_reduce(x)
        times = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            n = _iters("gloo", size, quick)
            for _ in range(n):
                x.fill_(1.0)
                dist.all_reduce(x)
            times.append((time.perf_counter() - t0) / n)
        out[size] = statistics.median(times)
    dist.destroy_process_group()
    return out


def _env_for(backend: str) -> tuple[dict, list[dict] | None]:
    from rdkeras.launch import free_port

    if backend == "tf-grpc":
        ports = [free_port(), free_port()]
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        return {}, [
            {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})} for i in range(2)
        ]
    return {}, None


def _print(results: dict[str, dict[int, float]]) -> None:
    """The table of every backend's times, shm's speed-up over each, and the targets."""
    print("\nAllreduce of one float32 tensor, 2 workers (algbw = bytes / time)")
    header = f"{'backend':<20} " + " ".join(f"{s // MB:>5} MB        " for s in SIZES)
    print(header + "\n" + "-" * len(header))
    for b, r in results.items():
        print(f"{LABEL.get(b, b):<20} " + " ".join(f"{r[s] * 1e3:7.2f}ms {s / r[s] / 1e9:5.2f}" for s in SIZES))
    if "shm" in results:
        print("\nrdkeras shm speed-up (time ratio)")
        for b in ("tf-grpc", "gloo", "tcp", "rpc+shm", "rpc+tcp", "grpc"):
            if b in results:
                print(
                    f"  vs {LABEL.get(b, b):<20} "
                    + " ".join(f"{results[b][s] / results['shm'][s]:8.1f}x" for s in SIZES)
                )
        targets = []
        if "tf-grpc" in results:
            x = results["tf-grpc"][40 * MB] / results["shm"][40 * MB]
            targets.append((">= 10x TF's gRPC collective at 40 MB", x >= 10, f"{x:.1f}x"))
        if "gloo" in results:
            x = min(results["gloo"][s] / results["shm"][s] for s in SIZES)
            targets.append((">= 1.0x gloo at every size", x >= 1.0, f"worst {x:.1f}x"))
        if targets:
            print("\nTargets")
            for what, ok, detail in targets:
                print(f"  [{'met' if ok else 'MISSED'}] {what}: {detail}")


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks
    from rdkeras.launch import free_port

    results: dict[str, dict[int, float]] = {}
    notes = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "gloo":
            try:
                import torch.distributed  # noqa: F401
            except ImportError:
                notes.append("gloo: skipped (torch is not installed; pip install torch)")
                continue
        print(f"[allreduce] {backend} ...", flush=True)
        env, per_rank = _env_for(backend)
        ranks = run_ranks(
            "allreduce",
            backend,
            "rdkeras.bench.allreduce:rank_main",
            2,
            {"backend": backend, "sizes": SIZES, "quick": args.quick, "gloo_port": free_port()},
            env=env,
            per_rank_env=per_rank,
            timeout=args.timeout,
        )
        if ranks is None:
            return 1
        results[backend] = {int(k): v for k, v in ranks[0].value.items()}

    _print(results)
    for n in notes:
        print(n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allreduce.json").write_text(
        json.dumps({b: {str(k): v for k, v in r.items()} for b, r in results.items()}, indent=1)
    )
    print(f"\nwrote {out / 'allreduce.json'}")
    return 0
