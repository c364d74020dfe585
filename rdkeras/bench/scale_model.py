"""A calibrated scale model: step time and throughput of data-parallel training on a described cluster.

Its inputs are what ``python -m rdkeras.bench paper`` measured here (``results.json``):

- per transport, from Send/Recv: the measured time per transfer at each message size, interpolated
  between sizes (a transport's cost per byte depends on the size: gRPC's halves from 4 to 64 MB, caches
  help the copies of small messages), and its summary as a per-message cost ``a`` (s) and a per-byte cost
  ``b`` (s/B), which the projection uses; the same curve for an exchange (both ranks send at once, as in
  every step of a ring or a parameter-server push or pull: an RPC's serialize and parse then share each
  core with the other direction's), which the predictions here use; memcpy's per-byte cost on one core;
  one ring allreduce and one parameter-server step between two workers, by size;
- per model, from the runs without communication: compute time per step with every core computing at
  once (one process per core, as in a distributed run: they share caches and memory bandwidth, up to
  35% slower here than one process alone), gradient bytes and tensors, forward FLOPs per example.

Step time (no overlap; one data-parallel step of N workers, gradient bytes G, in ``buckets`` pieces;
``t(x)`` the time of one exchange of x bytes each way, ``a + b·x`` where only the summary is known):

- ring allreduce: ``compute + 2(N-1)·buckets·t(G/(N·buckets)) + (N-1)/N·G·c`` (2(N-1) sequential ring
  steps of G/N bytes each; the reduction reads every received chunk once: c = memcpy's cost per byte);
- parameter servers sharded over the N workers, the variables dealt out as the servers deal them
  (``owned_o`` the bytes rank o serves): ``compute + max_r Σ_{i not r's} t(s_i) + max_o owned_o·(N-1)·c +
  max_r (Σ_{o≠r} t(owned_o) + (G - owned_r)·c) + 2(N-1)·t(0)`` (every worker pushes its gradient of each
  variable another rank owns, a message each, and a flag; the owners add N contributions; every worker
  reads each other owner's shard in one message and assigns it);
- plus, for both, what the collective costs beyond those transfers and sums, measured by size between
  two workers (``beyond_transfers``: an RPC ring's concatenations and fresh arrays, a server's copies).

Here every byte moves by CPU (no NIC), so with more workers than cores each worker gets cores/N of one:
communication is scaled by N/cores, and compute is measured so (every rank computing at once).

The projection replaces this machine's parts by the described cluster's (``Testbed``): compute from the
model's FLOPs at a GPU's sustained rate; rdkeras's per-byte cost by the RDMA link's (the NIC moves the
bytes from host memory), plus the PCIe copies its numpy_function hops make today -- the gradients off the
GPU before the exchange and the averages back after it, which no overlap hides (charged until a path
without host staging exists); RPC over RDMA by the link plus the copies the RPC layer adds (measured here
as rpc+shm minus shm, scaled by the two machines' memcpy speeds) plus a PCIe copy off the GPU; gRPC over
TCP by its per-byte CPU cost here, scaled the same way, plus the TCP link. It is a model of where the time
goes, not of contention: it ignores incast at parameter servers, congestion and stragglers, which make real
clusters slower at scale.

On clusters of GPU servers (``rdkeras_step``, ``horovod_step``; rdkeras.bench.clusters applies them), from
cited constants alone: each allreduce algorithm's steps priced by the hops they cross -- through a server's
NIC, which its GPUs share, or inside it over shared memory -- with the sums on a CPU core (rdkeras) or on
the GPU (NCCL, by NVIDIA's own cost model); gradients appear during backprop in its layers' order and at
the times their FLOPs say, and are fused into buckets (rdkeras: fixed 4 MiB ones, in passes of at most
64 MiB, the hierarchical allreduce's shorter and pipelined, each bucket's sums back on the GPU while the
next buckets are exchanged; Horovod: whatever exists when its thread is free, up to 64 MB), one allreduce
at a time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rdkeras.bench.cluster_model import (  # noqa: F401 (these names are the scale model's too)
    ALGORITHMS,
    MB,
    NCCL_BASE_S,
    NCCL_NET_STEP_S,
    NCCL_PCI_STEP_S,
    NCCL_PLATEAU,
    PART_LABELS,
    PARTS,
    Hops,
    Step,
    _parts,
    allreduce_parts,
    doubling_below,
    doubling_parts,
    gradient_buckets,
    hierarchical_parts,
    hierarchical_seconds,
    horovod_step,
    nccl_ring_parts,
    pick_algorithm,
    rdkeras_step,
    ring_parts,
    staging_seconds,
)
from rdkeras.parallel.parameter_server import deal


@dataclass(frozen=True)
class Testbed:
    """The cluster to project to. Defaults: the seed's (8 servers, a P100 each, 100 Gb/s InfiniBand).

    ``workers`` GPUs in all, ``gpus_per_server`` of them in each server, which share its one NIC."""

    workers: int = 8
    gpu_tflops: float = 9.3  # P100 PCIe fp32 peak (NVIDIA Tesla P100 datasheet; SXM2: 10.6)
    # Sustained share of the peak in training for the projection's every model (cuDNN/cuBLAS, batch 32); not
    # cited -- the models measured by TensorFlow's P100 benchmarks range 46-59% (135% for VGG-16's Winograd
    # convolutions), which the at-scale projections (rdkeras.bench.clusters) use per model instead.
    gpu_efficiency: float = 0.35
    link_gbps: float = 100.0  # InfiniBand EDR (one NIC a server)
    # One RDMA write plus its flag; NCCL's own model charges 2.7 us for its low-latency ring step across the
    # network (NVIDIA/nccl src/graph/tuning.cc at 01afd20, hwLat[NET][Ring][LL]).
    rdma_latency_s: float = 3e-6
    tcp_gbps: float = 25.0  # TCP over the same fabric (IPoIB), what gRPC.TCP gets before its CPU costs
    # One Xeon core's memcpy (the reductions, the shared-memory copies inside a server): glibc memcpy measured
    # 8.9-15.1 GB/s on one core of this project's 2.8 GHz Xeon (README, micro-benchmarks); the lower end.
    memcpy_gb_per_s: float = 8.0
    # GPU <-> host over PCIe 3.0 x16: CUDA's bandwidthTest on a P100 PCIe, pinned memory, 11.7 GB/s host to
    # device and 12.9 GB/s back (microway.com, "NVIDIA Tesla P100 PCI-E 16GB GPU Accelerator Up Close").
    pcie_gb_per_s: float = 12.0
    gpus_per_server: int = 1
    # A step between two workers of one server over shared memory: shm's one-way 8-byte latency measured on
    # this project's machine (README, micro-benchmarks).
    shm_latency_s: float = 0.32e-6

    @property
    def gpu_flops(self) -> float:
        return self.gpu_tflops * 1e12 * self.gpu_efficiency

    @property
    def servers(self) -> int:
        return max(1, self.workers // self.gpus_per_server)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (a, b) of y = a + b·x, with a >= 0."""
    n = len(points)
    if n == 1:
        x, y = points[0]
        return 0.0, y / x
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else my / mx
    a = my - b * mx
    if a < 0:  # a line through the origin fits better than a negative latency
        b = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        a = 0.0
    return a, b


