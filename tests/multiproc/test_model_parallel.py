"""Model and hybrid parallelism: placed models train exactly like one process would.

Each launch trains on every worker, then rank 0 trains the same model (same
initial weights, same data, the same global batch) in one plain Keras process
and reports the largest weight and prediction differences.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.conftest import launch_in_turn, run_ranks

TARGET = "tests.ranks.mp_workers"
# The module fixtures below run several tests' trainings in one launch.
pytestmark = pytest.mark.timeout(900)
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


# The split-model cases: (kind, placement, workers, micro-batches, transport).
SPLITS = {
    "mlp-2": ("mlp", MLP_2, 2, 1, "shm"),
    "mlp-3stages-2micro": ("mlp", MLP_3, 3, 2, "shm"),
    "cnn-2-tcp": ("cnn", CNN_2, 2, 1, "tcp"),
    "cnn-2-4micro": ("cnn", CNN_2, 2, 4, "shm"),
}
# The other tests' runs, by key: (workers, function, kwargs, transport).
RUNS = {
    "skip": (
        3,
        "train_and_compare",
        {"kind": "skip", "placement": {"a": 0, "b": 1, "add": 2, "out": 2}, "micro_batches": 4},
        "shm",
    ),
    "skip gpipe": (
        3,
        "train_and_compare",
        {"kind": "skip", "placement": {"a": 0, "b": 1, "add": 2, "out": 2}, "micro_batches": 4, "schedule": "gpipe"},
        "shm",
    ),
    "partial": (
        2,
        "train_and_compare",
        {"kind": "cnn", "placement": CNN_2, "micro_batches": 4, "samples": 88},
        "shm",
    ),
    "two inputs": (
        2,
        "train_and_compare",
        {"kind": "two_inputs", "placement": {"left": 0, "right": 1, "join": 1, "out": 1}},
        "grpc",
    ),
    "rnn": (
        2,
        "train_and_compare",
        {"kind": "rnn", "placement": {"embed": 0, "gru": 0, "lstm": 1, "out": 1}, "micro_batches": 2, "samples": 64},
        "shm",
    ),
    "rnn gpipe": (
        2,
        "train_and_compare",
        {
            "kind": "rnn",
            "placement": {"embed": 0, "gru": 0, "lstm": 1, "out": 1},
            "micro_batches": 2,
            "samples": 64,
            "schedule": "gpipe",
            "parallelism": "pipeline",
        },
        "shm",
    ),
    "bad placement": (
        2,
        "bad_placement",
        {"kind": "mlp", "placement": {"fc1": 0, "fc2": 1, "fc3": 0, "out": 1}},
        "shm",
    ),
}


# More cases of what the others check (a pipeline over tcp, GPipe's schedule): run with -m extended.
EXTENDED = {
    "cnn-2-tcp",
    "rnn gpipe",
    "skip gpipe",
    "mlp-3stages-2micro",
    "mlp-2",
}  # (3 stages and micro-batches: "skip")


def _launch(workers: int, config):
    """Every run here on `workers` workers, one after another in one launch (TensorFlow imports once a worker); the
    EXTENDED ones only where -m selects extended tests."""
    extended = "extended" in (config.option.markexpr or "").replace("not extended", "")
    jobs = {
        key: (f"{TARGET}:train_and_compare", {"kind": k, "placement": p, "micro_batches": m}, {"RDKERAS_TRANSPORT": t})
        for key, (k, p, w, m, t) in SPLITS.items()
        if w == workers and (extended or key not in EXTENDED)
    }
    for key, (w, function, kwargs, transport) in RUNS.items():
        if w == workers and (extended or key not in EXTENDED):
            jobs[key] = (f"{TARGET}:{function}", kwargs, {"RDKERAS_TRANSPORT": transport})
    return launch_in_turn(jobs, workers, timeout=900)


def _cases(keys):
    return [pytest.param(key, marks=[pytest.mark.extended] if key in EXTENDED else []) for key in keys]


@pytest.fixture(scope="module")
def two_workers(request):
    return _launch(2, request.config)


@pytest.fixture(scope="module")
def three_workers(request):
    return _launch(3, request.config)


@pytest.mark.parametrize("case", _cases(SPLITS))
def test_split_model_matches_one_process(case, request):
    kind, _, workers, micro, _ = SPLITS[case]
    results = request.getfixturevalue({2: "two_workers", 3: "three_workers"}[workers])(case)
    first = _check(results)
    rows = 16 // micro
    assert all(e["transfer"] == "static" for e in first["plan"])
    # Activations cross once per micro-batch; the labels once a step, the whole batch (the loss stage splits them).
    assert all(e["transfers"] == micro and e["shape"][0] == rows for e in first["plan"] if e["kind"] != "labels")
    assert [(e["transfers"], e["shape"]) for e in first["plan"] if e["kind"] == "labels"] == [(1, [16])]
    if kind == "cnn":
        assert _edges(first) == [("flatten:0->1", "static", True), ("labels[0]->1", "static", False)]
        assert f"({rows}, 72)" in first["plan_text"]
    # With micro-batches, the plain Dense and Conv2D layers compute their weight gradients once a step (the
    # softmax output per micro-batch): still equal to one process.
    deferred = {
        "cnn-2-4micro": r"stage 0 conv1, conv2 \(keeps [^)]*\); stage 1 fc1 \(keeps [^)]*\)$",
        "mlp-3stages-2micro": r"stage 0 fc1 .*; stage 1 fc2 .*; stage 2 fc3 ",
    }
    assert (case in deferred) == ("weight gradients once a step" in first["plan_text"])
    if case in deferred:
        line = f"weight gradients once a step, over all micro-batches: {deferred[case]}"
        assert re.search(line, first["plan_text"], re.M)
    if workers == 3:
        assert _edges(first) == [
            ("fc1:0->1", "static", True),
            ("fc2:0->2", "static", True),
            ("labels[0]->2", "static", False),
        ]


def test_a_partial_last_batch_leaves_the_full_batches_static(two_workers):
    # 88 samples = 5 batches of 16 + one of 8: the five run the static plan (4 rows a micro-batch), the last the
    # dynamic one (2 rows a micro-batch); fit, evaluate and predict still equal one process.
    first = _check(two_workers("partial"))
    assert [(e["name"], e["transfer"], e["shape"], e["transfers"]) for e in first["plan"]] == [
        ("flatten:0->1", "static", [4, 72], 4),
        ("labels[0]->1", "static", [16], 1),
    ]


STASHED = {
    "skip": "stage 0 3 (.*); stage 1 2 (.*); stage 2 1 ",
    "skip gpipe": "stage 0 4 (.*); stage 1 4 (.*); stage 2 4 ",
}


@pytest.mark.parametrize(
    ("run", "stashed"),
    [
        pytest.param(run, stashed, marks=[pytest.mark.extended] if run in EXTENDED else [])
        for run, stashed in STASHED.items()
    ],
)
def test_skip_connection_across_two_boundaries(three_workers, run, stashed):
    # a (worker 0) feeds b (worker 1) and, skipping worker 1, add (worker 2); 4 micro-batches, either schedule.
    first = _check(three_workers(run))
    # 1F1B keeps at most as many micro-batches' activations as there are stages from here to the last; GPipe all.
    schedule = "gpipe" if "gpipe" in run else "1f1b"
    assert re.search(f"schedule {schedule}: micro-batches' activations stashed at most: {stashed}", first["plan_text"])
    assert _edges(first) == [
        ("a:0->1", "static", True),
        ("a:0->2", "static", True),
        ("b:0->2", "static", True),
        ("labels[0]->2", "static", False),
    ]


def test_two_inputs_on_different_workers(two_workers):
    first = _check(two_workers("two inputs"))
    # The reader sends input xb straight to worker 1 (no gradient: it is data).
    assert _edges(first) == [
        ("input:xb->1", "static", False),
        ("left:0->1", "static", True),
        ("labels[0]->1", "static", False),
    ]


@pytest.mark.parametrize("run", _cases(["rnn", "rnn gpipe"]))
def test_variable_length_sequences_use_dynamic_edges(two_workers, run):
    first = _check(two_workers(run))
    assert _edges(first) == [("gru:0->1", "dynamic", True), ("labels[0]->1", "static", False)]
    assert "known only at run time (variable length)" in first["plan_text"]


# (GPipe's order is also checked against one process by the skip and RNN runs; 4 workers take 20 s here.)
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_hybrid_two_replicas_of_a_two_stage_pipeline(schedule):
    results = run_ranks(
        "train_and_compare",
        4,
        module=TARGET,
        timeout=300,
        kind="mlp",
        placement=MLP_2,
        micro_batches=4,
        parallelism="hybrid",
        schedule=schedule,
    )
    _check(results)


def test_bad_placement_fails_on_every_worker_at_compile(two_workers):
    for r in two_workers("bad placement"):
        assert "cycle between stages 0, 1" in r.value["error"]


@pytest.mark.parametrize("victim", [0, 1], ids=["reader-dies", "loss-stage-dies"])
def test_a_stage_killed_mid_fit_makes_the_other_fail_fast_naming_it(victim):
    results = run_ranks("stage_dies", 2, module=TARGET, check=False, timeout=120, victim=victim,
                        schedule="1f1b" if victim else "gpipe")  # fmt: skip
    killed, survivor = results[victim], results[1 - victim]
    assert killed.returncode == -9
    assert survivor.returncode == 0, survivor.output[-2000:]
    assert survivor.value["error"] is not None, "the survivor never noticed"
    _, message = survivor.value["error"]
    assert f"rank {victim}" in message, message
    assert survivor.value["seconds"] < 15  # the heartbeat (or the closed connection) names it, not the 60 s timeout
