"""Transport conformance: written once, run for every transport.

The ranks are threads of the test process (one engine each, as gloo's tests run them), except that the first
test runs them as processes, so every transport also moves data between real processes here (test_failures
kills them), two teardown tests run processes (see below), and so does verbs (rpc+verbs too): its tests run
inside the SoftRoCE VM, where threads were not tried."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import ALL_TRANSPORTS, NATIVE, RPC, run_ranks, run_threads

CONFORMING = [*ALL_TRANSPORTS, *RPC]  # every transport and baseline


def _ranks(target: str, world_size: int = 2, *, transport: str, **kwargs):
    run = run_ranks if "verbs" in transport else run_threads
    return run(target, world_size, transport=transport, **kwargs)


@pytest.mark.parametrize("transport", CONFORMING)
def test_bytes_arrive_intact_for_every_size(transport):
    results = run_ranks("write_read_sizes", transport=transport)
    for r in results:
        checked = r.value["checked"]
        assert len(checked) == 10  # 5 sizes x (arena region, external region)
        assert all(ok for _, _, ok in checked), f"rank {r.rank}: {checked}"


@pytest.mark.parametrize("transport", CONFORMING)
def test_flags_never_overtake_data(transport):
    iterations = 60 if transport == "grpc" else 200 if transport.startswith("rpc+") else 600
    receiver = _ranks("flag_ordering", transport=transport, iterations=iterations)[1].value
    assert receiver == {"bad": 0, "iterations": iterations}


@pytest.mark.parametrize("transport", CONFORMING)
def test_out_of_bounds_and_stale_keys_raise(transport):
    initiator, target = _ranks("access_errors", transport=transport)
    e = initiator.value
    for name in ("write_oob", "read_oob"):
        assert e[name] is not None, f"{name} was accepted"
        assert e[name][0] == "RemoteAccessError" and "out of bounds" in e[name][1], e[name]
        assert "rank 1" in e[name][1]
    for name in ("write_stale", "read_stale", "flag_stale"):
        assert e[name] is not None, f"{name} was accepted"
        assert e[name][0] == "RemoteAccessError" and "stale" in e[name][1], e[name]
    assert e["flag_unaligned"][0] == "RemoteAccessError" and "aligned" in e["flag_unaligned"][1]
    if transport in ("shm", "tcp", "shm+tcp"):  # a flag is polled in the arena: the native transports refuse others
        assert e["flag_outside"][0] == "RemoteAccessError" and "flags must live in the arena" in e["flag_outside"][1]
    assert target.value["after"] == 42  # the connection still works after the errors


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("transport", CONFORMING)
def test_channels_round_trip_dtypes_and_shapes(transport, mode):
    results = _ranks("channel_roundtrip", transport=transport, mode=mode, timeout=180)
    assert results[0].value == {"mismatches": []}


# The channel and ring teardown tests run processes: a channel or ring dropped from Python waits for its
# peers' last writes (settleFlag) in its destructor, which holds the GIL, so a peer that is a thread of the
# same process could not write them.
@pytest.mark.parametrize("transport", NATIVE)
def test_a_sender_keeps_its_channel_until_the_last_release_landed(transport):
    for r in run_ranks("exchange_then_teardown", transport=transport, pairs=200, messages=3):
        assert r.value["errors"] == [], f"rank {r.rank}: {r.value['errors'][:3]}"


@pytest.mark.extended  # (11 s; the default run is at its 10-minute budget)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_ring_keeps_its_block_until_the_last_ack_landed(transport):
    for r in run_ranks("ring_then_teardown", 3, transport=transport, rings=150):
        assert r.value["errors"] == [], f"rank {r.rank}: {r.value['errors'][:3]}"


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_closed_parameter_server_outlives_its_workers_last_flags(transport):
    for r in _ranks("ps_then_teardown", 2, transport=transport, servers=100):
        assert r.value["errors"] == [], f"rank {r.rank}: {r.value['errors'][:3]}"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_parameter_servers_take_many_small_gradients_as_one_message_per_owner(transport, world_size):
    # 190 small variables (laid out before the two large ones): one write to each other owner, plus one per
    # large gradient it owns; the averages are right every step.
    results = _ranks("ps_many_small", world_size, transport=transport)
    for r in results:
        assert r.value["wrong"] == [], f"rank {r.rank}: {r.value['wrong'][:3]}"
        assert r.value["writes"] == [r.value["owners"] + r.value["large"]] * 3, (r.rank, r.value)
    assert max(r.value["small"] for r in results) >= 90  # some rank pushes dozens of small gradients in a message


@pytest.mark.parametrize("transport", CONFORMING)
def test_dynamic_channel_shape_changes_every_step(transport):
    assert _ranks("dynamic_changing_shapes", transport=transport, steps=40)[1].value == {"wrong": 0}


@pytest.mark.parametrize("transport", NATIVE)
def test_steady_state_loop_registers_nothing(transport):
    for r in _ranks("steady_state_registrations", transport=transport, steps=30):
        before, after = r.value["before"], r.value["after"]
        assert after["registrations"] == before["registrations"], f"rank {r.rank}: {before} -> {after}"
        assert after["bytes_registered"] == before["bytes_registered"]
        if r.rank == 0:  # the sender looked its sources up, every time from the cache (verbs looks up more)
            assert after["cache_hits"] - before["cache_hits"] >= 2 * 30
        else:  # the receiver's buffers came back from the pool
            assert after["pool_reuses"] > before["pool_reuses"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", CONFORMING)
def test_ring_allreduce_matches_numpy(transport, world_size):
    # verbs runs in the SoftRoCE VM under CPU emulation: ~60k RDMA operations take 1-2 minutes there.
    results = _ranks("ring_allreduce", world_size, transport=transport, calls=4, timeout=400)
    for r in results:
        assert r.value["errors"] == [], f"rank {r.rank}: {r.value['errors'][:5]}"
    assert len({r.value["digest"] for r in results}) == 1, "ranks disagree on the result"


@pytest.mark.parametrize("transport", ["shm", "grpc", "rpc+shm"])
def test_ring_over_a_subgroup_reduces_only_its_members(transport):
    results = _ranks("subgroup_rings", 3, transport=transport)
    for r in results:
        group = [r.rank + 1.0] if r.rank == 1 else [1.0, 3.0]  # rank k contributes k+1
        mean = sum(group) / len(group)
        assert np.allclose(r.value["out"][0], np.full((5, 3), mean))
        assert np.allclose(r.value["out"][1], np.arange(7) * mean)
        assert "not among its members" in r.value["refused"]
