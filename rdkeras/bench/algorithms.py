"""Algorithms: the ring against recursive doubling by tensor size, and what ``algorithm="auto"`` picks.

N worker processes (2 and 4 by default) sum one float32 tensor of 256 B ... 4 MB with each engine algorithm,
side by side in one run, on each transport. Printed per size: both times, the faster one, ``auto``'s pick (from
the transport's per-message and per-byte costs in its spec, not from this run) and auto's time over the best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from rdkeras import transports

SIZES = [256, 4 << 10, 32 << 10, 128 << 10, 512 << 10, 4 << 20]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="shm,tcp", help="comma-separated engine transports")
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--out", default="bench-results", help="folder for algorithms.json")


def rank_main(sizes: list[int], rounds: int) -> dict:
    """Times each algorithm at each size (medians of `rounds` rounds); rank 0 returns them."""
    import rdkeras
    from rdkeras.parallel.collectives import Collectives

    out: dict[str, dict[str, float]] = {}
    with rdkeras.Engine() as eng:
        ring = Collectives(eng, 64 << 20, algorithm="ring", name="r/")
        doubling = Collectives(eng, 64 << 20, algorithm="doubling", name="d/")
        auto = Collectives(eng, 64 << 20, algorithm="auto", name="a/")
        auto.algorithm  # noqa: B018 (collective: sets the threshold)
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            iters = int(np.clip(2e7 / max(size, 4 << 10), 5, 400))
            for name, coll in (("ring", ring), ("doubling", doubling)):
                (y,) = coll.allreduce([x], average=False)  # set up, pages touched
                assert y[0] == eng.world_size and y[-1] == eng.world_size, (name, y[:4])
                times = []
                for _ in range(rounds):
                    eng.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        coll.allreduce([x], average=False)
                    times.append((time.perf_counter() - t0) / iters)
                out.setdefault(str(size), {})[name] = statistics.median(times)
        out["auto_below"] = {"bytes": float(auto.doubling_below)}
    return out if eng.rank == 0 else {}


def run(args: argparse.Namespace) -> int:
    from rdkeras.bench import run_ranks

    results: dict[str, dict] = {}
    misses = []
    for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
        if not transports.get(transport).capabilities.composes_rings:
            print(f"[algorithms] {transport}: a baseline with a flat ring of its own; skipped")
            continue
        for n in [int(w) for w in args.workers.split(",")]:
            label = f"{transport}, {n} workers"
            print(f"[algorithms] {label} ...", flush=True)
            kwargs = {"sizes": SIZES, "rounds": 3 if args.quick else 5}
            env = {"RDKERAS_TRANSPORT": transport}
            ranks = run_ranks("algorithms", label, "rdkeras.bench.algorithms:rank_main", n, kwargs, env=env)
            if ranks is None:
                return 1
            value = ranks[0].value
            below = int(value.pop("auto_below")["bytes"])
            results[label] = {"sizes": value, "auto_below": below}
            print(f"\nAllreduce of one float32 tensor, {label} (auto: recursive doubling below {below:,} bytes)")
            print(f"{'bytes':>10} {'ring':>10} {'doubling':>10} {'faster':>9} {'auto':>9} {'auto/best':>9}")
            for size in SIZES:
                t = value[str(size)]
                best = min(t, key=t.get)
                pick = "doubling" if size + 64 < below else "ring"
                ratio = t[pick] / t[best]
                print(
                    f"{size:>10,} {t['ring'] * 1e6:>8.1f}us {t['doubling'] * 1e6:>8.1f}us {best:>9} {pick:>9} "
                    f"{ratio:>8.2f}x"
                )
                if ratio > 1.25:
                    misses.append(f"{label}, {size:,} bytes: auto picks {pick}, {ratio:.2f}x the {best}")
    print("\nauto within 1.25x of the faster algorithm at every size: " + ("yes" if not misses else "NO"))
    for m in misses:
        print(f"  {m}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "algorithms.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'algorithms.json'}")
    return 0
