"""Sharded data parallelism (rdkeras.parallel.sharded_optimizer): every shard mode trains what one process trains
-- weights and losses within 1e-5 -- with the workers bit-identical, while each worker holds 1/N of the optimizer
state."""

from __future__ import annotations

import pytest

from tests.multiproc.test_keras_patterns import TOLERANCE, _compare, _side_by_side
from tests.ranks.patterns import SHARDED

NAMES = list(SHARDED)
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sharded"))
    return _side_by_side({
        "one": (1, {"names": NAMES, "distributed": False}),
        "optimizer": (2, {"names": NAMES, "distributed": True, "strategy_kwargs": {"shard": "optimizer"},
                          "label": "optimizer"}),
        "gradients": (2, {"names": NAMES, "distributed": True, "strategy_kwargs": {"shard": "gradients"},
                          "label": "gradients"}),
    }, tmp)  # fmt: skip


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
@pytest.mark.parametrize("name", NAMES)
def test_a_sharded_model_trains_what_one_process_trains(runs, name, mode):
    reference = {k: v for k, v in runs["one"][0][name].items() if k != "state"}
    assert "error" not in reference, reference["error"][-3000:]
    workers = [w[name] for w in runs[mode]]
    for rank, got in enumerate(workers):
        assert "error" not in got, f"worker {rank}:\n{got['error'][-3000:]}"
        _compare(got, reference, TOLERANCE, f"{name}, shard={mode}, worker {rank}")
    assert workers[0]["weights"] == workers[1]["weights"], "the workers' weights differ"


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
@pytest.mark.parametrize("name", NAMES)
def test_each_worker_holds_half_the_optimizer_state(runs, name, mode):
    # Counted from the variables: every worker holds the whole model, and half of the optimizer state one process
    # holds (each shard padded to whole 64-byte lines; the iteration and learning rate on both).
    one = runs["one"][0][name]["state"]
    for worker in runs[mode]:
        state = worker[name]["state"]
        assert state["parameters"] == one["parameters"]
        assert 0.5 * one["optimizer"] - 64 <= state["optimizer"] <= 0.5 * one["optimizer"] + 256, (state, one)
