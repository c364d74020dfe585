"""The scale model's arithmetic, on inputs built here (no measurement)."""

from __future__ import annotations

import json
import math

import pytest

from rdkeras.bench import clusters, scale_model
from rdkeras.bench.figures import scale_model as figure

MB = 1 << 20


def _sendrecv(costs: dict[str, tuple[float, float]], memcpy_gbps: float = 10.0) -> dict:
    """Send/Recv rows of transports whose times are exactly a + size * b."""
    rows, latency = [], {}
    for t, (a, b) in costs.items():
        mode = "static" if t in ("shm", "tcp") else "rpc"
        for size in (MB, 16 * MB, 64 * MB):
            rows.append({"transport": t, "mode": mode, "bytes": size, "seconds": a + size * b})
        latency[t] = [[8, a + 8 * b]]
    for size in (MB, 64 * MB):
        rows.append({"transport": "memcpy", "mode": "glibc", "bytes": size, "seconds": size / (memcpy_gbps * 1e9)})
    return {"rows": rows, "latency": latency}


def test_fit_line_recovers_a_line_and_never_a_negative_latency():
    assert scale_model.fit_line([(1, 3), (2, 5), (4, 9)]) == pytest.approx((1, 2))
    a, b = scale_model.fit_line([(1, 0.5), (2, 2.5), (3, 4.5)])  # would cross zero at a = -1.5
    assert a == 0 and b > 0


def test_calibration_recovers_each_transports_costs():
    truth = {"shm": (0.2e-6, 1 / 15e9), "rpc+shm": (50e-6, 1 / 4e9), "grpc": (500e-6, 1 / 0.3e9)}
    cal = scale_model.calibrate(_sendrecv(truth))
    for t, (a, b) in truth.items():
        assert cal["transports"][t]["a"] == pytest.approx(a + 8 * b, rel=1e-6)
        assert cal["transports"][t]["b"] == pytest.approx(b, rel=1e-3)
    assert cal["memcpy_per_byte"] == pytest.approx(1 / 10e9)


def test_ring_and_parameter_server_costs_for_two_workers():
    g, a, b, c = 64 * MB, 1e-5, 1e-9, 1e-10
    # Ring: 2 steps of g/2 bytes, one reduction of g/2 bytes.
    t = scale_model.line(a, b)
    ring = scale_model.comm_seconds("allreduce", 2, g, 10, 1, t, c)
    assert ring == pytest.approx(2 * (a + g / 2 * b) + g / 2 * c)
    # PS: push g/2, pull g/2, per-variable messages to one other owner, adds and assignments of g/2.
    ps = scale_model.comm_seconds("ps", 2, g, 10, 1, t, c)
    assert ps == pytest.approx(2 * (a * 6 + g / 2 * b) + g / 2 * 2 * c)
    assert scale_model.comm_seconds("allreduce", 1, g, 10, 1, t, c) == 0


def test_parameter_servers_with_one_large_variable_wait_for_its_owner():
    # FCN-5's shape: one variable most of the bytes. Dealt out as the parameter servers do (largest first,
    # to the least loaded), rank 0 owns it alone: rank 1 pushes it and pulls it back, one message each way.
    sizes, a, b, c = [100 * MB, 10 * MB, 10 * MB, MB], 1e-5, 1e-9, 1e-10
    assert scale_model.deal(sizes, 2) == [0, 1, 1, 1]
    t = scale_model.line(a, b)
    ps = scale_model.comm_seconds("ps", 2, sum(sizes), 4, 1, t, c, sizes)
    assert ps == pytest.approx(2 * (a + 100 * MB * b) + 2 * a + 2 * 100 * MB * c)
    assert ps > scale_model.comm_seconds("ps", 2, sum(sizes), 4, 1, t, c)  # equal shards: half the bytes
    # Equal variables: the same as equal shards, but a rank pulls an owner's shard in one message.
    even = [8 * MB] * 4
    assert scale_model.comm_seconds("ps", 2, 32 * MB, 4, 1, t, c, even) == pytest.approx(
        2 * (a + 8 * MB * b) + (a + 16 * MB * b) + 2 * a + 16 * MB * 2 * c
    )