def calibrate(sendrecv: dict[str, Any]) -> dict[str, Any]:
    """Per transport (a, b) from the Send/Recv rows and latencies; memcpy's per-byte cost."""
    rows = sendrecv["rows"]
    costs: dict[str, dict[str, Any]] = {}
    for t in sorted({r["transport"] for r in rows if r["transport"] != "memcpy"}):  # (the same order every run)
        mode = "static" if any(r["transport"] == t and r["mode"] == "static" for r in rows) else "rpc"
        points = [(r["bytes"], r["seconds"]) for r in rows if r["transport"] == t and r["mode"] == mode]
        latency = dict(sendrecv["latency"].get(t, []))
        small = min(latency) if latency else None
        if small is not None:
            points.append((small, latency[small]))
        a, b = fit_line(points)
        if small is not None:
            a = latency[small]  # the ping-pong is the better measure of a message's fixed cost
            big = [(x, y) for x, y in points if x >= MB]
            b = sum((y - a) for _, y in big) / sum(x for x, _ in big) if big else b
        both = [(x, y) for x, y in sendrecv.get("exchange", {}).get(t, [])]  # JSON pairs as tuples
        if both and small is not None:  # a tiny exchange costs a message's latency, as a tiny transfer does
            both.append((small, latency[small]))
        costs[t] = {
            "a": a,
            "b": b,
            "GBps": 1 / b / 1e9,
            "latency_us": a * 1e6,
            "points": sorted(points),
            "exchange_points": sorted(both),
        }
    memcpy = [r for r in rows if r["transport"] == "memcpy" and r["mode"] == "glibc" and r["bytes"] >= MB]
    c = sum(r["seconds"] for r in memcpy) / sum(r["bytes"] for r in memcpy) if memcpy else 1 / 10e9
    for t, measured in sendrecv.get("collectives", {}).items():
        if t in costs:
            costs[t]["beyond_transfers"] = _beyond_transfers(measured, costs[t], c)
    return {"transports": costs, "memcpy_per_byte": c}


