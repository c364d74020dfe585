"""The local launcher: plain Keras scripts, dying workers, notebook functions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np

import rdkeras
from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3", "RDKERAS_TIMEOUT": "60"}


def _launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rdkeras.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=REPO,
    )


def test_plain_keras_script_runs_on_two_workers():
    script = REPO / "examples" / "mnist_mlp.py"
    # The script is single-process Keras plus the two strategy lines.
    code = [line.split("#")[0].strip() for line in script.read_text().splitlines()]
    assert [line for line in code if "strategy" in line.split("=")[0] or "strategy.scope" in line] == [
        "strategy = rdkeras.RDMAStrategy()",
        "with strategy.scope():",
    ]
    done = _launch("-n", "2", str(script), "--epochs", "2", "--samples", "512")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finals = re.findall(r"^\[(\d)\] final loss=(\S+) accuracy=(\S+) workers=2", done.stdout, re.M)
    assert sorted(r for r, _, _ in finals) == ["0", "1"], done.stdout[-2000:]
    assert finals[0][1:] == finals[1][1:]  # same weights, same averaged evaluation
    assert "[0] Epoch 2/2" in done.stdout and "[1] Epoch" not in done.stdout  # progress bar on the chief only


def test_dead_worker_stops_the_job_and_is_named():
    started = time.monotonic()
    done = _launch("-n", "2", str(TESTS_DIR / "multiproc" / "dying_worker.py"))
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert "finished training" not in done.stdout
    assert "worker rank 1 failed first (signal 9)" in done.stderr, done.stderr[-2000:]
    # The survivor failed by itself, naming the dead rank, well before the grace period ran out.
    survivor = "\n".join(line for line in done.stdout.splitlines() if line.startswith("[0]"))
    assert re.search(r"rank 1 .*(exited|closed|left)", survivor), survivor[-3000:]
    # ... and exited by itself (not killed by the launcher after its 10 s grace).
    after = re.search(r"rank 0: exit code 1, ([0-9.]+) s after rank 1", done.stderr)
    assert after and float(after.group(1)) < 10, done.stderr[-1000:]
    assert elapsed < 120
    leftover = subprocess.run(["pgrep", "-f", "dying_worker.py"], capture_output=True, text=True).stdout
    assert leftover.strip() == ""


def _allreduce_rank() -> list[float]:
    import rdkeras as rk

    with rk.Engine() as eng:
        ring = eng.ring("nb", 1 << 16)
        (out,) = ring([np.full(4, float(eng.rank + 1), np.float32)])
        return out.tolist()


def test_launch_runs_a_function_on_workers_like_a_notebook():
    results = rdkeras.launch(_allreduce_rank, num_workers=2, env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert results == [[3.0] * 4, [3.0] * 4]
