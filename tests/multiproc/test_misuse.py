"""API misuse across ranks gets a clear error on every rank, never a silent wrong result or a hang."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks, run_threads


@pytest.mark.parametrize("how", ["size", "dtype", "split"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ring_calls_that_disagree_across_ranks_raise_everywhere(transport, how):
    results = run_threads("ring_disagreement", 3, transport=transport, odd_rank=1, how=how)
    for r in results:
        assert r.value["error"] is not None, f"rank {r.rank} got a result from a mismatched allreduce"
    # The ranks next to the odd one see the mismatch itself; the others hear of it, naming who stopped.
    for r in results:
        kind, message, rank = r.value["error"]
        if kind == "EngineError":
            assert "passed other tensors than this rank" in message and "same sizes and dtype" in message
        else:
            assert kind == "PeerError" and rank in (1, 2), r.value
    assert any(r.value["error"][0] == "EngineError" for r in results), [r.value for r in results]


@pytest.mark.parametrize("op", ["reduce_scatter", "allgather"])
def test_shard_calls_that_disagree_across_ranks_raise_everywhere(op):
    results = run_threads("shard_disagreement", 3, transport="shm", odd_rank=1, op=op)
    said = {"reduce_scatter": "passed other tensors than this rank", "allgather": "passed another shard size"}[op]
    for r in results:
        assert r.value["error"] is not None, f"rank {r.rank} got a result from a mismatched {op}"
        kind, message, rank = r.value["error"]
        assert (kind == "EngineError" and said in message) or (kind == "PeerError" and rank in (1, 2)), r.value
    assert any(r.value["error"][0] == "EngineError" for r in results), [r.value for r in results]


def test_variables_made_in_scope_start_from_the_chiefs_and_must_match():
    # What strategy.scope() does with the variables created in it (a custom loop's model and optimizer).
    for r in run_threads("new_variables", 2, odd_rank=-1):
        assert r.value == {"values": [[0.0, 0.0, 0.0], [[0, 0], [0, 0]]]}, r.value
    for r in run_threads("new_variables", 2, odd_rank=1):
        assert "the workers created different variables in strategy.scope()" in r.value["error"], r.value
        assert f"({2 + r.rank} here; 1 worker(s) differ from rank 0)" in r.value["error"], r.value


def test_a_rank_of_another_world_size_is_refused_by_name():
    sizes = [{"RDKERAS_WORLD_SIZE": "2"}, {"RDKERAS_WORLD_SIZE": "3"}]
    _, bad = run_ranks("connect_only", 2, per_rank_env=sizes, check=False, timeout=60, timeout_s=5)
    kind, message = bad.value["error"]
    assert kind == "AuthenticationError" and "job has 2 ranks, this one 3" in message, bad.value


def test_two_processes_claiming_one_rank_are_told_so():
    ranks = [{"RDKERAS_RANK": "1"}, {"RDKERAS_RANK": "1"}, {"RDKERAS_RANK": "0"}]
    results = run_ranks("connect_only", 3, per_rank_env=ranks, check=False, timeout=60, timeout_s=5)
    messages = [r.value["error"][1] for r in results[:2] if r.value and r.value["error"]]
    assert any("rank 1 is connected already" in m for m in messages), messages
