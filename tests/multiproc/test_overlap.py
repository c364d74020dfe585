"""Communication overlapping backprop: gradients exchanged in buckets (last layer first) as backprop
produces them are exact -- bit-identical to the one-exchange path, the same on every worker, and equal to
one process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import run_ranks
from tests.multiproc.test_data_parallel import _reference

TARGET = "tests.multiproc.overlap_workers"


def _run(world_size: int, transport: str, **kwargs):
    return run_ranks("fit_bucketed", world_size, transport=transport, timeout=240, module=TARGET, **kwargs)


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_buckets_give_bit_identical_weights(kind, mode):
    # 64-byte buckets: every gradient tensor is a bucket of its own (the MLP has 6, the CNN 4).
    bucketed = _run(2, "shm", kind=kind, batch=16, mode=mode, overlap_bytes=64)
    whole = _run(2, "shm", kind=kind, batch=16, mode=mode, overlap_bytes=0)
    for b, w in zip(bucketed, whole, strict=True):
        assert b.value["weights"] == w.value["weights"]  # bit for bit
        assert b.value["evaluate"] == w.value["evaluate"]
    assert bucketed[0].value["weights"] == bucketed[1].value["weights"]
    reference = _reference(kind, 16)
    for got, want in zip(bucketed[1].value["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    if mode == "allreduce":  # one ring per bucket: more (smaller) writes than one ring for all
        assert bucketed[0].value["writes"] > whole[0].value["writes"]


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_three_workers_over_tcp_with_buckets_match_one_process(mode):
    results = _run(3, "tcp", kind="mlp", batch=24, mode=mode, overlap_bytes=200)
    reference = _reference("mlp", 24)
    assert results[0].value["weights"] == results[1].value["weights"] == results[2].value["weights"]
    for got, want in zip(results[2].value["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
