"""The GPU check run by tests/gpu/run.sh: weights against one process, throughput against one GPU alone.

Exits non-zero, naming what differed, when a distributed run's weights do not match one process's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from rdkeras.launch import spawn_call

GLOBAL_BATCH = 32
TOLERANCE = 1e-4  # GPU kernels may reorder float sums; CPU runs match to 1e-5
ENV = {"PYTHONPATH": os.getcwd(), "TF_CPP_MIN_LOG_LEVEL": "2", "RDKERAS_TIMEOUT": "120"}


def data_parallel_worker(batch: int, distributed: bool) -> dict:
    """One worker of the data-parallel check: its GPU by local rank, then the test suite's MLP fit."""
    from rdkeras import devices
    from tests.ranks.keras_workers import fit_model

    device = devices.use_local_gpu()
    result = fit_model("mlp", batch, epochs=2, distributed=distributed)
    result["device"] = device.describe()
    return result


def pipeline_worker() -> dict:
    """One stage of the 2-stage pipeline check (rank 0 also trains the same model alone and compares)."""
    from rdkeras import devices
    from tests.ranks.mp_workers import train_and_compare

    device = devices.use_local_gpu()
    result = train_and_compare("mlp", {"fc1": 0, "fc2": 0, "fc3": 1, "out": 1}, micro_batches=2)
    result["device"] = device.describe()
    return result


def _run(target: str, workers: int, **kwargs) -> list:
    results = spawn_call(f"tests.gpu.check:{target}", workers, kwargs, timeout=300, env=ENV)
    for r in results:
        if r.returncode != 0:
            sys.exit(f"FAIL: {target} rank {r.rank} exited {r.returncode}:\n{r.output[-3000:]}")
    return [r.value for r in results]


def main() -> int:
    failures = []
    (alone,) = _run("data_parallel_worker", 1, batch=GLOBAL_BATCH, distributed=False)
    pair = _run("data_parallel_worker", 2, batch=GLOBAL_BATCH, distributed=True)
    print(f"data parallel: devices {[w['device'] for w in pair]}, one process on {alone['device']}")
    diff = max(
        float(np.max(np.abs(np.array(a) - np.array(b))))
        for a, b in zip(pair[0]["weights"], alone["weights"], strict=True)
    )
    same = pair[0]["weights"] == pair[1]["weights"]
    print(f"data parallel: 2 workers vs one process, max weight difference {diff:.2e}; workers identical: {same}")
    if diff > TOLERANCE or not same:
        failures.append(f"data parallel weights differ from one process by {diff:.2e} (workers identical: {same})")
    if not all("GPU" in w["device"] for w in pair):
        failures.append(f"a data-parallel worker did not use a GPU: {[w['device'] for w in pair]}")
    stages = _run("pipeline_worker", 2)
    print(
        f"pipeline: devices {[s['device'] for s in stages]}, max weight difference {stages[0]['max_weight_diff']:.2e}"
    )
    if stages[0]["max_weight_diff"] > TOLERANCE or stages[0]["digest"] != stages[1]["digest"]:
        failures.append(f"pipeline weights differ from one process by {stages[0]['max_weight_diff']:.2e}")
    # Throughput: the benchmark's own same-run ratios (one worker alone on one GPU vs two workers).
    bench = {**os.environ, "TF_FORCE_GPU_ALLOW_GROWTH": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    for args in (
        ["fit", "--model", "fcn5", "--transports", "shm,tcp", "--steps", "30", "--batch-size", "64"],
        ["fit", "--model", "vgg16", "--parallel", "model", "--transports", "shm", "--steps", "20"],
    ):
        print(f"$ python -m rdkeras.bench {' '.join(args)}", flush=True)
        done = subprocess.run([sys.executable, "-m", "rdkeras.bench", *args, "--out", "bench-results/gpu"], env=bench)
        if done.returncode != 0:
            failures.append(f"rdkeras.bench {' '.join(args)} exited {done.returncode}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
