"""Communication overlapping backprop: gradients exchanged in buckets (last layer first) as backprop
produces them are exact -- bit-identical to the one-exchange path, the same on every worker, and equal to
one process."""

from __future__ import annotations

import numpy as np

from tests.conftest import run_ranks

TARGET = "tests.multiproc.overlap_workers"


def _close(got, want, key):
    for g, w in zip(got["weights"], want["weights"], strict=True):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5, err_msg=key)


def test_buckets_give_bit_identical_weights():
    # 64-byte buckets: every gradient tensor is a bucket of its own (the MLP has 6, the CNN 4); 0: one exchange.
    configs = [[k, m, o] for k in ("mlp", "cnn") for m in ("allreduce", "ps") for o in (64, 0)]
    results = run_ranks("fit_bucketed_many", 2, transport="shm", timeout=300, module=TARGET, configs=configs, batch=16)
    for kind in ("mlp", "cnn"):
        for mode in ("allreduce", "ps"):
            bucketed, whole = (f"{kind}/{mode}/64", f"{kind}/{mode}/0")
            for r in results:
                assert r.value[bucketed]["weights"] == r.value[whole]["weights"], bucketed  # bit for bit
                assert r.value[bucketed]["evaluate"] == r.value[whole]["evaluate"], bucketed
            assert results[0].value[bucketed]["weights"] == results[1].value[bucketed]["weights"]
            _close(results[1].value[bucketed], results[0].value[f"{kind}/reference"], bucketed)
            if mode == "allreduce":  # one ring per bucket: more (smaller) writes than one ring for all
                assert results[0].value[bucketed]["writes"] > results[0].value[whole]["writes"]


def test_three_workers_over_tcp_with_buckets_match_one_process():
    configs = [["mlp", "allreduce", 200], ["mlp", "ps", 200]]
    results = run_ranks("fit_bucketed_many", 3, transport="tcp", timeout=300, module=TARGET, configs=configs, batch=24)
    for key in ("mlp/allreduce/200", "mlp/ps/200"):
        assert results[0].value[key]["weights"] == results[1].value[key]["weights"] == results[2].value[key]["weights"]
        _close(results[2].value[key], results[0].value["mlp/reference"], key)
