"""Model parallelism without a placement: rdkeras cuts the model into balanced stages itself, and the
cut model trains exactly like one process would."""

from __future__ import annotations

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
