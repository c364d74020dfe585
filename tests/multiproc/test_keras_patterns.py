"""The conformance suite: the Keras guides' patterns (tests/ranks/patterns.py) compute on 2 data-parallel workers
what they compute in one plain Keras process -- weights, the history's losses and metrics, evaluate's and predict's
results -- and the workers end bit-identical.

All patterns run in two launches side by side (one process, 2 workers), each importing TensorFlow once; those that
apply also as a 2-stage pipeline (-m extended)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.multiproc.conftest import side_by_side
from tests.ranks.patterns import PATTERNS, PIPELINE_PATTERNS

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(PATTERNS)
TOLERANCE = 1e-5  # float32 sums over the replicas' rows in another order; mixed precision patterns give their own
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tmp(pattern_runs):
    return pattern_runs["tmp"]


@pytest.fixture(scope="module")
def runs(pattern_runs):
    """Every pattern in one process, and on 2 data-parallel workers (tests/multiproc/conftest.py)."""
    return pattern_runs["one"][0], pattern_runs["data"]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """The patterns that apply, in one process and as a 2-stage pipeline of 2 micro-batches, cut automatically
    (-m extended; the default run checks pipelines against one process in tests/multiproc/test_model_parallel.py)."""
    pipeline = {"parallelism": "pipeline", "micro_batches": 2}
    done = side_by_side({
        "one": (1, {"names": PIPELINE_PATTERNS, "distributed": False, "label": "pipeline-reference"}),
        "pipeline": (2, {"names": PIPELINE_PATTERNS, "distributed": True, "strategy_kwargs": pipeline,
                         "label": "pipeline"}),
    }, str(tmp_path_factory.mktemp("pipelines")))  # fmt: skip
    return done["one"][0], done["pipeline"]


def _leaves(value, path=""):
    """(path, leaf) of a pattern's results: numbers and lists of numbers (or strings) at the leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}/{key}")
    elif isinstance(value, list) and value and isinstance(value[0], (dict, list)) and not _numeric(value):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _numeric(value) -> bool:
    try:
        np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return True


def _compare(got: dict, want: dict, tolerance: float, who: str) -> None:
    got_leaves = dict(_leaves(got))
    for path, expected in _leaves(want):
        assert path in got_leaves, f"{who}: {path} missing"
        actual = got_leaves[path]
        if _numeric(expected):
            np.testing.assert_allclose(
                np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=tolerance, atol=tolerance,
                err_msg=f"{who}: {path}",
            )  # fmt: skip
        else:
            assert actual == expected, f"{who}: {path}"


@pytest.mark.parametrize("name", NAMES)
def test_the_pattern_computes_what_one_process_computes(runs, name):
    _check(runs, name)


@pytest.mark.extended
@pytest.mark.parametrize("name", PIPELINE_PATTERNS)
def test_the_pattern_as_a_pipeline_computes_what_one_process_computes(pipeline_runs, name):
    _check(pipeline_runs, name)


def _check(runs, name):
    one, workers = runs
    reference = one[name]
    assert "error" not in reference, f"{name} failed in one process:\n{reference['error'][-3000:]}"
    for rank, results in enumerate(workers):
        got = results[name]
        assert "error" not in got, f"{name} failed on worker {rank}:\n{got['error'][-3000:]}"
        if rank > 0:  # what the chief-only callbacks wrote, the chief reports
            reference = {k: v for k, v in reference.items() if k != "saved"}
        _compare(got, reference, reference.get("tolerance", TOLERANCE), f"{name}, worker {rank}")
    shared = [{k: v for k, v in w[name].items() if k not in ("wire", "saved", "plan")} for w in workers]
    assert shared[0] == shared[1], f"{name}: the workers differ"  # bit for bit


def test_lora_sends_only_the_lora_gradients(runs):
    # GPT-2 with LoRA of rank 2: 2 steps exchange (by recursive doubling, 2 workers) each trainable gradient once a
    # step, plus the loss counts and the epoch's metric state; the frozen weights, 11x more bytes, never go.
    wire = runs[1][0]["kerashub_lora"]["wire"]
    assert wire["all"] > 10 * wire["trainable"]
    assert 2 * wire["trainable"] <= wire["sent"] <= 2 * wire["trainable"] + (64 << 10), wire


def test_kerashub_files_saved_under_the_strategy_load_without_rdkeras(runs, tmp):
    # The chief saved the trained GPT-2 as a .keras file and as a KerasHub preset; a process that never imports
    # rdkeras loads both, as Keras's and KerasHub's own classes, with the weights the workers ended with.
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[2]); from tests.ranks.patterns import load_saved;"
        "print('@@' + json.dumps(load_saved(sys.argv[1])))"
    )
    folder = os.path.join(tmp, "kerashub_gpt2", "distributed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")} | {"PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", code, folder, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    loaded = json.loads(lines[0][2:])
    assert not loaded["rdkeras_imported"] and loaded["file_class"] == "GPT2CausalLM"
    trained = runs[1][0]["kerashub_gpt2"]["weights"]
    assert loaded["file"] == trained and loaded["preset"] == trained


@pytest.mark.extended
def test_the_pipelines_were_cut_automatically_alike_on_every_worker(pipeline_runs):
    # No placement: the layers were timed on rank 0 (at fit, on a micro-batch's rows: 16 / 2) and cut into 2 stages
    # balanced by those times, the same cut on both workers.
    for name in PIPELINE_PATTERNS:
        plans = [w[name]["plan"] for w in pipeline_runs[1]]
        assert plans[0] == plans[1], name
        assert "automatic placement: 2 stages balanced by measured cost; expected speed-up" in plans[0], name
        assert "cut 0: after " in plans[0], name
    assert "(layers timed on batches of 8 rows)" in pipeline_runs[1][0]["fit_default_shuffle"]["plan"]