def test_a_transfer_between_measured_sizes_follows_the_measured_curve():
    # A transport twice as fast per byte at 4 MB as at 64 MB (gRPC here): no one line fits both.
    cost = {"a": 5e-4, "b": 8e-9, "points": [[8, 5e-4], [4 * MB, 0.017], [64 * MB, 0.55]]}
    assert scale_model.transfer_seconds(cost, 4 * MB) == pytest.approx(0.017)
    assert scale_model.transfer_seconds(cost, 34 * MB) == pytest.approx((0.017 + 0.55) / 2)
    assert scale_model.transfer_seconds(cost, 2) == pytest.approx(5e-4)  # below the smallest: its time
    slope = (0.55 - 0.017) / (60 * MB)
    assert scale_model.transfer_seconds(cost, 128 * MB) == pytest.approx(0.55 + slope * 64 * MB)
    assert scale_model.transfer_seconds({"a": 1e-3, "b": 1e-9}, 1e6) == pytest.approx(2e-3)  # no curve: a + b x


def test_more_workers_than_cores_share_them_for_communication():
    # 4 workers on 2 cores: a ring of 6 steps of 1 ms each takes twice as long; the compute given was
    # measured with every rank computing at once (time-shared already), so it counts as it is.
    cal = {"transports": {"shm": {"a": 1e-3, "b": 0.0}}, "memcpy_per_byte": 0.0}
    run = {"transport": "shm", "workers": 4, "mode": "allreduce", "gradient_bytes": 0, "tensors": 1}
    assert scale_model.predict_here(run, 0.1, 0.01, cal, cores=2, bucket_bytes=MB) == pytest.approx(
        0.1 + 2 * 6e-3 + 0.01
    )
    assert scale_model.predict_here(run, 0.1, 0.01, cal, cores=4, bucket_bytes=MB) == pytest.approx(0.1 + 6e-3 + 0.01)
    assert scale_model.predict_here({**run, "transport": "tcp"}, 0.1, 0, cal, 2, MB) is None


def test_projection_orders_the_transports_and_scales_with_the_cluster():
    cal = scale_model.calibrate(
        _sendrecv({"shm": (0.2e-6, 1 / 15e9), "rpc+shm": (50e-6, 1 / 4e9), "grpc": (500e-6, 1 / 0.3e9)})
    )
    fcn5 = {"name": "fcn5", "forward_flops": 2 * 118e6, "batch": 32, "gradient_bytes": 472e6, "tensors": 8}
    p = scale_model.project(fcn5, "ps", cal, scale_model.Testbed())
    assert p.compute_s == pytest.approx(3 * 2 * 118e6 * 32 / (9.3e12 * 0.35))
    assert p.rate("rdkeras") > p.rate("rpc_rdma") > p.rate("grpc_tcp")
    # 100 Gb/s: rdkeras moves 2 x 7/8 of 472 MB in 2 x 7 steps over the link in about 66 ms; and copies the
    # gradients off the GPU (PCIe, 12 GB/s) before, and the averages back after, which no overlap hides.
    expected = 2 * 7 * (3e-6 * 2 + 472e6 / 8 * 8e-11) + 7 / 8 * 472e6 * 2 / 8e9
    assert p.comm_s["rdkeras"] == pytest.approx(expected + 472e6 / 12e9, rel=1e-6)
    assert p.after_s["rdkeras"] == pytest.approx(472e6 / 12e9)
    assert p.rate("rdkeras", overlap=True) == pytest.approx(
        1 / (p.compute_s / 3 + max(2 * p.compute_s / 3, p.comm_s["rdkeras"]) + 472e6 / 12e9)
    )
    rows = scale_model.sweep(fcn5, "allreduce", cal, scale_model.Testbed(), [8, 64, 1024])
    assert [r["workers"] for r in rows] == [8, 64, 1024]
    assert all(math.isfinite(v) and v > 0 for r in rows for v in r["rates"].values())
    assert rows[-1]["rates"]["rdkeras"] < rows[0]["rates"]["rdkeras"]  # per-message costs grow with the ring


