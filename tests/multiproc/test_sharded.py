"""Sharded data parallelism (rdkeras.parallel.sharded_optimizer, sharded_parameters): every shard mode trains what
one process trains -- weights and losses within 1e-5 -- with the workers bit-identical, while each worker holds 1/N
of the optimizer state ("parameters": and of the weights). The models run in the Keras-pattern launches
(tests/multiproc/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.multiproc.conftest import LAUNCHED_SHARD_MODES, SHARD_MODES, side_by_side
from tests.multiproc.test_keras_patterns import ROOT, TOLERANCE, _compare
from tests.ranks.patterns import PARAMETERS_PATTERNS, PARAMETERS_SHARDED, SHARDED

NAMES = list(SHARDED)
RUNS = [(name, mode) for mode in LAUNCHED_SHARD_MODES for name in NAMES] + [
    (name, "parameters") for name in PARAMETERS_SHARDED
]
pytestmark = pytest.mark.timeout(1200)


def _trains_as_one_process(runs: dict, name: str, mode: str) -> None:
    reference = {k: v for k, v in runs["one"][0][name].items() if k != "state"}
    assert "error" not in reference, reference["error"][-3000:]
    workers = [w[f"{name}@{mode}"] for w in runs["data"]]
    for rank, got in enumerate(workers):
        assert "error" not in got, f"worker {rank}:\n{got['error'][-3000:]}"
        _compare(got, reference, reference.get("tolerance", TOLERANCE), f"{name}, shard={mode}, worker {rank}")
    assert workers[0]["weights"] == workers[1]["weights"], "the workers' weights differ"


def _holds_half_the_state(runs: dict, name: str, mode: str) -> None:
    # Counted from the variables: every worker holds the whole model ("parameters": half of its trainable weights),
    # and at most half of the optimizer state one process holds (shards are padded to whole 64-byte lines, so one
    # may hold a little more than the other; each has its own iteration and learning rate), and together all of it.
    one = runs["one"][0][name]["state"]
    states = [worker[f"{name}@{mode}"]["state"] for worker in runs["data"]]
    # ("parameters" pads each layer's shard: up to 64 bytes a layer and slot.)
    padding = 2048 if mode == "parameters" else 128
    for state in states:
        if mode == "parameters":
            assert state["parameters"] <= 0.5 * one["parameters"] + padding, (states, one)
        else:
            assert state["parameters"] == one["parameters"]
        assert state["optimizer"] <= 0.5 * one["optimizer"] + 2 * padding, (states, one)
    assert sum(state["optimizer"] for state in states) >= one["optimizer"], (states, one)
    assert sum(state["parameters"] for state in states) >= one["parameters"], (states, one)


def _told_once_of_a_save_in_part(runs: dict, mode: str) -> None:
    # Two saves of each model by Keras itself on each worker: told once per worker, mixed precision's
    # LossScaleOptimizer included (Keras saves the outer optimizer).
    for rank, worker in enumerate(runs["data"]):
        told = [m for name in NAMES for m in worker[f"{name}@{mode}"]["told_saved_in_part"]]
        assert len(told) == len(NAMES), f"worker {rank}, shard={mode}: {told}"
        assert all("RDMAStrategy.export(model, path)" in m for m in told), told


@pytest.mark.parametrize(("name", "mode"), RUNS)
def test_a_sharded_model_trains_what_one_process_trains(pattern_runs, name, mode):
    _trains_as_one_process(pattern_runs, name, mode)


@pytest.mark.parametrize(("name", "mode"), RUNS)
def test_each_worker_holds_half_the_optimizer_state(pattern_runs, name, mode):
    _holds_half_the_state(pattern_runs, name, mode)


@pytest.mark.extended
def test_sharded_optimizer_models_train_what_one_process_trains(tmp_path):
    # shard="optimizer" (the shared launch trains the others): every sharded model on 2 workers as one process, each
    # worker with half the optimizer state, a Keras save on a worker told once that it holds part of it, and the
    # exported files loading in plain Keras.
    runs = side_by_side({"one": (1, {"names": NAMES, "distributed": False}),
                         "data": (2, {"names": [f"{n}@optimizer" for n in NAMES], "distributed": True})},
                        str(tmp_path)) | {"tmp": str(tmp_path)}  # fmt: skip
    for name in NAMES:
        _trains_as_one_process(runs, name, "optimizer")
        _holds_half_the_state(runs, name, "optimizer")
    _told_once_of_a_save_in_part(runs, "optimizer")
    _exports_load_in_plain_keras(runs, [(name, "optimizer") for name in NAMES])


@pytest.mark.extended
def test_the_guides_patterns_train_with_sharded_parameters_as_one_process(tmp_path):
    # An Embedding with Adam (its rows gathered, duplicates unsummed, as one process applies them); fine-tuning:
    # a frozen base, fit, unfreeze, recompile (the weights laid out anew), fit again; and evaluate before fit,
    # validation, a second fit, predict and set_weights on sharded weights.
    runs = side_by_side({"one": (1, {"names": PARAMETERS_PATTERNS, "distributed": False}),
                         "data": (2, {"names": [f"{n}@parameters" for n in PARAMETERS_PATTERNS], "distributed": True})},
                        str(tmp_path))  # fmt: skip
    for name in PARAMETERS_PATTERNS:
        reference = runs["one"][0][name]
        assert "error" not in reference, reference["error"][-3000:]
        workers = [w[f"{name}@parameters"] for w in runs["data"]]
        for rank, got in enumerate(workers):
            assert "error" not in got, f"worker {rank}:\n{got['error'][-3000:]}"
            _compare(got, reference, reference.get("tolerance", TOLERANCE), f"{name}, parameters, worker {rank}")
        assert workers[0]["weights"] == workers[1]["weights"], f"{name}: the workers' weights differ"


def test_sharded_parameters_refuse_a_keras_save_naming_export(pattern_runs):
    for worker in pattern_runs["data"]:
        for name in PARAMETERS_SHARDED:
            assert "strategy.export(model, path) on every worker" in worker[f"{name}@parameters"]["refused_save"]


@pytest.mark.parametrize("mode", LAUNCHED_SHARD_MODES)
def test_a_keras_save_on_one_worker_says_once_that_it_holds_part_of_the_optimizer(pattern_runs, mode):
    _told_once_of_a_save_in_part(pattern_runs, mode)


def _exports_load_in_plain_keras(runs: dict, trained: list) -> None:
    # RDMAStrategy.export gathered the shards: each file, loaded by a process that never imports rdkeras, holds the
    # optimizer state one process's file holds -- iteration, moments, loss scale -- as one process trained it.
    tmp = runs["tmp"]
    paths = {(name, label): os.path.join(tmp, name, label, "model.keras")
             for name, label in [*((n, "one") for n in NAMES), *trained]}  # fmt: skip
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from tests.ranks.patterns import load_optimizer;"
        "print('@@' + json.dumps(load_optimizer(sys.argv[2:])))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")} | {"PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), *paths.values()], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    loaded = json.loads(lines[0][2:])
    assert not loaded["rdkeras_imported"]
    for name, mode in trained:
        want = loaded["files"][paths[(name, "one")]]
        tolerance = runs["one"][0][name].get("tolerance", TOLERANCE)
        got = loaded["files"][paths[(name, mode)]]
        assert len(got) == len(want) > 2, f"{name}, shard={mode}: {len(got)} optimizer variables, not {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=tolerance,
                                       atol=tolerance, err_msg=f"{name}, shard={mode}, variable {i}")  # fmt: skip


def test_an_exported_sharded_model_loads_in_plain_keras_with_its_whole_optimizer_state(pattern_runs):
    _exports_load_in_plain_keras(pattern_runs, RUNS)


@pytest.mark.extended
def test_gpt2_on_4_workers_trains_what_one_process_trains_in_every_shard_mode(tmp_path):
    # The bar at 4 workers: KerasHub's GPT-2 with Adam and clipnorm, within 1e-5, the workers bit-identical,
    # each holding at most a quarter of the optimizer state ("parameters": and of the weights), padding aside.
    name, modes = "sharded_gpt2_adam_clipnorm", (*SHARD_MODES, "parameters")
    runs = {"one": (1, {"names": [name], "distributed": False}),
            "four": (4, {"names": [f"{name}@{m}" for m in modes], "distributed": True})}  # fmt: skip
    done = side_by_side(runs, str(tmp_path))
    reference = done["one"][0][name]
    want = {k: v for k, v in reference.items() if k != "state"}
    assert "error" not in reference, reference["error"][-3000:]
    for mode in modes:
        workers = [w[f"{name}@{mode}"] for w in done["four"]]
        for rank, got in enumerate(workers):
            assert "error" not in got, f"worker {rank}:\n{got['error'][-3000:]}"
            _compare(got, want, TOLERANCE, f"{name}, shard={mode}, worker {rank} of 4")
            assert got["state"]["optimizer"] <= 0.25 * reference["state"]["optimizer"] + 4096, (mode, got["state"])
            if mode == "parameters":
                assert got["state"]["parameters"] <= 0.25 * reference["state"]["parameters"] + 2048, got["state"]
        assert all(w["weights"] == workers[0]["weights"] for w in workers), f"shard={mode}: the workers differ"
