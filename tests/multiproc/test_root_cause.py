"""The launcher names the root cause, not the first exit: the workers report what ended them and the launcher
prints the rank they agree on (rdkeras.reports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parents[1] / "ranks" / "raising_worker.py"


def _launch(culprit: int, step: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RDKERAS_TRANSPORT": "shm", "RDKERAS_TIMEOUT": "60"}
    return subprocess.run(
        [sys.executable, "-m", "rdkeras.launch", "-n", "3", str(SCRIPT), str(culprit), str(step)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _named_first(done: subprocess.CompletedProcess) -> str:
    return next(line for line in done.stderr.splitlines() if "failed first" in line)


@pytest.mark.parametrize("culprit", [1, 2])
def test_a_rank_that_raises_is_named_first(culprit):
    done = _launch(culprit, 50)
    assert done.returncode == 1, done.stderr[-3000:]
    first = _named_first(done)
    assert f"worker rank {culprit} failed first (uncaught ValueError: a bug in rank {culprit}'s own code" in first
    assert "inf s" not in done.stderr
    # Every other rank stopped at once, naming the culprit (not waiting out a timeout).
    others = [line for line in done.stderr.splitlines() if line.startswith("rdkeras.launch: rank ")]
    assert len(others) == 3 and all(f"rank {culprit}" in line for line in others if f"rank {culprit}:" not in line)


@pytest.mark.slow
def test_a_rank_that_raises_is_named_first_every_time():
    wrong = []
    for trial in range(20):
        culprit = trial % 3
        first = _named_first(_launch(culprit, 5 + trial))
        if f"worker rank {culprit} failed first" not in first:
            wrong.append(f"trial {trial}: {first}")
    assert not wrong, "\n".join(wrong)


def _worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's workers (from their environment)."""
    out = {}
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RDKERAS_RANK=")), None)
        if rank is not None:
            out[rank] = int(child)
    return out


# The chief by default; another rank with -m slow (test_stalls stalls every rank under the supervisor).
@pytest.mark.parametrize("stalled", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stalled_rank_is_named_by_the_launcher(stalled):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RDKERAS_TRANSPORT": "shm", "RDKERAS_HEARTBEAT_TIMEOUT": "3"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rdkeras.launch", "-n", "3", str(SCRIPT), "-1", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(pids := _worker_pids(launcher.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # into the ring's steps
        os.kill(pids[stalled], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    first = next(line for line in err.splitlines() if "failed first" in line)
    assert f"worker rank {stalled} failed first (rank {stalled} stalled: no heartbeat" in first, err[-3000:]
    assert "killed by the launcher" in first and "inf s" not in err
