"""rdkeras.introspect on 2 workers: the numbers it reads are the bytes an allreduce moves and the variables' sizes."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks

pytestmark = pytest.mark.timeout(300)
NBYTES = 1 << 20


def test_the_view_reads_the_allreduces_bytes_and_each_shard_modes_state():
    shards = ["none", "gradients", "optimizer"]
    results = run_ranks("inspected", 2, module="tests.ranks.introspect_workers", timeout=240, shards=shards,
                        nbytes=NBYTES)  # fmt: skip
    for r in results:
        for shard, mode in r.value.items():
            # A 2-worker ring: each worker sends its half in the reduce-scatter and its half in the allgather.
            assert mode["written"] == NBYTES and mode["received"] == NBYTES, (r.rank, shard, mode)
            assert mode["summed"] == 3.0 and mode["workers"] == 2 and mode["algorithm"] == "ring"
            assert mode["plan_is_the_strategys"] and "data parallel" in mode["plan_text"]
            assert mode["shard"] == shard
    # Dense(3) on 4 inputs: a 4 x 3 kernel and 3 biases, float32: 60 bytes. Adam keeps two moments of each (120
    # bytes), its iteration count (int64) and learning rate (float32): 12 bytes.
    for r in results:
        assert r.value["none"]["state"] == {"parameters": 60, "gradients": 60, "optimizer": 120 + 12}, r.rank
        assert r.value["gradients"]["state"]["gradients"] == 60 // 2, r.rank  # each worker: its half
        assert r.value["optimizer"]["state"]["gradients"] == 60, r.rank
    for shard in ("gradients", "optimizer"):
        # Sharded: the moments are dealt out among the workers; each also keeps the compiled optimizer's 12 bytes
        # and its shard's own copy's.
        kept = [r.value[shard]["state"]["optimizer"] for r in results]
        assert sum(kept) == 120 + 2 * (12 + 12) and all(k >= 24 for k in kept), (shard, kept)
