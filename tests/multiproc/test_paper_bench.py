"""python -m rdkeras.bench paper: a tiny configuration runs and writes its report, raw figures and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rdkeras.data.fashion_mnist import DEFAULT_PATH as FASHION_MNIST
from rdkeras.testing import netns
from tests.conftest import TESTS_DIR

PNG = b"\x89PNG\r\n\x1a\n"


def _paper(out, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR.parent), "TF_CPP_MIN_LOG_LEVEL": "3"}
    env = {k: v for k, v in env.items() if not k.startswith("RDKERAS_")}
    done = subprocess.run(
        [sys.executable, "-m", "rdkeras.bench", "paper", "--tiny", "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


@pytest.mark.slow
def test_sendrecv_figure_report_and_scale_model_calibration(tmp_path):
    _paper(tmp_path, "--figures", "sendrecv", timeout=240)
    results = json.loads((tmp_path / "results.json").read_text())
    series = {(r["transport"], r["mode"]) for r in results["sendrecv"]["rows"] if r["bytes"] == 1 << 20}
    assert {("shm", "static"), ("shm", "dynamic"), ("rpc+shm", "rpc"), ("grpc", "rpc"), ("memcpy", "glibc")} <= series
    assert set(results["sendrecv"]["latency"]) == {"shm", "rpc+shm", "grpc"}
    exchange = results["sendrecv"]["exchange"]  # both ranks sending at once, what the scale model uses here
    assert set(exchange) == {"shm", "rpc+shm", "grpc"} and all(sec > 0 for v in exchange.values() for _, sec in v)
    # The collectives by size too (the scale model's cost beyond the transfers), at 1 MB here.
    collectives = results["sendrecv"]["collectives"]
    assert set(collectives) == {"shm", "rpc+shm", "grpc"}
    assert all(
        [x for x, _ in c[k]] == [1 << 20] and c[k][0][1] > 0 for c in collectives.values() for k in ("ring", "ps")
    )
    assert "beyond its transfers" in (tmp_path / "report.md").read_text()
    assert results["loads"]["sendrecv"]["before"] and results["machine"]["cores"] >= 1
    costs = results["scale_model"]["calibration"]["transports"]
    assert set(costs) == {"shm", "rpc+shm", "grpc"} and all(c["b"] > 0 for c in costs.values())
    report = (tmp_path / "report.md").read_text()
    assert "## Send/Recv" in report and "RPC over shm" in report and "seed: " in report.lower()
    assert "rdkeras shm ≥ 2× RPC over shm" in report  # the target, beside its measured value
    assert "both ranks sending x bytes to each other at once" in report
    assert _png(tmp_path / "sendrecv.png")
    # The report can be rebuilt from the raw figures alone.
    again = tmp_path / "again"
    done = subprocess.run(
        [sys.executable, "-m", "rdkeras.bench", "paper", "--from-json", str(tmp_path / "results.json"), "--out",
         str(again)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (again / "report.md").read_text() == report


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_figure_in_a_tiny_run(tmp_path):
    _paper(tmp_path, timeout=1800)
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["throughput"]["runs"]
    configs = {(r["model"], r["mode"], r["transport"]) for r in runs}
    for t in ("shm", "rpc+shm", "grpc"):
        assert {("fcn5", "ps", t), ("fcn5", "allreduce", t), ("probe", "ps", t)} <= configs
    assert ("fcn5", "local", "none") in configs
    assert len(runs) == len(configs)  # one record a configuration, though shm ran fcn5 in two rounds
    twice = [r for r in runs if r.get("rounds")]
    assert {(r["model"], r["transport"]) for r in twice} == {("fcn5", "shm"), ("probe", "shm")}  # (one group)
    assert all(len(r["rounds"]) == 2 for r in twice)
    assert all(r["step_seconds"] == min(r["rounds"]) for r in twice)  # the median round of two: the lower
    loaded = {r["model"]: r for r in results["throughput"]["loaded"]}  # every core computing at once
    assert set(loaded) == {"probe", "fcn5"} and loaded["fcn5"]["concurrent"] == 2
    computes = results["scale_model"]["calibration"]["compute_seconds"]
    assert computes["fcn5"]["all_cores"] == loaded["fcn5"]["step_seconds"]
    assert all(r["workers"] == 2 and r["rate"] > 0 for r in runs if r["transport"] != "none")
    # Each distributed run carries the compute its own processes measured just before it, and the scale
    # model predicts it from that.
    distributed = {(r["model"], r["mode"], r["transport"]): r for r in runs if r["transport"] != "none"}
    assert all(r["compute_s"] > 0 for r in distributed.values())
    # ... timed before and after the group's runs (they bracket it; the slowest rank's of each).
    assert all(0 < r["compute_s"] <= max(r["compute_before_s"], r["compute_after_s"]) for r in distributed.values())
    by_config = {(v["model"], v["mode"], v["transport"]): v for v in results["scale_model"]["validation"]}
    assert by_config[("fcn5", "ps", "grpc")]["compute_s"] == distributed[("fcn5", "ps", "grpc")]["compute_s"]
    for figure in ("sendrecv", "throughput", "scalability"):
        assert _png(tmp_path / f"{figure}.png"), figure
    if os.path.isdir(FASHION_MNIST):
        curves = results["convergence"]["tasks"]["fashion_mnist_cnn"]
        assert set(curves) == {"shm", "shm+bf16", "grpc"} and all(len(c["curve"]) == 6 for c in curves.values())
        assert curves["shm"]["curve"][-1][1] == pytest.approx(curves["grpc"]["curve"][-1][1], rel=1e-3)  # same math
        assert curves["shm+bf16"]["curve"] != curves["shm"]["curve"]  # bf16 on the wire: other (close) losses
        assert _png(tmp_path / "convergence.png")
    if netns.why_not() is None:
        ov = results["overlap"]
        assert ov["rate"].endswith("mbit") and ov["buckets"] > 1
        assert ov["allreduce_breakdown"]["comm_work_s"] > 0
        assert _png(tmp_path / "overlap.png")
        hosts = results["hosts"]["rows"]["unshaped"]
        assert set(hosts) == {"flat ring", "auto", "auto + bf16", "RPC over tcp", "gRPC"}
        assert hosts["auto"]["plan"][0] == "hierarchical" and hosts["flat ring"]["plan"][0] == "ring"
        for label in ("flat ring", "auto", "gRPC"):  # each step's exchange ops, timed inside it
            steps, inside = hosts[label]["step"], hosts[label]["inside"]
            assert len(inside) == len(steps) and all(0 < i < s for i, s in zip(inside, steps, strict=True)), label
        assert _png(tmp_path / "hosts.png") and "## Across hosts" in (tmp_path / "report.md").read_text()
    sm = results["scale_model"]
    assert {(v["model"], v["transport"]) for v in sm["validation"]} >= {("fcn5", "shm"), ("fcn5", "grpc")}
    assert [p["model"] for p in sm["projections"]] == ["fcn5", "fcn5"]
    assert sorted(sm["sweeps"]["fcn5"][i]["workers"] for i in range(4)) == [8, 64, 256, 1024]
    report = (tmp_path / "report.md").read_text()
    for section in ("## Send/Recv", "## Throughput", "## Scalability", "## Scale model", "## Targets"):
        assert section in report
