"""Reduce-scatter and allgather, the collectives sharded optimizers are built on: each member's shard is the sum
(mean) of every member's slice of it, and the allgather hands everyone every shard, in member order."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import run_threads

COUNTS = [1, 1000, 4099, 0]  # a lone element, several passes of a 4 KB bucket, an empty buffer


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp"), (4, "shm")])
def test_reduce_scatter_then_allgather_match_numpy(world, transport):
    results = run_threads("shard_round_trip", world, transport=transport, counts=COUNTS)
    for at, first in enumerate(results[0].value["calls"]):
        call = at // (2 * len(COUNTS))
        dtype = np.dtype(first["dtype"])
        inputs = []
        for rank in range(world):
            flat = np.zeros(first["per"] * world, dtype)
            flat[: first["count"]] = np.random.default_rng(1000 * call + rank).standard_normal(first["count"])
            inputs.append(flat.astype(np.float64))
        want = sum(inputs) / (world if first["average"] else 1)
        per, rtol = first["per"], 1e-6 if dtype == np.float32 else 1e-12
        assert first["per"] % (64 // dtype.itemsize) == 0 and first["per"] * world >= first["count"]
        for rank, result in enumerate(results):
            got = result.value["calls"][at]
            np.testing.assert_allclose(got["shard"], want[rank * per : (rank + 1) * per], rtol=rtol, atol=rtol)
            owners = np.repeat(np.arange(world), per)
            np.testing.assert_allclose(got["gathered"], want + owners, rtol=rtol, atol=rtol)
            assert got["gathered"] == first["gathered"], f"rank {rank} gathered other bits than rank 0"


@pytest.mark.parametrize("world", [2, 3])
def test_from_owners_gives_every_member_each_owners_array_exactly_in_chunks(monkeypatch, world):
    # Calls of at most 4 KiB (the 12 KB float32 array in three), on a ring released after: every dtype exact.
    from rdkeras.parallel.collectives import core
    from tests.ranks.workers import OWNED, owned_value

    monkeypatch.setattr(core, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(core, "KEPT_BYTES", 1024)
    results = run_threads("from_owners_round_trip", world)
    for result in results:
        assert result.value["discarded"] >= 2 << 20, "the released ring kept its pages"
        for (shape, dtype, owner), (got_dtype, got_shape, got) in zip(OWNED, result.value["got"], strict=True):
            want = owned_value(shape, dtype, owner % world)
            assert (got_dtype, tuple(got_shape)) == (dtype, shape)
            np.testing.assert_array_equal(np.asarray(got), want.astype(np.float64).ravel(), err_msg=f"{shape} {dtype}")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_parameters_gather_and_scatter_in_calls_as_in_one(world):
    # A layer of 1,000 x 16 float32 elements a shard, moved 1 KiB of each shard a call (16 calls, the last short):
    # the same bits as one call, and as from the buffer's parts (or the shard's) in calls, and numpy's mean.
    results = run_threads("shards_in_calls", world, per=16_000 // 16 * 16, limit=1024)
    inputs = [np.random.default_rng(rank).standard_normal(16_000 * world).astype(np.float32) for rank in range(world)]
    mean = np.mean(np.stack(inputs).astype(np.float64), axis=0).reshape(world, -1)
    for rank, result in enumerate(results):
        calls, one = result.value["calls"], result.value["one"]
        assert calls == one, f"rank {rank}: in calls, other bits than in one"
        assert result.value["parts"] == calls["shard"], f"rank {rank}: from the buffer's parts, other bits"
        assert result.value["gathered_from_pieces"] == calls["gathered"], f"rank {rank}: gathered from pieces"
        np.testing.assert_allclose(calls["shard"], mean[rank], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            calls["gathered"], (mean + np.arange(world)[:, None]).reshape(-1), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp")])
def test_a_reduce_scatter_of_a_buffers_parts_is_the_reduce_scatter_of_the_buffer(world, transport):
    # Parts of 1, 1000 and 4099 elements (and the padding), read where they lie: the same bits as the whole buffer.
    results = run_threads("reduce_scatter_in_parts", world, transport=transport, sizes=[1, 1000, 4099])
    for rank, result in enumerate(results):
        assert result.value["parts"] == result.value["whole"], f"rank {rank}"
        assert len(result.value["whole"]) * world >= 5100
