"""Model parallelism without a placement: rdkeras cuts the model into balanced stages itself, and the
cut model trains exactly like one process would."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_ranks
from tests.multiproc.test_model_parallel import TARGET, _check

pytestmark = pytest.mark.timeout(600)


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
    )
    first = _check(results, tol=1e-5)
    text = first["plan_text"]
    assert re.search(r"big alternates: stage 1 runs it for 2 of 4 micro-batches, stage 0 for the rest", text), text
    # Micro-batches 0 and 2 send big's output over; 1 and 3 widen's, to big on stage 1.
    assert [e["producer"] for e in first["plan"] if e["kind"] == "activation"] == ["big:0"], text
    assert re.search(r"big:0 -> narrow +0->1 +\(4, 1024\) +float32 +32.8 KB .*\(2 of 4 micro-batches\)", text), text
    assert re.search(r"widen:0 -> big +0->1 +\(4, 1024\) +float32 +32.8 KB .*\(2 of 4 micro-batches\)", text), text
