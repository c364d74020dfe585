"""A rank that hangs but lives, on either of two "hosts" (network namespaces, 2 ranks each): both launchers print
the same verdict naming the hung rank and the collective it has not entered, and exit with the same non-zero
status; every survivor, on either host, names it -- all within the progress timeout + 10 s of the hang
(docs/reliability.md, "Hung ranks"). ``-m slow`` hangs every rank in every way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from rdkeras.testing import netns
from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
WHY = netns.why_not()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"two namespaces: {WHY}"), pytest.mark.timeout(900)]
WORKER = str(TESTS_DIR / "ranks" / "verdict_worker.py")
PROGRESS_S = 3.0
BOUND_S = PROGRESS_S + 10


def _trial(tmp_path, victim: int, how: str, port: int) -> tuple[list[str], list[int], list[float]]:
    """Both launchers' outputs, exit statuses and the wall-clock times they exited at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", RDKERAS_TIMEOUT="60", RDKERAS_HEARTBEAT_TIMEOUT="2",
               RDKERAS_PROGRESS_TIMEOUT=str(PROGRESS_S),
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip  # one per-user secret: the job token
    with netns.hosts(2) as (a, b):

        def launch(host: netns.Host, node_rank: int) -> subprocess.Popen:
            nodes = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", a.addr, f"--master-port={port}"]
            argv = [sys.executable, "-m", "rdkeras.launch", *nodes, "-n", "2", WORKER, str(victim), "3", how]
            return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, cwd=REPO)  # fmt: skip

        procs = [launch(a, 0), launch(b, 1)]
        ended: list[float | None] = [None, None]
        deadline = time.monotonic() + 240
        try:
            while None in ended and time.monotonic() < deadline:
                for i, p in enumerate(procs):
                    if ended[i] is None and p.poll() is not None:
                        ended[i] = time.time()
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    return outs, [p.returncode for p in procs], [t if t is not None else float("inf") for t in ended]


def hung_on_a_host(tmp_path, victim: int, how: str, port: int) -> tuple[list[str], float]:
    """What is wrong when rank `victim` (0, 1 on the first host; 2, 3 on the second) hangs (`how`) before its 4th
    allreduce, and the seconds from the hang to the last survivor's error or launcher's exit."""
    outs, statuses, ended = _trial(tmp_path, victim, how, port)
    both = "\n".join(outs)
    hung = re.search(rf"^\[{victim}\] rank {victim} hangs \({how}\) before allreduce #4 at (\S+)$", both, re.M)
    if hung is None:
        return [f"rank {victim} did not hang:\n" + "\n---\n".join(o[-3000:] for o in outs)], 0.0
    hung_at, problems = float(hung.group(1)), []
    took = [t - hung_at for t in ended]
    for rank in {0, 1, 2, 3} - {victim}:
        failed = re.search(rf"^\[{rank}\] rank {rank} failed at (\S+): PeerError: rank {victim} has not entered "
                           r"allreduce #4 \(ring grads\)", outs[rank // 2], re.M)  # fmt: skip
        if failed is None:
            problems.append(f"rank {rank} did not name rank {victim} and its op:\n{outs[rank // 2][-3000:]}")
        else:
            took.append(float(failed.group(1)) - hung_at)
    verdicts = [re.search(r"^rdkeras\.launch: (.*)$", out, re.M) for out in outs]
    lines = [v.group(1) if v else f"(none: {out[-2000:]})" for v, out in zip(verdicts, outs, strict=True)]
    if lines[0] != lines[1]:
        problems.append("the launchers' verdicts differ:\n" + "\n".join(lines))
    expected = f"worker rank {victim} failed first (rank {victim} has not entered allreduce #4 (ring grads)"
    problems += [f"the launcher of host {i} does not name rank {victim} and its op: {line}"
                 for i, line in enumerate(lines) if not line.startswith(expected)]  # fmt: skip
    if not statuses[0] == statuses[1] != 0:
        problems.append(f"the launchers exited {statuses}")
    if "was named hung by a peer" not in outs[victim // 2] or "hang_workers.py" not in outs[victim // 2]:
        problems.append(f"the hung rank {victim} did not log its stack:\n{outs[victim // 2][-3000:]}")
    if max(took) >= BOUND_S:
        problems.append(f"named {max(took):.1f} s after the hang (launchers, then survivors: {took})")
    print(f"two hosts: rank {victim} hung ({how}): the survivors named it within {max(took[2:], default=0):.1f} s, "
          f"the launchers exited {took[0]:.1f} and {took[1]:.1f} s after the hang")  # fmt: skip
    return problems, max(took)


def test_a_rank_hung_on_the_second_host_is_named_by_both_launchers(tmp_path):
    netns.cleanup_stale()
    problems, _ = hung_on_a_host(tmp_path, 3, "callback", 29561)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_way_of_hanging_every_rank_of_two_hosts(tmp_path):
    """3 ways x 4 ranks (rank 0, which hosts the store, included): 12 trials, their worst time printed."""
    netns.cleanup_stale()
    failures, worst = [], 0.0
    for i, (victim, how) in enumerate((v, h) for v in range(4) for h in ["callback", "lock", "numpy_function"]):
        problems, took = hung_on_a_host(tmp_path, victim, how, 29562 + i)
        worst = max(worst, took)
        failures += [f"rank {victim}, {how}: {p}" for p in problems]
    print(f"two hosts: 12 trials, worst time to name {worst:.1f} s; {len(failures)} problems")
    assert not failures, "\n".join(failures)
