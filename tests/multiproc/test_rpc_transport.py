"""The RPC-over-fast-transport baseline (rpc+shm, rpc+tcp, rpc+verbs) passes the transports' conformance
and failure tests, and what it carries is a real TensorMessage on a native wire."""

from __future__ import annotations

import pytest

from tests.conftest import VERBS, run_ranks
from tests.multiproc import test_conformance as conformance
from tests.multiproc import test_failures as failures

RPC = ["rpc+shm", "rpc+tcp", pytest.param("rpc+verbs", marks=VERBS.marks)]


@pytest.mark.parametrize("transport", RPC)
def test_bytes_arrive_intact_for_every_size(transport):
    conformance.test_bytes_arrive_intact_for_every_size(transport)


@pytest.mark.parametrize("transport", RPC)
def test_flags_never_overtake_data(transport):
    receiver = run_ranks("flag_ordering", transport=transport, iterations=200)[1].value
    assert receiver == {"bad": 0, "iterations": 200}


@pytest.mark.parametrize("transport", RPC)
def test_out_of_bounds_and_stale_keys_raise(transport):
    conformance.test_out_of_bounds_and_stale_keys_raise(transport)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("transport", RPC)
def test_channels_round_trip_dtypes_and_shapes(transport, mode):
    conformance.test_channels_round_trip_dtypes_and_shapes(transport, mode)


@pytest.mark.parametrize("transport", RPC)
def test_dynamic_channel_shape_changes_every_step(transport):
    conformance.test_dynamic_channel_shape_changes_every_step(transport)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", RPC)
def test_ring_allreduce_matches_numpy(transport, world_size):
    conformance.test_ring_allreduce_matches_numpy(transport, world_size)


def test_ring_over_a_subgroup_reduces_only_its_members():
    conformance.test_ring_over_a_subgroup_reduces_only_its_members("rpc+shm")


@pytest.mark.parametrize("victim", [0, 1], ids=["sender-dies", "receiver-dies"])
@pytest.mark.parametrize("transport", ["rpc+shm", "rpc+tcp"])
def test_killing_the_peer_mid_transfer_names_it_within_10s(transport, victim):
    failures.test_killing_the_peer_mid_transfer_names_it_within_10s(transport, victim)


def test_messages_are_tensor_messages_split_into_frames_over_the_inner_wire():
    (sender, receiver) = run_ranks("rpc_wire_format", transport="rpc+shm", module="tests.multiproc.rpc_workers")
    # 3 MiB + header in 1 MiB frames: 4 frames, each one native write plus a flag.
    assert sender.value["inner_writes"] == 4 and sender.value["inner_flags"] == 4
    assert sender.value["serialized_is_tensor_message"]
    assert receiver.value["parsed"] == {"dtype": "<f4", "shape": [3, 262144], "equal": True}
    assert receiver.value["acks"] == 4  # one release per frame slot


def test_fit_over_rpc_matches_single_process():
    # Both RPC transports, ring allreduce and parameter servers, in one launch; global batch 16.
    import numpy as np

    configs = [["mlp", t, m] for t in ("rpc+shm", "rpc+tcp") for m in ("allreduce", "ps")]
    results = run_ranks(
        "fit_model_many", 2, transport="shm", timeout=300, module="tests.multiproc.keras_workers", configs=configs,
        batch=16,
    )  # fmt: skip
    for kind, transport, mode in configs:
        key = f"{kind}/{transport}/{mode}"
        runs = [r.value[key] for r in results]
        assert runs[0]["transport"] == transport
        for got, want in zip(runs[0]["weights"], results[0].value["mlp/reference"]["weights"], strict=True):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5, err_msg=key)
        assert runs[1]["weights"] == runs[0]["weights"] and runs[1]["evaluate"] == runs[0]["evaluate"], key
