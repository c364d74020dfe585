"""Failures: a dead peer is named quickly, a wrong token is refused, a missing rank is named."""

from __future__ import annotations

import secrets

import pytest

from tests.conftest import ALL_TRANSPORTS, run_ranks


@pytest.mark.parametrize("victim", [0, 1], ids=["sender-dies", "receiver-dies"])
@pytest.mark.parametrize("transport", [*ALL_TRANSPORTS, "rpc+shm", "rpc+tcp"])
def test_killing_the_peer_mid_transfer_names_it_within_10s(transport, victim):
    results = run_ranks("kill_peer_during_transfer", transport=transport, check=False, timeout=90, victim=victim)
    killed, survivor = results[victim], results[1 - victim]
    assert killed.returncode == -9
    assert survivor.returncode == 0, survivor.output[-2000:]
    assert survivor.value["error"] is not None, "the survivor never noticed"
    kind, message = survivor.value["error"]
    assert kind == "PeerError", message
    assert f"rank {victim}" in message
    assert survivor.value["seconds"] < 10


def test_wrong_job_token_is_refused():
    tokens = [{"RDKERAS_JOB_TOKEN": secrets.token_hex(16)} for _ in range(2)]
    good, bad = run_ranks("connect_only", per_rank_env=tokens, check=False, timeout=60, timeout_s=5)
    assert bad.value["error"][0] == "AuthenticationError", bad.output[-2000:]
    assert "token" in bad.value["error"][1].lower()
    # Rank 0 never hears from a legitimate rank 1, and names it.
    assert good.value["error"][0] == "PeerError"
    assert "rank 1 never reached the rendezvous within 5 s" in good.value["error"][1]


def test_rendezvous_timeout_names_the_missing_rank():
    host, other = run_ranks("connect_only", world_size=3, only_ranks=[0, 1], check=False, timeout=60, timeout_s=3)
    kind, message = host.value["error"]
    assert kind == "PeerError"
    assert "rank 2 never reached the rendezvous within 3 s" in message, message
    # Rank 1 either times out the same way or sees rank 0 (the store's host) leave first.
    kind, message = other.value["error"]
    assert kind == "PeerError" and ("rank 2 never reached" in message or "rank 0" in message), message
