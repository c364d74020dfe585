"""The Keras-pattern launches, shared by the conformance suite (test_keras_patterns.py) and the sharded models
(test_sharded.py): one process, and 2 data-parallel workers, each importing TensorFlow once for all of them."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.conftest import run_ranks
from tests.ranks.patterns import PARAMETERS_SHARDED, PATTERNS, SHARDED

MODULE = "tests.ranks.patterns"
SHARD_MODES = ("optimizer", "gradients")
# The modes the shared launch trains every sharded model in; "optimizer" (stage 2 without the reduce-scatter) runs in
# the extended test_sharded_optimizer_models_train_what_one_process_trains, and the guides' patterns with
# shard="parameters" in another extended test: the default run stays in its budget.
LAUNCHED_SHARD_MODES = ("gradients",)


def side_by_side(runs: dict, tmp: str) -> dict:
    """The launches at once (each waits on its peers and on TensorFlow's start-up much of the time)."""
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {key: pool.submit(run_ranks, "run", world, module=MODULE, timeout=600, tmp=tmp, **kwargs)
                   for key, (world, kwargs) in runs.items()}  # fmt: skip
        return {key: [r.value for r in future.result()] for key, future in futures.items()}


@pytest.fixture(scope="session")
def pattern_runs(tmp_path_factory):
    """Every pattern and sharded model in one process; on 2 workers every pattern, and every sharded model once
    per launched shard mode (``name@mode``)."""
    tmp = str(tmp_path_factory.mktemp("patterns"))
    sharded = [f"{name}@{mode}" for mode in LAUNCHED_SHARD_MODES for name in SHARDED] + [
        f"{name}@parameters" for name in PARAMETERS_SHARDED
    ]
    done = side_by_side({"one": (1, {"names": [*PATTERNS, *SHARDED], "distributed": False}),
                         "data": (2, {"names": [*PATTERNS, *sharded], "distributed": True})}, tmp)  # fmt: skip
    return {**done, "tmp": tmp}
