"""Model and hybrid parallelism: placed models train exactly like one process would.

Each launch trains on every worker, then rank 0 trains the same model (same
initial weights, same data, the same global batch) in one plain Keras process
and reports the largest weight and prediction differences.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import run_ranks

MLP_2 = {"fc1": 0, "fc2": 0, "fc3": 1, "out": 1}
MLP_3 = {"fc1": 0, "fc2": 1, "fc3": 2, "out": 2}
CNN_2 = {"conv*": 0, "pool1": 0, "fc1": 1, "out": 1}  # flatten is unplaced: it follows conv2 to worker 0


def _check(results, *, tol=1e-5):
    first = results[0].value
    assert first["max_weight_diff"] <= tol, f"weights differ from one process by {first['max_weight_diff']}"
    for r in results:
        v = r.value
        assert v["digest"] == first["digest"], f"rank {r.rank} ends with other weights than rank 0"
        assert v["evaluate"] == first["evaluate"], f"rank {r.rank} evaluates differently"
        assert v["history"] == first["history"], f"rank {r.rank} saw other epoch logs"
        assert v["pred_digest"] == first["pred_digest"], f"rank {r.rank} predicts differently"
    for key, values in first["history"].items():
        np.testing.assert_allclose(values, first["ref_history"][key], rtol=1e-5, err_msg=key)
    for key, value in first["evaluate"].items():
        np.testing.assert_allclose(value, first["ref_evaluate"][key], rtol=1e-5, err_msg=key)
    assert first["max_pred_diff"] <= tol, f"predictions differ from one process by {first['max_pred_diff']}"
    return first


def _edges(result):
    return [(e["name"], e["transfer"], e["grad"]) for e in result["plan"]]


@pytest.mark.parametrize(
    ("kind", "placement", "workers", "micro", "transport"),
    [
        ("mlp", MLP_2, 2, 1, "shm"),
        ("mlp", MLP_3, 3, 2, "shm"),
        ("cnn", CNN_2, 2, 1, "tcp"),
        ("cnn", CNN_2, 2, 4, "shm"),
    ],
    ids=["mlp-2", "mlp-3stages-2micro", "cnn-2-tcp", "cnn-2-4micro"],
)
def test_split_model_matches_one_process(kind, placement, workers, micro, transport):
    results = run_ranks(
        "train_and_compare",
        workers,
        transport=transport,
        module="tests.multiproc.mp_workers",
        timeout=240,
        kind=kind,
        placement=placement,
        micro_batches=micro,
    )
    first = _check(results)
    rows = 16 // micro
    assert all(e["transfer"] == "static" for e in first["plan"])
    if kind == "cnn":
        assert _edges(first) == [("flatten:0->1", "static", True), ("labels[0]->1", "static", False)]
        assert f"({rows}, 72)" in first["plan_text"]
    if workers == 3:
        assert _edges(first) == [
            ("fc1:0->1", "static", True),
            ("fc2:0->2", "static", True),
            ("labels[0]->2", "static", False),
        ]


def test_skip_connection_across_two_boundaries():
    # a (worker 0) feeds b (worker 1) and, skipping worker 1, add (worker 2).
    results = run_ranks(
        "train_and_compare",
        3,
        module="tests.multiproc.mp_workers",
        timeout=240,
        kind="skip",
        placement={"a": 0, "b": 1, "add": 2, "out": 2},
        micro_batches=2,
    )
    first = _check(results)
    assert _edges(first) == [
        ("a:0->1", "static", True),
        ("a:0->2", "static", True),
        ("b:0->2", "static", True),
        ("labels[0]->2", "static", False),
    ]


def test_two_inputs_on_different_workers():
    results = run_ranks(
        "train_and_compare",
        2,
        transport="grpc",
        module="tests.multiproc.mp_workers",
        timeout=240,
        kind="two_inputs",
        placement={"left": 0, "right": 1, "join": 1, "out": 1},
    )
    first = _check(results)
    # The reader sends input xb straight to worker 1 (no gradient: it is data).
    assert _edges(first) == [
        ("input:xb->1", "static", False),
        ("left:0->1", "static", True),
        ("labels[0]->1", "static", False),
    ]


def test_variable_length_sequences_use_dynamic_edges():
    results = run_ranks(
        "train_and_compare",
        2,
        module="tests.multiproc.mp_workers",
        timeout=240,
        kind="rnn",
        placement={"embed": 0, "gru": 0, "lstm": 1, "out": 1},
        micro_batches=2,
        samples=64,
    )
    first = _check(results)
    assert _edges(first) == [("gru:0->1", "dynamic", True), ("labels[0]->1", "static", False)]
    assert "known only at run time (variable length)" in first["plan_text"]


def test_hybrid_two_replicas_of_a_two_stage_pipeline():
    results = run_ranks(
        "train_and_compare",
        4,
        module="tests.multiproc.mp_workers",
        timeout=300,
        kind="mlp",
        placement=MLP_2,
        micro_batches=2,
        parallelism="hybrid",
    )
    _check(results)


def test_bad_placement_fails_on_every_worker_at_compile():
    results = run_ranks(
        "bad_placement",
        2,
        module="tests.multiproc.mp_workers",
        timeout=120,
        kind="mlp",
        placement={"fc1": 0, "fc2": 1, "fc3": 0, "out": 1},
    )
    for r in results:
        assert "cycle between stages 0, 1" in r.value["error"]