def _beyond_transfers(measured: dict[str, list], cost: dict[str, Any], c: float) -> dict[str, list]:
    """Per collective ("ring", "ps"), by size: what one call of it between two workers took beyond what
    its transfers and sums predict (measured minus comm_seconds; an RPC ring's concatenations and fresh
    arrays, the owners' copies), in seconds (negative where the collective beat the prediction)."""
    t = lambda nbytes: transfer_seconds(cost, nbytes, both_ways=True)  # noqa: E731
    out: dict[str, list] = {}
    for kind, points in measured.items():
        mode = "allreduce" if kind == "ring" else "ps"
        rows = []
        for x, seconds in points:
            halves = [x // 2, x - x // 2]  # the calibration's tensors: one (ring), one per rank (ps)
            predicted = comm_seconds(
                mode, 2, x, 1 if kind == "ring" else 2, 1, t, c, None if kind == "ring" else halves
            )
            rows.append([x, seconds - predicted])
        out[kind] = rows
    return out


def beyond_transfers(cost: dict[str, Any], mode: str, nbytes: float) -> float:
    """The collective's cost beyond its transfers for `nbytes` of gradients (0 where not calibrated):
    interpolated between the calibrated sizes, in proportion to the bytes outside them, never below 0."""
    points = cost.get("beyond_transfers", {}).get("ring" if mode == "allreduce" else "ps") or []
    if not points:
        return 0.0
    if nbytes <= points[0][0]:
        return max(0.0, points[0][1] * nbytes / points[0][0])
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if nbytes <= x1:
            return max(0.0, y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0))
    return max(0.0, points[-1][1] * nbytes / points[-1][0])


def transfer_seconds(cost: dict[str, Any], nbytes: float, both_ways: bool = False) -> float:
    """One transfer of `nbytes` with a calibrated transport: the measured times interpolated between
    the measured sizes, the smallest one's below them, the last per-byte slope beyond them (``a + b·x``
    where no curve was measured). `both_ways`: while the peer sends as many bytes back (the exchange
    curve, where it was measured; every step of a ring or a parameter-server push/pull is one)."""
    points = (both_ways and cost.get("exchange_points")) or cost.get("points") or []
    if len(points) < 2:
        return cost["a"] + cost["b"] * nbytes
    if nbytes <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if nbytes <= x1:
            return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (nbytes - x1)


def line(a: float, b: float) -> Callable[[float], float]:
    """t(x) = a + b·x: a transport known only by its per-message and per-byte costs."""
    return lambda nbytes: a + b * nbytes


def comm_seconds(
    mode: str,
    workers: int,
    gradient_bytes: float,
    tensors: int,
    buckets: int,
    t: Callable[[float], float],
    c: float,
    tensor_bytes: Sequence[int] | None = None,
) -> float:
    """Communication of one step without overlap (see the module docstring); `t(x)`: one transfer of x bytes.
    `tensor_bytes` (each variable's gradient bytes, where known): the parameter servers' real shards."""
    n, g = workers, gradient_bytes
    if n <= 1:
        return 0.0
    if mode == "allreduce":
        return 2 * (n - 1) * buckets * t(g / n / buckets) + (n - 1) / n * g * c
    if not tensor_bytes:  # shards of equal bytes, m equal variables each
        m = math.ceil(tensors / n)
        return 2 * (n - 1) * (m * t(g / n / m) + t(0)) + (n - 1) / n * g * 2 * c
    owner = deal(tensor_bytes, n)
    owned = [sum(s for s, o in zip(tensor_bytes, owner, strict=True) if o == k) for k in range(n)]
    # Every rank writes each gradient another rank owns, one message a variable, and a flag per owner;
    # the owners wait for the last push, add the n contributions; every rank reads each other owner's
    # shard in one message (after its version flag) and assigns it.
    push = max(sum(t(s) for s, o in zip(tensor_bytes, owner, strict=True) if o != r) for r in range(n))
    add = max(owned) * (n - 1) * c
    pull = max(sum(t(owned[o]) for o in range(n) if o != r) + (sum(owned) - owned[r]) * c for r in range(n))
    return push + add + pull + 2 * (n - 1) * t(0)


def predict_here(
    run: dict[str, Any], compute_s: float, fixed_s: float, calibration: dict[str, Any], cores: int, bucket_bytes: int
) -> float | None:
    """Predicted step seconds of a measured run on this machine (None: its transport was not calibrated).

    `compute_s` is the model's step while every one of the run's workers computes (with more workers than
    cores, time-shared), `fixed_s` the fixed cost of a distributed step of this transport, mode and worker
    count (measured with a 300-parameter model: it includes any sharing of cores already)."""
    cost = calibration["transports"].get(run["transport"])
    if cost is None:
        return None
    n = run["workers"]
    buckets = max(1, math.ceil(run["gradient_bytes"] / bucket_bytes)) if run.get("overlap", 0) else 1
    comm = comm_seconds(
        run["mode"],
        n,
        run["gradient_bytes"],
        run["tensors"],
        buckets,
        lambda nbytes: transfer_seconds(cost, nbytes, both_ways=True),
        calibration["memcpy_per_byte"],
        run.get("tensor_bytes"),
    )
    if n > 1:
        comm += beyond_transfers(cost, run["mode"], run["gradient_bytes"])
    return compute_s + max(1.0, n / cores) * comm + fixed_s


