"""Model parallelism without a placement: rdkeras cuts the model into balanced stages itself, and the
cut model trains exactly like one process would."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_ranks
from tests.multiproc.test_model_parallel import TARGET, _check

pytestmark = pytest.mark.timeout(600)


# (By default, test_keras_patterns.py's pipeline patterns check an automatic cut trains like one process.)
@pytest.mark.extended
def test_an_automatically_cut_pipeline_trains_like_one_process():
    results = run_ranks(
        "train_and_compare",
        2,
        module=TARGET,
        timeout=300,
        kind="mlp",
        placement=None,  # and no stages=: model parallelism cuts the model into as many stages as workers
        micro_batches=2,
    )
    first = _check(results, tol=1e-5)
    text = first["plan_text"]
    assert "automatic placement: 2 stages balanced by measured cost; expected speed-up" in text
    assert "cut 0: after " in text
    # Timed again at fit, on the micro-batches' rows (16 / 2), before any pipeline was built.
    assert "with 2 (layers timed on batches of 8 rows)" in text
    for r in results:  # every worker chose the same cut (rank 0's timings are shared)
        assert r.value["plan_text"] == text


@pytest.mark.extended  # (alternate_layers is off by default)
def test_a_layer_too_large_to_balance_alternates_between_the_stages():
    # widen | big | narrow | out: between layers, one stage gets `big` whole. Alternating it by micro-batch gives
    # each stage half; both keep its weights, sum their partial gradients and apply the same update.
    results = run_ranks(
        "train_and_compare",
        2,
        module=TARGET,
        timeout=300,
        kind="dominant",
        placement=None,
        micro_batches=4,
        alternate_layers=True,
        # Kept whatever it measures (the 5% rule is test_partition's), on times given (big dominant, as it is on
        # a quiet machine): alternation is the subject, not the clock.
        sharing_gain=-1.0,
        layer_ms={"widen": 0.1, "big": 1.0, "narrow": 0.1, "out": 0.05},
    )
    first = _check(results, tol=1e-5)
    text = first["plan_text"]
    assert re.search(r"big alternates: stage 1 runs it for 2 of 4 micro-batches, stage 0 for the rest", text), text
    # Micro-batches 0 and 2 send big's output over; 1 and 3 widen's, to big on stage 1.
    assert [e["producer"] for e in first["plan"] if e["kind"] == "activation"] == ["big:0"], text
    assert re.search(r"big:0 -> narrow +0->1 +\(4, 1024\) +float32 +32.8 KB .*\(2 of 4 micro-batches\)", text), text
    assert re.search(r"widen:0 -> big +0->1 +\(4, 1024\) +float32 +32.8 KB .*\(2 of 4 micro-batches\)", text), text
    # Each stage computes big's weight gradient once a step, over the micro-batches it ran big for.
    deferred = re.search(r"weight gradients once a step, over all micro-batches: stage 0 ([^(]*) .*; stage 1 ([^(]*) ",
                         text)  # fmt: skip
    assert deferred and "big" in deferred.group(1).split(", ") and "big" in deferred.group(2).split(", "), text


@pytest.mark.extended  # (8 s; tests/unit/test_partition.py checks the split in the default run)
def test_a_layer_too_large_to_balance_is_split_by_rows_between_the_stages():
    # The same model; `big` split by the rows of every micro-batch instead: stage 0 runs it for the first rows,
    # stage 1 (under the name big__twin) for the rest; the two sum their partial gradients of its weights. Batches
    # of 64 in 2 micro-batches are split where they were timed (32 rows); the predictions' (64 rows, one
    # micro-batch) at the same share; the validation data's partial batch (dynamic) runs the cut between layers.
    results = run_ranks(
        "train_and_compare",
        2,
        module=TARGET,
        timeout=300,
        kind="dominant",
        placement=None,
        micro_batches=2,
        batch=64,
        samples=128,
        split_layers=True,
        # Kept whatever it measures (the 5% rule is test_partition's), on times given (a loaded machine's once moved
        # 7 of 32 rows): the split is the subject, not the clock.
        sharing_gain=-1.0,
        layer_ms={"widen": 0.1, "big": 1.0, "narrow": 0.1, "out": 0.05},
    )
    first = _check(results, tol=1e-5)
    text = first["plan_text"]
    found = re.search(r"big split by rows: stage 1 runs it for (\d+) of every 32 rows of each micro-batch", text)
    assert found, text
    moved = int(found.group(1))
    assert 8 <= moved <= 24, text  # (about half: big's time decides)
    assert re.search(r"tried: big split by rows measured [\d.]+ \| [\d.]+ ms against [\d.]+ \| [\d.]+ ms", text), text
    shapes = {e["producer"]: e["shape"] for e in first["plan"] if e["kind"] == "activation"}
    assert shapes == {"big:0": [32 - moved, 1024], "big__rows:1": [moved, 1024]}, text
    assert "stage 1: 4 layers: big__twin, big__join, narrow, out" in text, text
    # Each stage computes big's weight gradient once a step, over its rows of every micro-batch.
    deferred = re.search(r"weight gradients once a step, over all micro-batches: stage 0 ([^(]*) .*; stage 1 ([^(]*) ",
                         text)  # fmt: skip
    assert deferred and "big" in deferred.group(1).split(", ") and "big__twin" in deferred.group(2).split(", "), text