def test_predictions_here_use_the_exchange_curve_where_it_was_measured():
    # RPC's exchange (both ways at once) costs twice its one-way transfer: the cores serialize and parse both.
    one_way = [[MB, 1e-3], [64 * MB, 64e-3]]
    cost = {"a": 0.0, "b": 1e-3 / MB, "points": one_way, "exchange_points": [[x, 2 * y] for x, y in one_way]}
    assert scale_model.transfer_seconds(cost, 32 * MB) == pytest.approx(32e-3, rel=0.02)
    assert scale_model.transfer_seconds(cost, 32 * MB, both_ways=True) == pytest.approx(64e-3, rel=0.02)
    assert scale_model.transfer_seconds({**cost, "exchange_points": []}, 32 * MB, both_ways=True) == pytest.approx(
        32e-3, rel=0.02
    )  # not measured: the one-way curve
    cal = {"transports": {"rpc+shm": cost}, "memcpy_per_byte": 0.0}
    run = {"transport": "rpc+shm", "workers": 2, "mode": "allreduce", "gradient_bytes": 64 * MB, "tensors": 4}
    # Two ring steps of 32 MB, each an exchange.
    assert scale_model.predict_here(run, 0.1, 0.0, cal, cores=2, bucket_bytes=MB) == pytest.approx(
        0.1 + 2 * 64e-3, rel=0.02
    )


def test_calibration_keeps_the_exchange_curve():
    sr = _sendrecv({"shm": (0.2e-6, 1 / 15e9)})
    sr["exchange"] = {"shm": [[MB, 1e-4], [64 * MB, 6e-3]]}
    cal = scale_model.calibrate(sr)
    small = 8 / 15e9 + 0.2e-6  # the ping-pong: below the exchanges, an exchange costs a message's latency
    assert cal["transports"]["shm"]["exchange_points"] == [(8, pytest.approx(small)), (MB, 1e-4), (64 * MB, 6e-3)]


