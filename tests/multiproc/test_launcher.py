"""The local launcher: plain Keras scripts, dying workers, notebook functions."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

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
    done = _launch("-n", "2", str(TESTS_DIR / "ranks" / "dying_worker.py"))
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert "finished training" not in done.stdout
    # The cause in the survivor's words (its report), then what the launcher saw of the victim.
    assert re.search(r"worker rank 1 failed first \(rank 1 .*exited.*, seen by rank 0; then signal 9\)", done.stderr), (
        done.stderr[-2000:]
    )
    # The survivor failed by itself, naming the dead rank, well before the grace period ran out.
    survivor = "\n".join(line for line in done.stdout.splitlines() if line.startswith("[0]"))
    assert re.search(r"rank 1 .*(exited|closed|left)", survivor), survivor[-3000:]
    # ... and reported it, naming rank 1, then exited by itself (or, its teardown slow on a loaded machine, was
    # killed once it had reported: not after the launcher's 10 s grace for ranks that said nothing).
    after = re.search(r"rank 0: (exit code 1|killed by the launcher \(it reported[^)]*\)), ([0-9.]+) s after rank 1; "
                      r"it reported rank 1 ", done.stderr)  # fmt: skip
    assert after and float(after.group(2)) < 10, done.stderr[-1000:]
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


def _start_sleepers(tmp_path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    worker = str(TESTS_DIR / "ranks" / "sleepy_worker.py")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdkeras.launch", "-n", "2", *extra, worker, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV if env is None else env,
        cwd=REPO,
        # A shell that ran pytest in the background left SIGINT ignored, which the launcher would inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank-{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
        time.sleep(0.05)
    return proc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killing_the_launcher_takes_its_workers_with_it(tmp_path, sig):
    """However the launcher ends, nothing of its job is left: no worker, no worker's child, no reports folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start_sleepers(tmp_path, env={**ENV, "TMPDIR": str(tmp)})
    pids = [int((tmp_path / f"{name}-{r}").read_text().split()[0]) for r in (0, 1) for name in ("rank", "child")]
    assert all(_alive(p) for p in pids) and [p.name for p in tmp.glob("rdkeras-reports-*")], list(tmp.iterdir())
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while (any(_alive(p) for p in pids) or list(tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"workers or their children still running after {sig.name}"
    assert not list(tmp.iterdir()), f"left in TMPDIR after {sig.name} of the launcher"
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig


def test_workers_get_local_ranks_and_the_chiefs_progress_bar_redraws_in_place(tmp_path):
    proc = _start_sleepers(tmp_path, "--log-dir", str(tmp_path / "logs"))
    places = [tuple(map(int, (tmp_path / f"rank-{r}").read_text().split()[1:])) for r in (0, 1)]
    assert places == [(0, 2, 2), (1, 2, 2)]  # LOCAL_RANK, LOCAL_WORLD_SIZE, world
    deadline = time.monotonic() + 30
    log = tmp_path / "logs" / "worker-0.log"
    while b"step 2/3\n" not in (log.read_bytes() if log.exists() else b"") and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    # Bytes forwarded as written: each redraw returns to column 0 and starts again with the prefix.
    assert b"\r[0] step 0/3" in out and b"\r[0] step 1/3" in out and b"\r[0] step 2/3\n" in out, out
    assert b"[0] step 1/3\n" not in out  # no carriage return turned into a newline
    assert log.read_bytes().count(b"\r") == 3  # the log holds the worker's own bytes, unprefixed


def test_tensorflow_start_up_lines_are_quiet_unless_verbose(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(
        "import sys\n"
        "sys.stderr.write('WARNING: All log messages before absl::InitializeLog() is called\\n')\n"
        "print('real output')\n"
    )
    for verbose, shown in (([], False), (["--verbose"], True)):
        done = _launch("-n", "2", *verbose, "--log-dir", str(tmp_path / "logs"), str(script), timeout=60)
        assert done.returncode == 0, done.stderr
        assert "[1] real output" in done.stdout
        assert ("absl::InitializeLog" in done.stdout) == shown, done.stdout
        assert "absl::InitializeLog" in (tmp_path / "logs" / "worker-1.log").read_text()  # the log keeps it


def test_two_launchers_make_one_job_across_nodes(tmp_path):
    """--nnodes 2 on one machine: the token comes from the user's secret file, no variable set."""
    from rdkeras.launch import free_port

    port = str(free_port())
    env = {k: v for k, v in ENV.items() if k != "RDKERAS_JOB_TOKEN"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    script = str(TESTS_DIR / "ranks" / "ring_sum.py")
    launcher = [sys.executable, "-m", "rdkeras.launch", "--master-addr", "127.0.0.1"]
    procs = [
        subprocess.Popen(
            [*launcher, "--nnodes", "2", "--node-rank", str(node), "--master-port", port, "-n", "2", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    sums = sorted(re.findall(r"^\[(\d)\] rank \d local \d of 4: sum (\S+)", outs[0] + outs[1], re.M))
    assert sums == [("0", "10.0"), ("1", "10.0"), ("2", "10.0"), ("3", "10.0")], outs
    assert (tmp_path / "config" / "rdkeras" / "job-token").exists()


def test_two_launchers_print_one_verdict_naming_a_rank_of_the_other_node(tmp_path):
    """Rank 3 (node 1) kills itself: node 0's launcher, whose ranks only lost it, names it too, and both exit
    alike (node 0's launcher merges every node's reports: rdkeras.launch_nodes)."""
    from rdkeras.launch import free_port

    env = {k: v for k, v in ENV.items() if k != "RDKERAS_JOB_TOKEN"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    launcher = [sys.executable, "-m", "rdkeras.launch", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    worker = [str(TESTS_DIR / "ranks" / "verdict_worker.py"), "3", "20", "KILL"]
    procs = [subprocess.Popen([*launcher, "--nnodes", "2", "--node-rank", str(node), "-n", "2", *worker],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
             for node in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=180)[0] for p in procs]
    firsts = [re.search(r"^rdkeras\.launch: (.*)$", out, re.M) for out in outs]
    assert all(firsts), outs
    assert firsts[0].group(1) == firsts[1].group(1), outs  # type: ignore[union-attr]
    assert firsts[0].group(1).startswith("worker rank 3 failed first ("), outs  # type: ignore[union-attr]
    assert procs[0].returncode == procs[1].returncode == 1, outs


def test_a_module_runs_with_dash_m_as_python_has_it():
    done = _launch("-n", "2", "--timeout", "120", "-m", "tests.ranks.ring_sum", timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(re.findall(r"^\[(\d)\] rank \d local \d of 2: sum 3\.0$", done.stdout, re.M)) == ["0", "1"]
