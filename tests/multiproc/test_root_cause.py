"""The launcher names the root cause, not the first exit: the workers report what ended them and the launcher
prints the rank they agree on (rdkeras.reports)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
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


HEARTBEAT_S = 3.0
KERAS = ROOT / "examples" / "mnist_mlp.py"
RING = [str(SCRIPT), "-1", "0"]  # no rank raises: a ring exchange until one is stopped
SLOW_EXIT = [*RING, "30"]  # ... and each rank's exit takes 30 s
KERAS_FIT = [str(KERAS), "--epochs", "10000", "--samples", "256"]


def _stall_under_the_launcher(command: list[str], stalled: int, ready: str) -> tuple[str, float]:
    """Launches 3 workers of `command` and SIGSTOPs rank `stalled` once `ready` is in their output (or 2 s after they
    started: ``""``); returns the
    launcher's stderr and the seconds from the stop to the launcher's exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RDKERAS_TRANSPORT": "shm", "TF_CPP_MIN_LOG_LEVEL": "3",
           "RDKERAS_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)}  # fmt: skip
    launcher = subprocess.Popen([sys.executable, "-m", "rdkeras.launch", "-n", "3", *command], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(launcher.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    with launcher:
        try:
            deadline = time.monotonic() + 180
            while (
                len(pids := _worker_pids(launcher.pid)) < 3 or ready not in "".join(out)
            ) and launcher.poll() is None:
                assert time.monotonic() < deadline, "".join(out)[-3000:]
                time.sleep(0.1)
            time.sleep(0 if ready else 2)  # (into the ring's steps)
            os.kill(pids[stalled], signal.SIGSTOP)
            stopped = time.monotonic()
            err = launcher.stderr.read()  # type: ignore[union-attr]
            launcher.wait(timeout=60)
            return err, time.monotonic() - stopped
        finally:
            launcher.kill()
            reader.join(timeout=30)


def _verdict_problems(err: str, stalled: int, seconds: float) -> list[str]:
    """What is wrong with the launcher's verdict on a stalled rank, and with how long it took to end the job."""
    out = []
    first = next((line for line in err.splitlines() if "failed first" in line), "")
    if f"worker rank {stalled} failed first (rank {stalled} stalled: no heartbeat" not in first:
        out.append(f"the verdict does not name rank {stalled} stalled: {first!r}")
    for rank in {0, 1, 2} - {stalled}:
        line = next((x for x in err.splitlines() if x.startswith(f"rdkeras.launch: rank {rank}: ")), "")
        if f"it reported rank {stalled} stalled" not in line:  # whose error it reported
            out.append(f"rank {rank}'s line does not say it reported rank {stalled}'s stall: {line!r}")
    if re.search(r"-[0-9.]+ s\b|inf s", err):
        out.append("a negative or infinite time")
    if seconds >= HEARTBEAT_S + 10:
        out.append(f"the launcher ended the job {seconds:.1f} s after the stop")
    return out


# The chief of a ring whose ranks take 30 s to exit (the launcher does not wait that out once they reported), and
# rank 1 of a Keras fit; with -m slow, another rank of the ring, and trials of the fit at every rank.
@pytest.mark.parametrize(
    ("command", "stalled"),
    [
        pytest.param(SLOW_EXIT, 0, id="ring-0-slow-exit", marks=pytest.mark.extended),  # (test_hang_launches: default)
        pytest.param(KERAS_FIT, 1, id="keras-1", marks=pytest.mark.extended),
        pytest.param(RING, 2, id="ring-2", marks=pytest.mark.slow),
    ],
)
def test_a_stalled_rank_is_named_by_the_launcher(command, stalled):
    err, seconds = _stall_under_the_launcher(command, stalled, "Epoch 2/" if command is KERAS_FIT else "")
    print(f"rank {stalled} stopped: the launcher ended the job {seconds:.1f} s later")
    problems = _verdict_problems(err, stalled, seconds)
    assert not problems, "\n".join(problems) + "\n" + err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_stalled_keras_job_ends_within_the_heartbeat_timeout_every_time():
    """9 launched Keras fits, each rank stopped in turn: every verdict names it, and each job ends in time."""
    failures, times = [], []
    for trial in range(9):
        err, seconds = _stall_under_the_launcher(KERAS_FIT, trial % 3, "Epoch 2/")
        times.append(seconds)
        if problems := _verdict_problems(err, trial % 3, seconds):
            failures.append(f"trial {trial} (rank {trial % 3}): {problems}")
    print(f"9 stalls of a launched Keras fit: the launcher ended the job {min(times):.1f}-{max(times):.1f} s after")
    assert not failures, "\n".join(failures)
