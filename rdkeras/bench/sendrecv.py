"""The seed's Send/Recv benchmark: time to move one tensor between two processes.

For each transport (shm, tcp, grpc, and rpc+shm / rpc+tcp: RPC messages over the
same wires) and channel mode (static: one remote write
into a pre-registered slot; dynamic: metadata write, then a remote read), two
processes pinned to separate cores send messages of 1 MB ... 256 MB back to
back, then both send to each other at once (the exchange, what a training step does); 8 B ... 64 KB
messages go in a ping-pong for one-way latency. Single-core
memcpy of the same sizes, timed in the sending process right before each
transfer, is the physical limit. Prints a table, writes JSON and a log-log plot.
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

from rdkeras.bench.figures.common import fmt_size
from rdkeras.bench.figures.sendrecv import plot_rows

MB = 1 << 20
BANDWIDTH_SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
LATENCY_SIZES = [8, 64, 512, 4096, 65536]
GRPC_QUICK_MAX = 64 * MB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repetitions and no 256 MB gRPC (under a minute)")
    p.add_argument("--transports", default="shm,tcp,grpc", help="comma-separated (default: shm,tcp,grpc)")
    p.add_argument("--out", default="bench-results", help="folder for sendrecv.json and sendrecv.png")
    p.add_argument("--timeout", type=float, default=600, help="seconds for each transport's run")
    p.add_argument("--sizes", help="comma-separated message sizes in MB (default: 1,4,16,64,256)")
    p.add_argument("--latency-sizes", help="comma-separated sizes in bytes for the ping-pong (default: 8 ... 65536)")


NATIVE = ("shm", "tcp", "verbs")
# Rough speeds (bytes/s), to give every transport about the same time per round.
SPEED = {"shm": 8e9, "tcp": 2e9, "verbs": 2e9, "grpc": 0.3e9, "rpc+shm": 3e9, "rpc+tcp": 1e9, "rpc+verbs": 1e9}


def _iterations(size: int, transport: str, quick: bool) -> int:
    budget = (0.03 if quick else 0.2) * (0.1 if transport == "grpc" else 1.0)  # seconds per round
    return int(np.clip(budget * SPEED.get(transport, 1e9) / size, 2, 200))


def _pin(rank: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _memcpy_seconds(src: Any, dst: Any, iters: int, nontemporal: bool) -> float:
    from rdkeras import _engine

    t0 = time.perf_counter()
    for _ in range(iters):
        _engine.memcpy(dst, src, nontemporal)  # type: ignore[arg-type]  # numpy's stubs lack __buffer__
    return (time.perf_counter() - t0) / iters


def _pair(eng: Any, name: str, size: int) -> tuple[Any, Any]:
    """Static channels of `size` bytes between ranks 0 and 1, one each way: (this rank's out, its in)."""
    fwd = eng.static_channel(f"{name}-{size}-fwd", 0, 1, (size,), np.uint8)
    bwd = eng.static_channel(f"{name}-{size}-bwd", 1, 0, (size,), np.uint8)
    return (fwd, bwd) if eng.rank == 0 else (bwd, fwd)


def _collectives(eng: Any, sizes: list[int], rounds: int) -> dict[str, list]:
    """By size: one ring allreduce (averaging, as a data-parallel step calls it) of one tensor of x bytes,
    and one parameter-server step (push, reduce, publish, pull) of two tensors of x/2 bytes, one owned by
    each rank -- what a collective costs beyond its transfers (an RPC ring's concatenations and fresh
    arrays, the owners' sums) is in these and not in the exchange."""
    from rdkeras.parallel.parameter_server import ParameterServer

    out: dict[str, list] = {"ring": [], "ps": []}
    for size in sizes:
        grad = np.full(size // 4, 1.0, np.float32)
        # A ring of the capacity training would give these gradients: the RPC rings' frames span the
        # capacity, and a 64 MB call through a 450 MB ring's cold frames took 1.7-9x as long.
        ring = eng.ring(f"calibration-ring-{size}", size + 4096)
        out["ring"].append([size, _median_seconds(eng, f"ring-{size}", rounds, ring, [grad], True)])
        ps = ParameterServer(eng, f"calibration-ps-{size}")
        halves = np.array_split(grad, 2)
        ps.setup([h.shape for h in halves], [np.dtype(np.float32)] * 2)
        out["ps"].append([size, _median_seconds(eng, f"ps-{size}", rounds, _ps_step, ps, halves)])
        ps.close()
        del ps, grad, halves, ring
    return out


def _ps_step(ps: Any, grads: list[np.ndarray]) -> None:
    ps.publish_and_pull(*ps.push_and_reduce(*grads))


def _median_seconds(eng: Any, label: str, rounds: int, step: Any, *args: Any, warmup: int = 2) -> float:
    """The median of `rounds` calls of ``step(*args)`` after `warmup` (first touches of fresh memory, as in
    a training's first steps), the ranks starting each together."""
    times = []
    for r in range(warmup + rounds):
        eng.barrier(f"{label}-{r}")
        t0 = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def rank_main(
    transport: str, quick: bool, sizes: list[int], latency_sizes: list[int], collectives: list[int] | None = None
) -> dict:
    """Runs inside each of the two ranks; rank 0 (the sender) returns the timings (`collectives`: the ring
    and the parameter servers at these sizes too)."""
    import rdkeras

    rounds = 5 if quick else 7
    native = transport in NATIVE
    out: dict[str, Any] = {"bandwidth": [], "exchange": [], "latency": [], "memcpy": [], "memcpy_nt": []}
    with rdkeras.Engine(transport=transport) as eng:
        _pin(eng.rank)
        sender = eng.rank == 0
        done = eng.static_channel("done", 1, 0, (1,), np.uint8)  # "all received": the clock stops
        for mode in ["static", "dynamic"] if native else ["rpc"]:
            for size in sizes:
                _one_way(eng, done, mode, size, _iterations(size, transport, quick), rounds, native, out)
        # Exchange: both ranks send a message to each other at once, as every rank does in a ring step or a
        # parameter-server push/pull; RPC's serialize and parse then share each core with the other side's.
        for size in sizes:
            _exchange(eng, size, _iterations(size, transport, quick), rounds, native, out)
        if collectives:
            out.update(_collectives(eng, collectives, 3))
        # One-way latency: ping-pong over a pair of static channels.
        for size in latency_sizes:
            iters = {"shm": 2000, "tcp": 2000, "rpc+shm": 500, "rpc+tcp": 500}.get(transport, 50)  # verbs: a VM
            _latency(eng, size, iters, rounds, native, out)
    return out if sender else {}


def _one_way(
    eng: Any, done: Any, mode: str, size: int, iters: int, rounds: int, native: bool, out: dict[str, Any]
) -> None:
    """`iters` messages of `size` bytes from rank 0 to rank 1 a round, over a channel of `mode`; on rank 0
    the median round's time per message, and single-core memcpy's of the same size between the rounds."""
    from rdkeras._engine import bench as loops

    sender = eng.rank == 0
    name = f"{mode}-{size}"
    ch: Any  # a static or dynamic channel; the static one's backend end is timed in C++
    if mode == "dynamic":
        ch = eng.dynamic_channel(name, 0, 1)
    else:
        ch = eng.static_channel(name, 0, 1, (size,), np.uint8)
    src = eng.empty(size) if native else np.empty(size, np.uint8)
    src[:] = 7
    # memcpy rounds interleave with transfer rounds, so both see the same machine.
    with_memcpy = sender and native and mode == "static"
    copy_dst = np.zeros(size, np.uint8) if with_memcpy else None
    times, glibc, stream = [], [], []
    for r in range(rounds + 1):  # round 0 warms up (page faults, pool)
        if with_memcpy:
            glibc.append(_memcpy_seconds(src, copy_dst, iters, False))
            stream.append(_memcpy_seconds(src, copy_dst, iters, True))
        eng.barrier(f"{name}-{r}")
        t0 = time.perf_counter()
        if sender:
            if native and mode == "static":
                loops.send_many(ch.channel, src, iters)  # type: ignore[arg-type]
            else:
                for _ in range(iters):
                    ch.send(src)
            done.recv()
            times.append((time.perf_counter() - t0) / iters)
        else:
            if native and mode == "static":
                loops.recv_many(ch.channel, iters)
            else:
                for _ in range(iters):
                    last = ch.recv()
                assert last[0] == 7 and last[-1] == 7, "payload corrupted"
            done.send(np.zeros(1, np.uint8))
    if sender:
        out["bandwidth"].append([mode, size, statistics.median(times[1:])])
    if with_memcpy:
        out["memcpy"].append([size, statistics.median(glibc[1:])])
        out["memcpy_nt"].append([size, statistics.median(stream[1:])])
    if mode == "dynamic" and sender:
        ch.flush()


def _exchange(eng: Any, size: int, iters: int, rounds: int, native: bool, out: dict[str, Any]) -> None:
    """Both ranks send `size` bytes to each other at once, `iters` times a round; rank 0 records the median
    round's time per exchange."""
    tx, rx = _pair(eng, "exchange", size)
    msg = eng.empty(size) if native else np.empty(size, np.uint8)
    msg[:] = 7
    times = []
    for r in range(rounds + 1):
        eng.barrier(f"x-{size}-{r}")
        t0 = time.perf_counter()
        for _ in range(iters):
            tx.send(msg)
            got = rx.recv()
        times.append((time.perf_counter() - t0) / iters)
        assert got[0] == 7 and got[-1] == 7, "payload corrupted"
    if eng.rank == 0:
        out["exchange"].append([size, statistics.median(times[1:])])


def _latency(eng: Any, size: int, iters: int, rounds: int, native: bool, out: dict[str, Any]) -> None:
    """One-way latency of `size`-byte messages: the best round's ping-pong time / 2 (timed in C++ over the
    native transports)."""
    from rdkeras._engine import bench as loops

    sender = eng.rank == 0
    tx, rx = _pair(eng, "ping", size)
    msg = np.ones(size, np.uint8)
    best = float("inf")
    for r in range(rounds + 1):
        eng.barrier(f"lat-{size}-{r}")
        if native:
            seconds = loops.ping_pong(tx.channel, rx.channel, iters, sender)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                if sender:
                    tx.send(msg)
                    rx.recv()
                else:
                    rx.recv()
                    tx.send(msg)
            seconds = time.perf_counter() - t0
        if r:
            best = min(best, seconds / iters / 2)
    if sender:
        out["latency"].append([size, best])


def _engine_threshold() -> str:
    from rdkeras import options

    t = options.from_env().transport_options.nt_threshold  # what the benchmark's engines were given
    return "never" if t == 0 else fmt_size(t)


def measure(
    transports: list[str],
    sizes: list[int],
    latency_sizes: list[int],
    quick: bool,
    timeout: float,
    grpc_max: int | None = None,
    collectives_up_to: int | None = None,
) -> dict[str, dict] | None:
    """Runs the benchmark for each transport (two fresh processes each): {transport: rank 0's timings}.
    gRPC stops at `grpc_max` bytes (None: every size). `collectives_up_to`: the ring and the parameter
    servers too, at the same sizes and at this one where it is larger (the largest gradients trained)."""
    from rdkeras.bench import run_ranks

    results: dict[str, dict] = {}
    for t in transports:
        mine = [s for s in sizes if not (t == "grpc" and grpc_max is not None and s > grpc_max)]
        collectives = None if collectives_up_to is None else sorted({*mine, max([collectives_up_to, *mine])})
        print(f"[sendrecv] {t}: {len(mine)} sizes ...", flush=True)
        ranks = run_ranks(
            "sendrecv",
            t,
            "rdkeras.bench.sendrecv:rank_main",
            2,
            {"transport": t, "quick": quick, "sizes": mine, "latency_sizes": latency_sizes, "collectives": collectives},
            timeout=timeout,
        )
        if ranks is None:
            return None
        results[t] = ranks[0].value
    return results


def rows_of(results: dict[str, dict]) -> list[dict]:
    """One row per (transport, mode, size), with the ratios to memcpy, gRPC and RPC over the same wire."""
    native: dict = next((r for r in results.values() if r["memcpy"]), {"memcpy": [], "memcpy_nt": []})
    memcpy = dict(native["memcpy"])
    memcpy_nt = dict(native["memcpy_nt"])
    grpc = {s: sec for _, s, sec in results.get("grpc", {}).get("bandwidth", [])}
    rpc = {t: {s: sec for _, s, sec in r["bandwidth"]} for t, r in results.items() if t.startswith("rpc+")}
    rows = []
    for t, r in results.items():
        over_rpc = rpc.get(f"rpc+{t}", {})
        for mode, size, sec in r["bandwidth"]:
            rows.append(
                {
                    "transport": t,
                    "mode": mode,
                    "bytes": size,
                    "seconds": sec,
                    "GBps": size / sec / 1e9,
                    "x_memcpy": memcpy[size] / sec if size in memcpy else None,
                    "x_grpc": grpc[size] / sec if size in grpc and t != "grpc" else None,
                    "x_rpc": over_rpc[size] / sec if size in over_rpc else None,
                }
            )
    for label, table in (("glibc", memcpy), ("stream", memcpy_nt)):
        for size, sec in table.items():
            rows.append(
                {
                    "transport": "memcpy",
                    "mode": label,
                    "bytes": size,
                    "seconds": sec,
                    "GBps": size / sec / 1e9,
                    "x_memcpy": memcpy[size] / sec,
                    "x_grpc": grpc[size] / sec if size in grpc else None,
                    "x_rpc": None,
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bandwidth_sizes = [int(float(s) * MB) for s in args.sizes.split(",")] if args.sizes else BANDWIDTH_SIZES
    latency_sizes = [int(s) for s in args.latency_sizes.split(",")] if args.latency_sizes else LATENCY_SIZES
    started = time.time()
    grpc_max = GRPC_QUICK_MAX if args.quick else None
    results = measure(transports, bandwidth_sizes, latency_sizes, args.quick, args.timeout, grpc_max)
    if results is None:
        return 1
    rows = rows_of(results)

    print(f"\nSend/Recv, 2 processes, one message at a time ({time.time() - started:.0f} s)")
    print("memcpy: one core, same sizes, timed in the sender just before its transfers; 'glibc' is")
    print("memcpy(3) (the x memcpy reference), 'stream' uses non-temporal stores as shm does for")
    print(f"messages >= {_engine_threshold()} (RDKERAS_NT_THRESHOLD). 'x RPC': over rpc+<the same transport>.")
    header = (
        f"{'transport':<9} {'mode':<8} {'size':>7} {'ms/transfer':>12} {'GB/s':>7} {'x memcpy':>9} {'x gRPC':>8} "
        f"{'x RPC':>6}"
    )
    print(header + "\n" + "-" * len(header))
    for row in sorted(rows, key=lambda x: (x["bytes"], x["transport"] != "memcpy", x["transport"], x["mode"])):
        xm = f"{row['x_memcpy']:.2f}" if row["x_memcpy"] is not None else "-"
        xg = f"{row['x_grpc']:.1f}" if row["x_grpc"] is not None else "-"
        xr = f"{row['x_rpc']:.2f}" if row["x_rpc"] is not None else "-"
        print(
            f"{row['transport']:<9} {row['mode']:<8} {fmt_size(row['bytes']):>7} {row['seconds'] * 1e3:>12.3f} "
            f"{row['GBps']:>7.2f} {xm:>9} {xg:>8} {xr:>6}"
        )

    print("\nOne-way latency (ping-pong / 2), static channels")
    lat_sizes = latency_sizes
    print(f"{'transport':<9} " + " ".join(f"{fmt_size(s):>9}" for s in lat_sizes))
    for t, r in results.items():
        lat = dict((s, sec) for s, sec in r["latency"])
        print(f"{t:<9} " + " ".join(f"{lat[s] * 1e6:>7.2f}us" for s in lat_sizes))

    _print_targets(rows, results)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    latency = {t: r["latency"] for t, r in results.items()}
    (out / "sendrecv.json").write_text(json.dumps({"rows": rows, "latency": latency, "quick": args.quick}, indent=1))
    plot_rows(rows, out / "sendrecv.png")
    print(f"\nwrote {out / 'sendrecv.json'} and {out / 'sendrecv.png'}")
    return 0


def _print_targets(rows: list[dict], results: dict[str, dict]) -> None:
    """The benchmark's own targets: shm static against memcpy and gRPC, and shm's 8-byte latency."""
    targets = []
    shm_static = [x for x in rows if x["transport"] == "shm" and x["mode"] == "static" and x["x_memcpy"]]
    if shm_static:
        worst = min(shm_static, key=lambda x: x["x_memcpy"])
        targets.append(
            (
                "shm static >= 0.85 x memcpy at 1-256 MB",
                worst["x_memcpy"] >= 0.85,
                f"worst {worst['x_memcpy']:.2f} at {fmt_size(worst['bytes'])}",
            )
        )
        at64 = next((x for x in shm_static if x["bytes"] == 64 * MB and x["x_grpc"]), None)
        if at64:
            targets.append(("shm static >= 20 x gRPC at 64 MB", at64["x_grpc"] >= 20, f"{at64['x_grpc']:.1f}x"))
    if "shm" in results and 8 in dict(results["shm"]["latency"]):
        lat8 = dict(results["shm"]["latency"])[8]
        targets.append(("shm 8-byte one-way latency <= 2 us", lat8 <= 2e-6, f"{lat8 * 1e6:.2f} us"))
    if targets:
        print("\nTargets")
        for what, ok, detail in targets:
            print(f"  [{'met' if ok else 'MISSED'}] {what}: {detail}")
