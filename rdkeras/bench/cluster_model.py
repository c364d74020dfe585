"""A data-parallel step on a cluster of GPU servers: the allreduce's cost by algorithm (its steps and the hops
they cross: latency, the servers' NICs, copies inside a server, sums, casts to 16 bits, PCIe), NCCL's ring as
NVIDIA models it, gradients fused into buckets as backprop makes them, and the copies between GPU and host
around them. :mod:`rdkeras.bench.scale_model` calibrates and projects with it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rdkeras.parallel import collectives

if TYPE_CHECKING:
    from rdkeras.bench.scale_model import Testbed

MB = 1 << 20

# On a cluster of GPU servers: each allreduce algorithm's steps and the hops they cross, gradients fused into
# buckets as they appear during backprop, and (for rdkeras) the copies between GPU and host around them.

PARTS = ("latency", "network", "in_server", "sums", "casts", "pcie")
PART_LABELS = {
    "latency": "per-step latency",
    "network": "bytes through the servers' NICs",
    "in_server": "copies inside a server",
    "sums": "sums on a CPU core",
    "casts": "casts to 16 bits and back",
    "pcie": "GPU <-> host copies",
}
ALGORITHMS = collectives.ALGORITHMS  # the collectives' own names (the model predicts each)

# NVIDIA's cost model of NCCL's ring allreduce, Simple protocol (NVIDIA/nccl src/graph/tuning.cc at 01afd20:
# baseLat[Ring][Simple], hwLat[PCI][Ring][Simple], hwLat[NET][Ring][Simple], and the x1.9 "plateau effect of
# ring" for allreduces of nRanks/16 x 64 KiB or more across nodes).
NCCL_BASE_S = 8.4e-6
NCCL_PCI_STEP_S = 5.7e-6
NCCL_NET_STEP_S = 9.6e-6
NCCL_PLATEAU = 1.9


@dataclass(frozen=True)
class Hops:
    """One step of a collective on a cluster: per message and per byte through a server's NIC (which its GPUs
    share) and between two workers of one server (shared memory), and per byte summed on one core."""

    net_a: float
    net_b: float
    host_a: float
    host_b: float
    sum_b: float

    @classmethod
    def of(cls, testbed: Testbed) -> Hops:
        copy = 1 / (testbed.memcpy_gb_per_s * 1e9)
        return cls(testbed.rdma_latency_s, 8 / (testbed.link_gbps * 1e9), testbed.shm_latency_s, copy, copy)


def _parts(**seconds: float) -> dict[str, float]:
    return {k: seconds.get(k, 0.0) for k in PARTS}


def _casts(nbytes: float, wire: float, hops: Hops) -> float:
    """Casting `nbytes` of float32 to the 16-bit wire type and the sums back (one pass over them each way)."""
    return 2 * nbytes * hops.sum_b if wire < 1 else 0.0


def ring_parts(x: float, servers: int, per_server: int, hops: Hops, wire: float = 1.0) -> dict[str, float]:
    """rdkeras's flat ring over every worker of `servers` x `per_server`, ordered server by server (each server's
    boundary crossed once each way): 2(N-1) steps of x/N bytes, each as slow as its slowest hop (across servers
    where there are several, else inside one), and (N-1)/N of x summed. `wire`: the share of the bytes on the
    wire (0.5: every tensor cast to 16 bits and back)."""
    n = servers * per_server
    if n <= 1:
        return _parts()
    chunk = x / n * wire
    step = []
    if servers > 1:
        step.append((hops.net_a, "network", chunk * hops.net_b))
    if per_server > 1:
        step.append((hops.host_a, "in_server", chunk * hops.host_b))
    a, kind, moved = max(step, key=lambda s: s[0] + s[2])
    steps = 2 * (n - 1)
    return _parts(
        latency=steps * a, **{kind: steps * moved}, sums=(n - 1) / n * x * hops.sum_b, casts=_casts(x, wire, hops)
    )


def _grid(servers: int, per_server: int) -> tuple[int, int, bool]:
    """(groups, members per group, whether a group spans servers) of the hierarchical allreduce: the servers and
    their workers, or with one worker per server a 2D ring (collectives.grid_groups)."""
    side = collectives.grid_side(servers) if per_server == 1 else None
    return (servers // side, side, True) if side else (servers, per_server, False)


def hierarchical_parts(x: float, servers: int, per_server: int, hops: Hops, wire: float = 1.0) -> dict[str, float]:
    """rdkeras's hierarchical allreduce: a ring inside each server reduce-scatters (L-1 steps of x/L), each local
    rank sums its x/L shard across servers by a ring of the same-position ranks (2(H-1) steps; the L rings share
    the server's NIC, which carries x/H a step: 2(H-1)/H of x across in all), and the ring inside allgathers.
    `wire` < 1: only the shards crossing servers are cast. With one worker per server, a 2D ring (_grid): its
    groups' rings cross the network too, every byte compressed, each worker's NIC carrying its own shard."""
    h, l_, grid = _grid(servers, per_server)
    if h * l_ <= 1:
        return _parts()
    inside_bytes = 2 * (l_ - 1) * x / l_
    across = 2 * (h - 1) * x / h * wire * hops.net_b / (l_ if grid else 1)
    return _parts(
        latency=2 * (l_ - 1) * (hops.net_a if grid else hops.host_a) + 2 * (h - 1) * hops.net_a,
        network=across + (inside_bytes * wire * hops.net_b if grid else 0.0),
        in_server=0.0 if grid else inside_bytes * hops.host_b,
        sums=((l_ - 1) / l_ * x + (h - 1) / h * x / l_) * hops.sum_b,
        casts=_casts(x if grid else x / l_, wire, hops) if h > 1 else 0.0,
    )


def hierarchical_seconds(x: float, passes: int, servers: int, per_server: int, hops: Hops, wire: float = 1.0) -> float:
    """Seconds of one hierarchical allreduce of `x` bytes in `passes` passes, as the engine pipelines them: a
    thread of its own sums pass k across servers while the ring inside the server reduce-scatters pass k+1 and
    allgathers pass k-1, so after the first pass's reduce-scatter a pass costs the slower of the two, and the
    last pass's allgather follows. A 2D ring's two rings share each worker's NIC: no overlap is counted."""
    h, l_, grid = _grid(servers, per_server)
    if h * l_ <= 1:
        return 0.0
    y = x / passes
    if grid:
        return passes * sum(hierarchical_parts(y, servers, per_server, hops, wire).values())
    gather = (l_ - 1) * (hops.host_a + y / l_ * hops.host_b)  # one half of the ring inside the server
    scatter = gather + (l_ - 1) / l_ * y * hops.sum_b
    across = sum(hierarchical_parts(y, h, l_, hops, wire).values()) - scatter - gather
    return scatter + across + (passes - 1) * max(across, scatter + gather) + gather


def doubling_parts(x: float, servers: int, per_server: int, hops: Hops, wire: float = 1.0) -> dict[str, float]:
    """rdkeras's latency-optimal allreduce for small tensors (recursive doubling, the "tree"): log2(P) steps, P
    the largest power of 2 <= N, each exchanging all x bytes with the partner 2^k positions away (inside the
    server while 2^k < L; across it every worker of a server sends at once, L·x through its NIC) and adding them;
    with N > P, the workers beyond P fold into a partner first and get the sum back after (two steps more)."""
    n = servers * per_server
    if n <= 1:
        return _parts()
    p = 1 << (n.bit_length() - 1)
    out = _parts(casts=_casts(x, wire, hops))
    for k in range(p.bit_length() - 1):
        if (1 << k) < per_server:
            out["latency"] += hops.host_a
            out["in_server"] += x * wire * hops.host_b
        else:
            out["latency"] += hops.net_a
            out["network"] += per_server * x * wire * hops.net_b
        out["sums"] += x * hops.sum_b
    if n > p:
        kind, a, b = ("network", hops.net_a, hops.net_b) if servers > 1 else ("in_server", hops.host_a, hops.host_b)
        out["latency"] += 2 * a
        out[kind] += 2 * x * wire * b
        out["sums"] += x * hops.sum_b
    return out


def doubling_below(servers: int, per_server: int, hops: Hops) -> float:
    """The bytes below which "auto" takes recursive doubling: rdkeras.parallel.collectives.doubling_below's
    crossover, with the cluster's costs (a message and a byte across servers where there are several)."""
    a, b = (hops.net_a, hops.net_b) if servers > 1 else (hops.host_a, hops.host_b)
    below = collectives.doubling_below(servers * per_server, a, b, hops.sum_b)
    return math.inf if below >= 1 << 62 else float(below)


def pick_algorithm(algorithm: str, nbytes: float, servers: int, per_server: int, hops: Hops) -> str:
    """The algorithm an allreduce call of `nbytes` runs: "auto" is recursive doubling below doubling_below, else
    hierarchical where there are several servers of more than one worker each, or a 2D grid of single-worker
    servers (collectives.choose_algorithm), else the ring."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if algorithm != "auto":
        return algorithm
    if nbytes < doubling_below(servers, per_server, hops):
        return "doubling"
    groups, each, _ = _grid(servers, per_server)
    return "hierarchical" if groups > 1 and each > 1 else "ring"


def allreduce_parts(
    algorithm: str, x: float, servers: int, per_server: int, hops: Hops, wire: float = 1.0
) -> tuple[str, dict[str, float]]:
    """(the algorithm that ran, its seconds by part) for one allreduce of `x` bytes (pick_algorithm's)."""
    used = pick_algorithm(algorithm, x, servers, per_server, hops)
    cost = {"ring": ring_parts, "hierarchical": hierarchical_parts, "doubling": doubling_parts}[used]
    return used, cost(x, servers, per_server, hops, wire)


def nccl_ring_parts(x: float, servers: int, per_server: int, testbed: Testbed) -> dict[str, float]:
    """One NCCL ring allreduce of `x` bytes by NVIDIA's own cost model (see NCCL_*): latency = base + a PCIe step
    for each of the 2(N-1) steps inside a server and a network step for each of the 2(H-1) across, x1.9 for large
    allreduces across servers; bandwidth = the NIC's (one ring, each server's boundary crossed once each way),
    x·2(N-1)/N through it. NCCL sums on the GPU (no CPU sums) and, without GPUDirect, stages through host
    memory in a pipeline the NIC's rate bounds (not charged)."""
    n = servers * per_server
    if n <= 1:
        return _parts()
    steps, across = 2 * (n - 1), 2 * (servers - 1)
    latency = NCCL_BASE_S + (steps - across) * NCCL_PCI_STEP_S + across * NCCL_NET_STEP_S
    if servers > 1 and x >= n / 16 * 65536:
        latency *= NCCL_PLATEAU
    bus = (testbed.link_gbps / 8 if servers > 1 else testbed.pcie_gb_per_s) * 1e9
    return _parts(latency=latency, **{"network" if servers > 1 else "in_server": x * steps / n / bus})


def staging_seconds(nbytes: float, testbed: Testbed) -> float:
    """One copy of `nbytes` between a GPU and its host over PCIe (one way)."""
    return nbytes / (testbed.pcie_gb_per_s * 1e9)


@dataclass
class Step:
    """One data-parallel step on a cluster: its compute, its length, what its communication spent by part (summed
    over its calls, hidden behind backprop or not) and its allreduce calls by algorithm."""

    compute_s: float
    step_s: float
    parts: dict[str, float]
    calls: dict[str, int]

    @property
    def efficiency(self) -> float:
        """The step's share spent computing: throughput against one worker alone (scaling efficiency)."""
        return self.compute_s / self.step_s

    @property
    def dominant(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])


def gradient_buckets(tensors: Sequence[Sequence[float]], bucket_bytes: int) -> list[tuple[float, float]]:
    """(ready, bytes) of rdkeras's overlap buckets: `tensors` as (share of backprop done when its gradient
    exists, bytes) in backprop's order, a bucket closed once it holds `bucket_bytes` (collectives.reverse_buckets),
    ready with its last gradient."""
    out, filled = [], 0.0
    for ready, nbytes in tensors:
        filled += nbytes
        if filled >= bucket_bytes:
            out.append((ready, filled))
            filled = 0.0
    if filled:
        out.append((tensors[-1][0], filled))
    return out


def rdkeras_step(
    tensors: Sequence[Sequence[float]],
    compute_s: float,
    testbed: Testbed,
    algorithm: str = "auto",
    wire: float = 1.0,
    bucket_bytes: int = 4 * MB,
    pass_bytes: int = 64 * MB,
    overlap: bool = True,
    staging: bool = True,
) -> Step:
    """rdkeras's data-parallel step as the code runs it: backprop (2/3 of the compute, after the forward third)
    produces the gradients (`tensors`: see gradient_buckets); each bucket, once its gradients exist, is copied
    to the host (`staging`: the numpy_function hop; on the GPU's own PCIe link, one bucket after another) and
    allreduced by the communication thread, one bucket at a time, in passes of at most `pass_bytes` (the ring's
    bucket_bytes; the hierarchical allreduce's are smaller and pipelined: hierarchical_seconds); once a bucket
    is done (a wait op per bucket), its averaged gradients are copied back to the GPU while later buckets are
    still exchanged, the last bucket's copy after everything. Without `overlap` every bucket waits for the end
    of backprop."""
    hops, servers, per_server = Hops.of(testbed), testbed.servers, testbed.gpus_per_server
    parts, calls = _parts(), dict[str, int]()
    if testbed.workers <= 1:
        return Step(compute_s, compute_s, parts, calls)
    forward, backward = compute_s / 3, 2 * compute_s / 3
    copied = free = returned = 0.0
    for ready, nbytes in gradient_buckets(tensors, bucket_bytes):
        at = forward + ready * backward if overlap else compute_s
        if staging:
            copied = max(at, copied) + staging_seconds(nbytes, testbed)
            parts["pcie"] += staging_seconds(nbytes, testbed)
            at = copied
        used = pick_algorithm(algorithm, nbytes, servers, per_server, hops)  # by the call's bytes, as the code
        # The hierarchical allreduce's passes are shorter (as the code sizes them), and pipelined.
        short = collectives.hierarchy_pass_bytes(testbed.workers, hops.net_a, hops.net_b)
        size = min(pass_bytes, short) if used == "hierarchical" else pass_bytes
        passes = max(1, math.ceil(nbytes / size))
        used, cost = allreduce_parts(used, nbytes / passes, servers, per_server, hops, wire)
        for k, v in cost.items():
            parts[k] += passes * v
        calls[used] = calls.get(used, 0) + passes
        if used == "hierarchical":
            seconds = hierarchical_seconds(nbytes, passes, servers, per_server, hops, wire)
        else:
            seconds = passes * sum(cost.values())
        free = max(at, free) + seconds
        if staging:  # the bucket's sums back to the GPU once its wait op returns (the link's other direction)
            returned = max(free, returned) + staging_seconds(nbytes, testbed)
            parts["pcie"] += staging_seconds(nbytes, testbed)
    return Step(compute_s, max(compute_s, free, returned), parts, calls)


def horovod_step(
    tensors: Sequence[Sequence[float]],
    compute_s: float,
    testbed: Testbed,
    fusion_bytes: int = 64 * MB,
    overlap: bool = True,
) -> Step:
    """Horovod's step with NCCL: whenever its communication thread is free, every gradient that exists by then
    (tensor fusion: up to `fusion_bytes` a call, a larger tensor alone) goes in one NCCL ring allreduce on the
    GPUs (nccl_ring_parts); the compute as in rdkeras_step. Horovod's coordination cycle and fusion-buffer
    copies (on the GPU) are not charged."""
    parts, calls = _parts(), dict[str, int]()
    if testbed.workers <= 1:
        return Step(compute_s, compute_s, parts, calls)
    forward, backward = compute_s / 3, 2 * compute_s / 3
    ready = [forward + r * backward if overlap else compute_s for r, _ in tensors]
    free, i = 0.0, 0
    while i < len(tensors):
        start, fused, j = max(free, ready[i]), 0.0, i
        while j < len(tensors) and ready[j] <= start and (j == i or fused + tensors[j][1] <= fusion_bytes):
            fused += tensors[j][1]
            j += 1
        cost = nccl_ring_parts(fused, testbed.servers, testbed.gpus_per_server, testbed)
        for k, v in cost.items():
            parts[k] += v
        calls["nccl ring"] = calls.get("nccl ring", 0) + 1
        free, i = start + sum(cost.values()), j
    return Step(compute_s, max(compute_s, free), parts, calls)
