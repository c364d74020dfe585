"""Every allreduce algorithm, with and without a 16-bit wire: a numpy sum on every rank, the same bits everywhere."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rdkeras.parallel.collectives import Collectives, doubling_below, doubling_messages
from tests.conftest import run_ranks, run_threads
from tests.multiproc.test_hierarchical import assert_every_other_names

SIZES = [1, 7, 1000, 33, 4099, 0, 64, *[3] * 40]  # odd sizes, an empty tensor, many small ones
# Relative rounding of one addition on the wire, as a bound per hop: 2^-8 for bfloat16, 2^-11 for float16.
EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11, None: 1e-6}


def _inputs(rank: int, call: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * call + rank)
    return [rng.standard_normal(n).astype(np.float32 if i % 2 else np.float64) for i, n in enumerate(SIZES)]


def _check(results, world: int, compression: str | None, compressed_hops: int) -> None:
    """Every rank holds the same bits; float64 tensors are exact sums, float32 ones within what `compressed_hops`
    roundings on the wire may lose."""
    for r in results[1:]:
        assert r.value["calls"] == results[0].value["calls"], f"rank {r.rank} holds other bits than rank 0"
    for call, got in enumerate(results[0].value["calls"]):
        inputs = [_inputs(rank, call) for rank in range(world)]
        for i in range(len(SIZES)):
            want = sum(inputs[rank][i].astype(np.float64) for rank in range(world))
            bound = sum(np.abs(inputs[rank][i].astype(np.float64)) for rank in range(world))
            if got["average"]:
                want, bound = want / world, bound / world
            g = np.asarray(got["sums"][i])
            if i % 2 == 0:  # float64: never compressed
                np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12, err_msg=f"call {call}, tensor {i}")
            else:
                eps = EPS[compression] * compressed_hops if compression else 1e-6
                assert np.all(np.abs(g - want) <= eps * bound + 1e-6), f"call {call}, tensor {i}: {g[:4]} vs {want[:4]}"


@pytest.mark.parametrize("world", [3, 4, 5])
@pytest.mark.parametrize("transport", ["shm", "tcp", "shm+tcp"])
@pytest.mark.parametrize("algorithm", ["ring", "doubling", "auto"])
def test_every_algorithm_sums_on_every_rank(algorithm, transport, world):
    hosts = ["a"] * world
    results = run_threads(
        "hosts_allreduce", world, transport=transport, hosts=hosts, algorithm=algorithm, sizes=SIZES, bucket=4096
    )
    assert {r.value["algorithm"] for r in results} == {"doubling" if algorithm == "doubling" else "ring"}
    _check(results, world, None, 0)


@pytest.mark.parametrize(
    "algorithm,world,hosts",
    [
        ("ring", 3, ["a", "b", "c"]),  # a ring across hosts: every hop on the wire type
        ("doubling", 5, ["a", "a", "b", "b", "c"]),
        ("hierarchical", 4, ["a", "a", "b", "b"]),  # only the shards cross hosts compressed
        ("hierarchical", 6, ["a", "b", "a", "b", "c", "c"]),
        ("auto", 4, ["a", "b", "c", "d"]),  # a 2D ring: its groups span hosts, so every hop is compressed
    ],
)
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compression_sums_float32_on_the_wire_type_between_hosts(compression, algorithm, world, hosts):
    results = run_threads(
        "hosts_allreduce", world, transport="shm+tcp", hosts=hosts, algorithm=algorithm, sizes=SIZES, bucket=4096,
        compression=compression,
    )  # fmt: skip
    wire = {"bf16": "bfloat16", "fp16": "float16"}[compression]
    assert f"float32 gradients travel as {wire} between hosts" in results[0].value["described"]
    _check(results, world, compression, world + 1)
    # The wire is really 16-bit: float32 sums of these inputs need more than 16 bits, so an uncompressed run differs.
    exact = run_threads(
        "hosts_allreduce", world, transport="shm+tcp", hosts=hosts, algorithm=algorithm, sizes=SIZES, bucket=4096
    )
    assert results[0].value["calls"] != exact[0].value["calls"]


def test_compression_inside_one_host_only_when_asked():
    kwargs = {"hosts": ["a"] * 3, "algorithm": "ring", "sizes": SIZES, "compression": "bf16"}
    unused = run_threads("hosts_allreduce", 3, **kwargs)
    assert "compression 'bf16' unused: every worker on one host" in unused[0].value["described"]
    _check(unused, 3, None, 0)  # exact float32
    asked = run_threads("hosts_allreduce", 3, within=True, **kwargs)
    assert "float32 gradients travel as bfloat16 everywhere" in asked[0].value["described"]
    _check(asked, 3, "bf16", 4)
    assert asked[0].value["calls"] != unused[0].value["calls"]
    hierarchical = run_threads(
        "hosts_allreduce", 4, transport="shm+tcp",
        **{**kwargs, "hosts": ["a", "a", "b", "b"], "algorithm": "hierarchical", "within": True},
    )  # fmt: skip
    _check(hierarchical, 4, "bf16", 5)


def test_the_wire_types_round_to_nearest_even_as_numpy_and_ml_dtypes_do():
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000),  # every exponent, subnormal halves too
        [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, np.inf, -np.inf],
        [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8],  # ties: to even
    ]).astype(np.float32)  # fmt: skip
    (got,) = run_threads("wire_round_trip", 1, values=values.tolist())
    with np.errstate(over="ignore"):  # beyond float16's range: infinity, as on the wire
        fp16 = values.astype(np.float16).astype(np.float32)
    bf16 = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got.value["float16"], np.uint32).view(np.float32), fp16)
    np.testing.assert_array_equal(np.asarray(got.value["bfloat16"], np.uint32).view(np.float32), bf16)
    (nan,) = run_threads("wire_round_trip", 1, values=[float("nan")])
    assert all(np.isnan(np.uint32(v[0]).view(np.float32)) for v in nan.value.values())


@pytest.mark.parametrize("victim", [1, 4], ids=["a-doubling-partner", "a-member-folded-in"])
def test_a_rank_killed_mid_doubling_is_named_by_every_other(victim):
    assert_every_other_names(run_ranks("doubling_with_a_death", 5, check=False, timeout=120, victim=victim), victim)


def test_auto_sends_small_tensors_by_recursive_doubling_from_the_transports_costs():
    assert [doubling_messages(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 3, 2, 4, 3, 5]
    # 8 members, 10 us a message, 1 ns a byte moved, 0.2 ns a byte added: the ring's 14 messages of G/8 against
    # 3 of G: doubling saves 11 messages (110 us) and costs (3 - 1.75) ns + (3 - 0.875) * 0.2 ns a byte.
    assert doubling_below(8, 10e-6, 1e-9, 0.2e-9) == int(110e-6 / (1.25e-9 + 2.125 * 0.2e-9))
    assert doubling_below(1, 10e-6, 1e-9, 0.2e-9) == 0
    # 2 members: the same bytes move either way; doubling saves a message and adds twice the bytes.
    assert doubling_below(2, 10e-6, 1e-9, 0.2e-9) == int(10e-6 / (0.5 * 0.2e-9))
    results = run_threads("hosts_allreduce", 4, hosts=["a"] * 4, algorithm="auto", sizes=[5], calls=1)
    described = results[0].value["described"]
    assert described.startswith("ring (1 host x 4 workers: one host); recursive doubling below ")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"compression must be None, 'fp16' or 'bf16', got 'int8'"):
        Collectives(object(), 1 << 20, members=[0], compression="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"algorithm must be one of auto, ring, hierarchical, doubling, got 'tree'"):
        Collectives(object(), 1 << 20, members=[0], algorithm="tree")  # type: ignore[arg-type]