@dataclass
class Projection:
    """One model's projected per-worker throughput on the testbed, for each transport."""

    model: str
    mode: str
    workers: int
    compute_s: float
    comm_s: dict[str, float]
    # Per transport, what no overlap can hide: the copy of the averaged gradients back to the GPU after the
    # exchange (rdkeras's results leave its numpy_function hop on the host).
    after_s: dict[str, float] = field(default_factory=dict)

    def rate(self, transport: str, overlap: bool = False) -> float:
        comm, after = self.comm_s[transport], self.after_s.get(transport, 0.0)
        # With overlap, the backward pass (2/3 of the compute) hides the communication it can.
        step = self.compute_s / 3 + max(2 * self.compute_s / 3, comm) if overlap else self.compute_s + comm
        return 1.0 / (step + after)


TESTBED_TRANSPORTS = ("rdkeras", "rpc_rdma", "grpc_tcp")


def testbed_costs(calibration: dict[str, Any], testbed: Testbed) -> dict[str, tuple[float, float]]:
    """(a, b) per message and per byte on the testbed for rdkeras (RDMA), RPC over RDMA and gRPC over TCP."""
    t = calibration["transports"]
    c_here = calibration["memcpy_per_byte"]
    scale = (1 / (testbed.memcpy_gb_per_s * 1e9)) / c_here  # CPU work per byte there / here
    link = 8 / (testbed.link_gbps * 1e9)
    pcie = 1 / (testbed.pcie_gb_per_s * 1e9)
    shm, rpc, grpc = t.get("shm"), t.get("rpc+shm"), t.get("grpc")
    out = {"rdkeras": (testbed.rdma_latency_s, link)}
    if shm and rpc:  # what the RPC layer adds on the same wire, measured here
        extra_b = max(0.0, rpc["b"] - shm["b"]) * scale
        extra_a = max(0.0, rpc["a"] - shm["a"])
        out["rpc_rdma"] = (testbed.rdma_latency_s + extra_a, link + extra_b + pcie)
    if grpc:
        out["grpc_tcp"] = (grpc["a"], grpc["b"] * scale + 8 / (testbed.tcp_gbps * 1e9) + pcie)
    return out


def project(
    model: dict[str, Any], mode: str, calibration: dict[str, Any], testbed: Testbed, bucket_bytes: int = 4 * MB
) -> Projection:
    """A model ({"name", "forward_flops", "gradient_bytes", "tensors", "batch", "tensor_bytes"}) on the testbed."""
    compute = 3 * model["forward_flops"] * model["batch"] / testbed.gpu_flops  # forward + backward ~ 3x forward
    c_there = 1 / (testbed.memcpy_gb_per_s * 1e9)
    buckets = max(1, math.ceil(model["gradient_bytes"] / bucket_bytes))
    comm = {
        name: comm_seconds(
            mode,
            testbed.workers,
            model["gradient_bytes"],
            model["tensors"],
            buckets,
            line(a, b),
            c_there,
            model.get("tensor_bytes"),
        )
        for name, (a, b) in testbed_costs(calibration, testbed).items()
    }
    # rdkeras's gradients reach the engine through numpy_function hops: off the GPU before the exchange (with
    # the transfers), back onto it after -- charged until a path without host staging exists.
    after = {}
    if "rdkeras" in comm and testbed.workers > 1:
        comm["rdkeras"] += staging_seconds(model["gradient_bytes"], testbed)
        after["rdkeras"] = staging_seconds(model["gradient_bytes"], testbed)
    return Projection(model["name"], mode, testbed.workers, compute, comm, after)


def sweep(
    model: dict[str, Any], mode: str, calibration: dict[str, Any], testbed: Testbed, workers: list[int]
) -> list[dict[str, Any]]:
    """Per-worker throughput and speed-ups at each cluster size (the testbed's hardware, more servers)."""
    rows = []
    for n in workers:
        p = project(model, mode, calibration, Testbed(**{**asdict(testbed), "workers": n}))
        rate = {t: p.rate(t) for t in p.comm_s}
        rows.append({"workers": n, "rates": rate, "compute_s": p.compute_s, "comm_s": p.comm_s})
    return rows
