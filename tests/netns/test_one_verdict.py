"""One verdict across two "hosts" (network namespaces): a rank killed or stopped on one host, and both launchers
print the same verdict, naming that rank, and exit with the same status. No TensorFlow: ring workers."""

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


def _trial(tmp_path, victim: int, how: str, port: int) -> tuple[list[str], list[int], float]:
    """Both launchers' outputs and exit statuses, and the seconds from start to the last launcher's exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env.update(PYTHONPATH=str(REPO), RDKERAS_TIMEOUT="60", RDKERAS_HEARTBEAT_TIMEOUT="5",
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip  # one per-user secret: the job token
    with netns.hosts(2) as (a, b):

        def launch(host: netns.Host, node_rank: int) -> subprocess.Popen:
            nodes = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", a.addr, f"--master-port={port}"]
            argv = [sys.executable, "-m", "rdkeras.launch", *nodes, "-n", "2", WORKER, str(victim), "30", how]
            return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, cwd=REPO)  # fmt: skip

        began = time.monotonic()
        procs = [launch(a, 0), launch(b, 1)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        took = time.monotonic() - began
    return outs, [p.returncode for p in procs], took


def _verdict(out: str) -> str:
    """The launcher's first verdict line."""
    found = re.search(r"^rdkeras\.launch: (.*)$", out, re.M)
    assert found, out[-3000:]
    return found.group(1)


def _check(outs: list[str], statuses: list[int], victim: int) -> None:
    lines = [_verdict(out) for out in outs]
    assert lines[0] == lines[1], "\n---\n".join(o[-3000:] for o in outs)
    assert lines[0].startswith(f"worker rank {victim} failed first ("), lines[0]
    assert statuses[0] == statuses[1] != 0, statuses


def test_a_rank_killed_on_the_second_host_is_named_by_both_launchers(tmp_path):
    netns.cleanup_stale()
    outs, statuses, _ = _trial(tmp_path, 3, "KILL", 29521)
    _check(outs, statuses, 3)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 3])
@pytest.mark.parametrize("how", ["KILL", "STOP"])
def test_one_verdict_in_every_trial(tmp_path, victim, how):
    netns.cleanup_stale()
    took = []
    for trial in range(5):
        outs, statuses, seconds = _trial(tmp_path, victim, how, 29522 + trial)
        _check(outs, statuses, victim)
        took.append(seconds)
    print(
        f"one verdict: victim {victim}, SIG{how}: 5/5 trials agree; launch to last exit {min(took):.1f}-"
        f"{max(took):.1f} s"
    )
