"""The scale model's arithmetic, on inputs built here (no measurement)."""

from __future__ import annotations

import math

import pytest

from rdkeras.bench import scale_model

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
    # 100 Gb/s: rdkeras moves 2 x 7/8 of 472 MB in 2 x 7 steps over the link in about 66 ms.
    expected = 2 * 7 * (3e-6 * 2 + 472e6 / 8 * 8e-11) + 7 / 8 * 472e6 * 2 / 8e9
    assert p.comm_s["rdkeras"] == pytest.approx(expected, rel=1e-6)
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