def test_a_collectives_cost_beyond_its_transfers_is_calibrated_and_added():
    # An exchange of x bytes takes x ns; a ring call of two workers, measured, 2 * (x/2) ns for its two steps
    # plus 1 ns a byte of copies the exchange does not make (an RPC ring's concatenations): the calibration
    # keeps the 1 ns a byte, the prediction adds it.
    sr = _sendrecv({"rpc+shm": (0.0, 1e-9)})
    sr["exchange"] = {"rpc+shm": [[MB, MB * 1e-9], [64 * MB, 64 * MB * 1e-9]]}
    sr["collectives"] = {"rpc+shm": {"ring": [[x, 2 * x / 2 * 1e-9 + x * 1e-9] for x in (MB, 16 * MB)], "ps": []}}
    cal = scale_model.calibrate(sr)
    cal["memcpy_per_byte"] = 0.0  # (only the transfers predicted, to keep the arithmetic plain)
    cost = cal["transports"]["rpc+shm"]
    cost["beyond_transfers"] = scale_model._beyond_transfers(sr["collectives"]["rpc+shm"], cost, 0.0)
    assert [y for _, y in cost["beyond_transfers"]["ring"]] == [pytest.approx(MB * 1e-9), pytest.approx(16 * MB * 1e-9)]
    for x in (MB // 2, 8 * MB, 64 * MB):  # below, between and beyond the calibrated sizes: in proportion
        assert scale_model.beyond_transfers(cost, "allreduce", x) == pytest.approx(x * 1e-9)
    assert scale_model.beyond_transfers(cost, "ps", 8 * MB) == 0  # not calibrated
    run = {"transport": "rpc+shm", "workers": 2, "mode": "allreduce", "gradient_bytes": 8 * MB, "tensors": 4}
    assert scale_model.predict_here(run, 0.1, 0.0, cal, cores=2, bucket_bytes=MB) == pytest.approx(
        0.1 + 2 * 4 * MB * 1e-9 + 8 * MB * 1e-9, rel=0.01
    )
    # A collective faster than its transfers predict adds nothing (never a negative cost).
    cost["beyond_transfers"]["ps"] = [[MB, -1e-3]]
    assert scale_model.beyond_transfers(cost, "ps", MB) == 0


# On clusters of GPU servers.

FREE = scale_model.Hops(net_a=0.0, net_b=1e-9, host_a=0.0, host_b=0.0, sum_b=0.0)  # bandwidth only, across servers


def test_nccl_ring_follows_nvidias_cost_model():
    # Horovod's cluster: 128 servers x 4 GPUs, 25 Gbit/s. A 64 MB allreduce: 2 x 511 steps, 2 x 127 of them across
    # servers (x1.9: large), and 2 x 511/512 of the bytes through each server's NIC.
    cluster = clusters.HOROVOD_CLUSTER
    parts = scale_model.nccl_ring_parts(64 * MB, 128, 4, cluster)
    assert parts["latency"] == pytest.approx((8.4 + 768 * 5.7 + 254 * 9.6) * 1e-6 * 1.9)
    assert parts["network"] == pytest.approx(64 * MB * 2 * 511 / 512 / (25e9 / 8))
    assert parts["sums"] == 0 and parts["pcie"] == 0  # on the GPU; NCCL's host staging pipelined with the NIC
    small = scale_model.nccl_ring_parts(1024, 128, 4, cluster)  # below nRanks/16 x 64 KiB: no plateau
    assert small["latency"] == pytest.approx((8.4 + 768 * 5.7 + 254 * 9.6) * 1e-6)


def test_hierarchical_sends_fewer_bytes_across_servers_by_the_expected_ratio():
    # 2 servers x 4: the flat ring's NIC carries 2(N-1)/N = 14/8 of the bytes each way, the hierarchical
    # allreduce's 2(H-1)/H = 1: 1.75x. At 128 servers the two are within 1%.
    x = 64 * MB
    flat, hier = (f(x, 2, 4, FREE)["network"] for f in (scale_model.ring_parts, scale_model.hierarchical_parts))
    assert flat == pytest.approx(2 * 7 / 8 * x * 1e-9) and hier == pytest.approx(x * 1e-9)
    assert flat / hier == pytest.approx((7 / 8) / (1 / 2))
    flat, hier = (f(x, 128, 4, FREE)["network"] for f in (scale_model.ring_parts, scale_model.hierarchical_parts))
    assert flat / hier == pytest.approx((511 / 512) / (127 / 128))
    # ... and takes 2(L-1) + 2(H-1) steps where the flat ring takes 2(N-1).
    hops = scale_model.Hops(net_a=3e-6, net_b=0.0, host_a=1e-6, host_b=0.0, sum_b=0.0)
    assert scale_model.ring_parts(x, 128, 4, hops)["latency"] == pytest.approx(2 * 511 * 3e-6)
    assert scale_model.hierarchical_parts(x, 128, 4, hops)["latency"] == pytest.approx(2 * 3 * 1e-6 + 2 * 127 * 3e-6)


def test_hierarchical_passes_overlap_the_servers_links_with_the_work_inside_them():
    hops = scale_model.Hops(net_a=3e-6, net_b=1e-9, host_a=1e-6, host_b=0.1e-9, sum_b=0.2e-9)
    x = 256 * MB
    serial = sum(scale_model.hierarchical_parts(x, 16, 4, hops).values())
    assert scale_model.hierarchical_seconds(x, 1, 16, 4, hops) == pytest.approx(serial)  # one pass: nothing overlaps
    # 64 passes: the network's part (the slower stage here) runs back to back; inside the server, only the first
    # pass's reduce-scatter and the last one's allgather add to it.
    per_pass = scale_model.hierarchical_parts(x / 64, 16, 4, hops)
    inside = 2 * 3 * (1e-6 + x / 64 / 4 * 0.1e-9) + 3 / 4 * x / 64 * 0.2e-9
    across = sum(per_pass.values()) - inside
    assert across > inside
    assert scale_model.hierarchical_seconds(x, 64, 16, 4, hops) == pytest.approx(64 * across + inside)
    assert scale_model.hierarchical_seconds(x, 64, 16, 4, hops) < serial


def test_a_2d_ring_sends_the_flat_rings_bytes_in_far_fewer_steps():
    hops = scale_model.Hops(net_a=3e-6, net_b=1e-9, host_a=1e-6, host_b=0.1e-9, sum_b=0.2e-9)
    x = 64 * MB
    flat, grid = scale_model.ring_parts(x, 1024, 1, hops), scale_model.hierarchical_parts(x, 1024, 1, hops)
    # 32 groups of 32: each NIC carries 2(31)/32 x inside its group and 2(31)/32 x/32 across: the ring's 2(1023)/1024 x.
    assert grid["network"] == pytest.approx((2 * 31 / 32 + 2 * 31 / 32 / 32) * x * 1e-9)
    assert grid["network"] == pytest.approx(flat["network"], rel=1e-3) and grid["in_server"] == 0
    assert grid["latency"] == pytest.approx((2 * 31 + 2 * 31) * 3e-6) and flat["latency"] == pytest.approx(2046 * 3e-6)
    # Both of its rings cross the network: everything is compressed, and nothing overlaps between them.
    assert scale_model.hierarchical_parts(x, 1024, 1, hops, wire=0.5)["network"] == pytest.approx(grid["network"] / 2)
    assert scale_model.hierarchical_seconds(x, 4, 1024, 1, hops) == pytest.approx(
        4 * sum(scale_model.hierarchical_parts(x / 4, 1024, 1, hops).values())
    )


def test_hierarchical_passes_grow_with_the_ranks_where_messages_cost_more_than_their_bytes():
    from rdkeras.parallel import collectives

    assert collectives.hierarchy_pass_bytes(4, 1e-6, 1e-10) == collectives.HIERARCHY_PASS_BYTES
    # 512 ranks over RDMA at 25 Gbit/s: each message across carries 1/512 of a pass and must carry 8x the bytes
    # its 3 us cost moves: 512 * 8 * 3e-6 * 25e9 / 8 bytes, in whole MiB.
    big = collectives.hierarchy_pass_bytes(512, 3e-6, 8 / 25e9)
    assert big == math.ceil(512 * 8 * 3e-6 * 25e9 / 8 / MB) * MB
    assert collectives.hierarchy_pass_bytes(1024, 3e-6, 8 / 25e9) >= 2 * big - MB


def test_compression_halves_the_bytes_between_servers():
    hops = scale_model.Hops(net_a=3e-6, net_b=1e-9, host_a=1e-6, host_b=0.1e-9, sum_b=0.2e-9)
    x = 64 * MB
    for f in (scale_model.ring_parts, scale_model.hierarchical_parts, scale_model.doubling_parts):
        full, half = f(x, 16, 4, hops), f(x, 16, 4, hops, wire=0.5)
        assert half["network"] == pytest.approx(full["network"] / 2), f.__name__
        assert half["latency"] == full["latency"] and half["sums"] == full["sums"]
        assert full["casts"] == 0 and half["casts"] > 0  # float32 to 16 bits and back, on a core
    # The hierarchical allreduce compresses only what crosses servers: its copies inside one stay as they were.
    full, half = (scale_model.hierarchical_parts(x, 16, 4, hops, wire=w) for w in (1.0, 0.5))
    assert half["in_server"] == full["in_server"] and half["casts"] == pytest.approx(2 * x / 4 * 0.2e-9)


def test_recursive_doubling_takes_log2_steps_and_auto_takes_it_for_small_calls():
    hops = scale_model.Hops(net_a=3e-6, net_b=0.08e-9, host_a=0.3e-6, host_b=0.125e-9, sum_b=0.125e-9)
    assert scale_model.doubling_parts(4096, 1024, 1, hops)["latency"] == pytest.approx(10 * 3e-6)
    assert scale_model.ring_parts(4096, 1024, 1, hops)["latency"] == pytest.approx(2046 * 3e-6)
    assert scale_model.doubling_parts(4096, 12, 1, hops)["latency"] == pytest.approx((3 + 2) * 3e-6)  # 8, and a fold
    # Servers of 4: the first two doublings inside the server, the rest across, each server's 4 workers at once.
    tree = scale_model.doubling_parts(MB, 8, 4, hops)
    assert tree["latency"] == pytest.approx(2 * 0.3e-6 + 3 * 3e-6)
    assert tree["network"] == pytest.approx(3 * 4 * MB * 0.08e-9) and tree["sums"] == pytest.approx(5 * MB * 0.125e-9)
    # auto: recursive doubling below the crossover (where it costs less than the ring), else hierarchical / the ring.
    below = scale_model.doubling_below(1024, 1, hops)
    for x in (below / 2, below * 2):
        ring, tree = (sum(f(x, 1024, 1, hops).values()) for f in (scale_model.ring_parts, scale_model.doubling_parts))
        assert (tree < ring) == (x < below)
    assert scale_model.pick_algorithm("auto", below / 2, 1024, 1, hops) == "doubling"
    assert scale_model.pick_algorithm("auto", 64 * MB, 1024, 1, hops) == "hierarchical"  # a 2D ring, 32 x 32
    assert scale_model.pick_algorithm("auto", 64 * MB, 1021, 1, hops) == "ring"  # a prime: no grid
    assert scale_model.pick_algorithm("auto", 64 * MB, 128, 4, hops) == "hierarchical"
    assert scale_model.pick_algorithm("ring", 8, 128, 4, hops) == "ring"
    with pytest.raises(ValueError, match="algorithm must be one of"):
        scale_model.pick_algorithm("star", 8, 2, 1, hops)


def _tensors(sizes: list[int]) -> list[list[float]]:
    """Gradients of equal compute each, in backprop's order: the k-th exists after k/len of the backward pass."""
    return [[(k + 1) / len(sizes), float(b)] for k, b in enumerate(sizes)]


def test_rdkeras_pays_the_pcie_copies_and_overlap_hides_only_what_backprop_covers():
    testbed = scale_model.Testbed(workers=16, gpus_per_server=1)
    tensors = _tensors([8 * MB] * 8)  # 64 MB in 8 buckets of 8 MB
    compute = 1.0  # a long backward pass: every bucket's exchange hides behind it but the last
    staged = scale_model.rdkeras_step(tensors, compute, testbed, "ring")
    plain = scale_model.rdkeras_step(tensors, compute, testbed, "ring", staging=False)
    assert staged.parts["pcie"] == pytest.approx(2 * 64 * MB / 12e9)  # off the GPU and back
    # Each bucket's copy back follows its exchange and hides behind the next ones; the last bucket's follows
    # its exchange, which follows its copy off the GPU.
    assert staged.step_s - plain.step_s == pytest.approx(2 * 8 * MB / 12e9)
    one = sum(scale_model.ring_parts(8 * MB, 16, 1, scale_model.Hops.of(testbed)).values())
    assert plain.step_s == pytest.approx(compute + one)  # only the last bucket's exchange shows
    assert plain.calls == {"ring": 8}
    after = scale_model.rdkeras_step(tensors, compute, testbed, "ring", staging=False, overlap=False)
    assert after.step_s == pytest.approx(compute + 8 * one)
    assert scale_model.rdkeras_step(tensors, compute, scale_model.Testbed(workers=1), "ring").step_s == compute


def test_rdkeras_buckets_close_at_the_bucket_size_and_run_in_passes():
    assert scale_model.gradient_buckets(_tensors([MB, 3 * MB, 2 * MB, 100 * MB, MB]), 4 * MB) == [
        (2 / 5, 4 * MB),
        (4 / 5, 102 * MB),
        (1.0, MB),
    ]
    testbed = scale_model.Testbed(workers=8)
    step = scale_model.rdkeras_step(_tensors([200 * MB]), 1.0, testbed, "ring", pass_bytes=64 * MB)
    assert step.calls == {"ring": 4}  # 200 MB in passes of at most 64 MiB


def test_horovod_fuses_every_gradient_ready_when_its_thread_is_free():
    cluster = clusters.HOROVOD_CLUSTER
    tensors = _tensors([MB] * 100)
    # Exchange after backprop: all 100 MB ready at once, in 64 MB fusion buffers: two allreduces.
    after = scale_model.horovod_step(tensors, 1.0, cluster, 64 * MB, overlap=False)
    assert after.calls == {"nccl ring": 2}
    parts = [scale_model.nccl_ring_parts(x, 128, 4, cluster) for x in (64 * MB, 36 * MB)]
    assert after.step_s == pytest.approx(1.0 + sum(sum(p.values()) for p in parts))
    # Overlapped: the first gradient alone, then whatever appeared meanwhile; a tensor above the threshold alone.
    overlapped = scale_model.horovod_step(tensors, 1.0, cluster, 64 * MB)
    assert 2 < overlapped.calls["nccl ring"] < 100 and overlapped.step_s < after.step_s
    big = scale_model.horovod_step(_tensors([100 * MB, MB]), 1.0, cluster, 64 * MB, overlap=False)
    assert big.calls == {"nccl ring": 2}


@pytest.fixture(scope="module")
def profiles(request):
    """ResNet-101, Inception V3 and VGG-16 counted from keras.applications (seconds to build; cached between runs)."""
    keras = pytest.importorskip("keras")
    key = f"rdkeras/application-profiles/{keras.__version__}"
    cached = request.config.cache.get(key, None)
    if cached is None:
        cached = {name: clusters.application_profile(name) for name in clusters.APPLICATIONS}
        request.config.cache.set(key, cached)
    return cached


def test_the_models_are_counted_from_keras_applications(profiles):
    # keras.applications' parameter counts (its docs' table: 44.7M, 23.9M, 138.4M).
    assert {n: p["params"] for n, p in profiles.items()} == {
        "resnet101": 44_707_176,
        "inception_v3": 23_851_784,
        "vgg16": 138_357_544,
    }
    vgg = profiles["vgg16"]
    assert vgg["forward_flops"] == pytest.approx(30.9e9, rel=0.01)  # 15.5 G multiply-adds
    # Backprop meets the classifier first: fc6's 411 MB gradient exists within 1% of the backward pass.
    assert max(b for r, b in vgg["tensors"] if r < 0.01) == 25088 * 4096 * 4
    assert all(0 < r <= 1 for r, _ in vgg["tensors"]) and vgg["tensors"][-1][0] == pytest.approx(1.0)
    # VGG-16 runs at more than the P100's peak in counted FLOPs (Winograd convolutions); the others below it.
    shares = {n: clusters.gpu_share(n, 64, p["forward_flops"]) for n, p in profiles.items()}
    assert shares["vgg16"] > 1 > shares["resnet101"] > shares["inception_v3"] > 0.4
    measured = clusters.compute_seconds(profiles["vgg16"], 64, clusters.HOROVOD_CLUSTER)
    assert measured == pytest.approx(64 / 154)  # TensorFlow's P100: 154 images/s at batch 64


def test_the_flat_nccl_ring_lands_within_10_points_of_horovods_published_efficiency(profiles):
    rows = {(r["gpus"], r["model"]): r for r in clusters.horovod_comparison(profiles)}
    for (gpus, model), published in [((512, m), e) for m, e in clusters.HOROVOD_PUBLISHED[512].items()]:
        predicted = rows[(gpus, model)]["efficiency"]
        assert abs(predicted - published) <= 0.10, (model, predicted, published)
    # VGG-16 is the network-bound one: its exchange is mostly bytes through the NICs, which overlap cannot hide.
    vgg = rows[(512, "vgg16")]
    assert vgg["dominant"] == "network" and vgg["no_overlap"] < vgg["efficiency"]
    assert vgg["parts"]["network"] == pytest.approx(553_430_176 * 2 * 511 / 512 / (25e9 / 8))
    # Fewer GPUs, shorter rings: higher efficiency (Horovod's 79% on 128 GPUs).
    assert rows[(128, "vgg16")]["efficiency"] > vgg["efficiency"]


def test_the_projections_charge_rdkeras_the_host_staging_and_the_report_prints_them(profiles, tmp_path):
    at = json.loads(json.dumps(clusters.analyze(profiles)))  # as results.json keeps it
    auto = {r["model"]: r for r in at["auto"]}
    assert all(r["parts"]["pcie"] > 0 and r["no_staging"] > r["efficiency"] for r in auto.values())
    assert auto["vgg16"]["bf16"]["parts"]["network"] == pytest.approx(auto["vgg16"]["parts"]["network"] / 2)
    assert auto["vgg16"]["calls"].get("hierarchical")  # several servers of 4: hierarchical
    seed = {r["model"]: r for r in at["seed"]}
    assert [s["workers"] for s in seed["vgg16"]["sizes"]] == [8, 64, 256, 1024]
    # One GPU per server: a 2D ring (32 groups of 32 at 1024).
    assert seed["vgg16"]["sizes"][0]["vs_first"] == 1 and "hierarchical" in seed["vgg16"]["sizes"][-1]["calls"]
    lines, targets = figure.render({"scale_model": {"at_scale": at}}, tmp_path)
    text = "\n".join(lines)
    assert "| 512 (128 × 4) | VGG-16 |" in text and "68% |" in text
    assert "charged until a path without host staging exists" in text
    assert [t.what.split(" ")[0] for t in targets] == ["scale", "rdkeras", "seed's"]
    assert targets[0].met  # the flat ring within 10 points


@pytest.mark.slow
def test_resnet_flops_are_those_counted_from_keras_applications():
    keras = pytest.importorskip("keras")
    from types import SimpleNamespace

    from rdkeras.bench import workloads

    for name, cls in (("resnet50", "ResNet50"), ("resnet152", "ResNet152")):
        model = getattr(keras.applications, cls)(weights=None, input_shape=(224, 224, 3))
        assert workloads.forward_flops(SimpleNamespace(layers=model.layers)) == clusters.RESNET_FLOPS[name]
        keras.backend.clear_session()
