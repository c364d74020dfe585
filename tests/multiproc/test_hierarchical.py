"""The hierarchical allreduce: equal to a numpy sum on every rank, the same bits everywhere, whatever the hosts."""

from __future__ import annotations

import numpy as np
import pytest

from rdkeras.parallel.collectives import choose_algorithm, grid_groups, grid_side, host_groups
from tests.conftest import run_ranks, run_threads

SIZES = [1, 7, 1000, 33, 4099, 0, 64]  # odd sizes, an empty tensor, many small ones among larger
# 2 hosts x 2, 3 hosts x 2 with interleaved ranks, 2 hosts x 3, 2 hosts x 1; 4 and 6 hosts x 1 (2D rings).
LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "b", "a", "b", "c", "c"],
    ["a", "a", "a", "b", "b", "b"],
    ["a", "b"],
    ["a", "b", "c", "d"],
    ["a", "b", "c", "d", "e", "f"],
]


def _inputs(rank: int, call: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * call + rank)
    return [rng.standard_normal(n).astype(np.float32 if i % 2 else np.float64) for i, n in enumerate(SIZES)]


@pytest.mark.parametrize("bucket", [1 << 16, 4096], ids=["one-pass", "many-passes"])
@pytest.mark.parametrize("transport", ["shm", "tcp", "shm+tcp"])
@pytest.mark.parametrize("hosts", LAYOUTS)
def test_every_rank_gets_the_numpy_sum_and_the_same_bits(transport, hosts, bucket):
    results = run_threads(
        "hosts_allreduce", len(hosts), transport=transport, hosts=hosts, algorithm="hierarchical", sizes=SIZES,
        bucket=bucket,
    )  # fmt: skip
    assert all(r.value["algorithm"] == "hierarchical" for r in results)
    for call, got in enumerate(results[0].value["calls"]):
        want = [sum(_inputs(rank, call)[i].astype(np.float64) for rank in range(len(hosts))) for i in range(len(SIZES))]
        if got["average"]:
            want = [w / len(hosts) for w in want]
        for i, (g, w) in enumerate(zip(got["sums"], want, strict=True)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=f"call {call}, tensor {i}")
    for r in results[1:]:
        assert r.value["calls"] == results[0].value["calls"], f"rank {r.rank} holds other bits than rank 0"


def test_auto_chooses_by_where_the_workers_run():
    def choose(hosts):
        return choose_algorithm("auto", host_groups(hosts, range(len(hosts))))

    assert choose(["a", "a", "b", "b"]) == (
        "hierarchical",
        "2 hosts x 2 workers: sum inside each host, shards across hosts, share inside each host",
    )
    assert choose(["a", "a"]) == ("ring", "1 host x 2 workers: one host")
    assert choose(["a", "b", "c"]) == ("ring", "3 hosts x 1 worker: one worker per host")
    assert choose(["a", "a", "b"]) == ("ring", "hosts of 1 and 2 workers: unequal hosts")
    # One worker on each of 4 or more hosts: a 2D ring where the count has a divisor, groups of consecutive ranks.
    assert choose(list("abcd")) == (
        "hierarchical",
        "4 hosts x 1 worker: a 2D ring, 2 groups of 2 (4 messages in sequence where a flat ring sends 6)",
    )
    assert choose(list("abcde")) == ("ring", "5 hosts x 1 worker: one worker per host")
    assert grid_groups(host_groups(list("abcdef"), range(6))) == [[0, 1], [2, 3], [4, 5]]
    assert [grid_side(n) for n in (2, 4, 9, 12, 1024, 1021)] == [None, 2, 3, 3, 32, None]
    assert grid_groups(host_groups(list("aabb"), range(4))) == [[0, 1], [2, 3]]  # real hosts stay as they are
    with pytest.raises(ValueError, match=r"needs the same number of workers on every host; these hosts have 2, 1"):
        choose_algorithm("hierarchical", host_groups(["a", "a", "b"], range(3)))
    # On one host (every test machine) auto is the flat ring, and says so.
    results = run_threads("hosts_allreduce", 2, hosts=["a", "a"], algorithm="auto", sizes=[5], calls=1)
    assert [r.value["algorithm"] for r in results] == ["ring", "ring"]


def assert_every_other_names(results, victim: int) -> None:
    """`victim` was SIGKILLed mid-collective: every other rank failed within 10 s with a PeerError naming it."""
    assert results[victim].returncode == -9
    for r in results:
        if r.rank == victim:
            continue
        assert r.returncode == 0 and r.value["error"] is not None, (r.rank, r.output[-2000:])
        kind, message, rank = r.value["error"]
        assert kind == "PeerError" and rank == victim and f"rank {victim}" in message, (r.rank, message)
        assert r.value["seconds"] < 10, (r.rank, r.value)


@pytest.mark.parametrize("victim", [1, 2], ids=["a-shard-owner-of-host-a", "a-member-of-host-b"])
def test_a_rank_killed_mid_allreduce_is_named_by_every_other(victim):
    assert_every_other_names(run_ranks("hierarchical_with_a_death", 4, check=False, timeout=120, victim=victim), victim)


def test_the_plan_says_which_allreduce_and_why():
    from rdkeras.parallel.data_parallel import ExchangePlan

    why = "2 hosts x 2 workers: sum inside each host, shards across hosts, share inside each host"
    plan = ExchangePlan(
        "allreduce", 4, "shm+tcp", 64, [("d/kernel", (4, 4), "float32", 64)], 1 << 26, ("hierarchical", why)
    )
    assert f"Each step: a hierarchical allreduce of 64 gradient bytes ({why})." in plan.text()
    assert "One exchange after backprop (overlap off" in plan.text()
    flat = ExchangePlan("allreduce", 4, "shm+tcp", 64, [("d/kernel", (4, 4), "float32", 64)], 1 << 26,
                        overlap_bytes=4 << 20)  # fmt: skip
    assert "one ring allreduce of 64 gradient bytes" in flat.text()
    assert "Overlap: buckets of 4,194,304 bytes start as backprop produces them." in flat.text()
