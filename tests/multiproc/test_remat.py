"""keras.RematScope under data and pipeline parallelism (issue 46): a model built under the scope trains on 2 workers
as one process trains it. Keras's TensorFlow ``remat`` fails inside a traced step for every mode but "activations"
(``tf.recompute_grad`` refuses keyword arguments there), and its recompute draws Dropout's mask anew; rdkeras's
(``keras_internals.remat``, while a strategy lives) recomputes what the forward pass computed, so the reference is one
plain Keras process without rematerialization, which computes the same numbers (and Keras's own "activations" mode,
which works in one process)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import launch_in_turn
from tests.ranks.remat_workers import PLACEMENT

TRAIN = "tests.ranks.remat_workers:train"
PIPELINE = {"parallelism": "pipeline", "micro_batches": 2, "placement": PLACEMENT}
CASES = {  # key -> (RematScope mode, strategy keywords, more train() keywords)
    "data@full": ("full", {}, {}),
    "data@list_of_layers": ("list_of_layers", {}, {"names": ("hidden1", "dropout", "hidden2")}),
    "pipeline@full": ("full", PIPELINE, {}),
    "pipeline@larger_than": ("larger_than", PIPELINE, {"threshold": 64}),
    "pipeline@activations": ("activations", PIPELINE, {}),
}


@pytest.fixture(scope="module")
def runs():
    """One launch of 2 workers: the references (in each process, without a strategy), then every case in turn."""
    jobs = {"one": (TRAIN, {"mode": None}), "one@activations": (TRAIN, {"mode": "activations"})}
    jobs.update({key: (TRAIN, {"mode": mode, "strategy_kwargs": kwargs, **more})
                 for key, (mode, kwargs, more) in CASES.items()})  # fmt: skip
    return launch_in_turn(jobs, 2, timeout=300)


def _close(a: dict, b: dict, what: str) -> None:
    for i, (x, y) in enumerate(zip(a["weights"], b["weights"], strict=True)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5, err_msg=f"{what}: weight {i}")
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=0, atol=1e-5, err_msg=f"{what}: losses")


def test_keras_own_activations_mode_computes_what_no_rematerialization_computes(runs):
    one = runs("one")[0].value
    _close(runs("one@activations")[0].value, one, "Keras's own remat, activations mode, one process")


@pytest.mark.parametrize("key", list(CASES))
def test_a_model_built_under_a_remat_scope_trains_as_one_process(runs, key):
    one = runs("one")[0].value
    ranks = [r.value for r in runs(key)]
    for rank, value in enumerate(ranks):
        _close(value, one, f"{key}, rank {rank}")
        assert value["patches_after"] == [], f"{key}: rank {rank} left Keras patched: {value['patches_after']}"
    if key.startswith("data@"):  # every replica holds the same weights, bit for bit
        assert ranks[0]["weights"] == ranks[1]["weights"], key
