"""One verdict for an elastic job across two "hosts" (network namespaces, 2 workers each, ``--min-workers 3``):
two workers killed (one per host, or both on the second) or one hung on the second host end the job, and both
launchers print the agent's verdict, naming the worker and the cause, and exit with the same non-zero status
within a bound of the failure; a loss the group survives exits 0 on both (tests/netns/test_elastic_hosts.py)."""

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
SCRIPT = str(TESTS_DIR / "ranks" / "elastic_fit.py")
PROGRESS_S = 3.0
BOUND_S = 25.0  # from the failure to both launchers' exit (the workers' grace: 10 s; the stall check: progress)


def trial(tmp_path, fault: list[str], port: int, python: str = sys.executable, repo=REPO) -> dict:
    """Both launchers' outputs, exit statuses, and the seconds from the fault (the first worker's kill or hang,
    as printed) to each launcher's exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env.update(PYTHONPATH=str(repo), TF_CPP_MIN_LOG_LEVEL="3", RDKERAS_TIMEOUT="60", RDKERAS_HEARTBEAT_TIMEOUT="2",
               RDKERAS_PROGRESS_TIMEOUT=str(PROGRESS_S),
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip  # one per-user secret: the job token
    with netns.hosts(2) as (a, b):

        def launch(host: netns.Host, node_rank: int) -> subprocess.Popen:
            nodes = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", a.addr, f"--master-port={port}"]
            argv = [
                python,
                "-m",
                "rdkeras.launch",
                *nodes,
                "-n",
                "2",
                "--min-workers",
                "3",
                SCRIPT,
                str(tmp_path),
                *fault,
            ]
            return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, cwd=repo)  # fmt: skip

        procs = [launch(a, 0), launch(b, 1)]
        ended: list[float] = [float("inf")] * 2
        deadline = time.monotonic() + 300
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                for i, p in enumerate(procs):
                    if p.poll() is not None and ended[i] == float("inf"):
                        ended[i] = time.time()
                time.sleep(0.02)
            for i, p in enumerate(procs):
                if p.poll() is not None and ended[i] == float("inf"):
                    ended[i] = time.time()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    faulted = [
        float(t) for t in re.findall(r"^\[\d+\] worker \d+ (?:dies|hangs \(\w+\)) at (\S+)$", "".join(outs), re.M)
    ]
    took = [t - min(faulted) for t in ended] if faulted else [float("nan")] * 2
    return {"outs": outs, "statuses": [p.returncode for p in procs], "took": took}


def verdict(out: str) -> list[str]:
    """The launcher's last lines: its verdict (without the workers' output)."""
    return re.findall(r"^rdkeras\.launch: (.*)$", out, re.M)


def problems(result: dict, expected: str) -> list[str]:
    """What is wrong: the verdicts differ, do not end with `expected` (a regular expression), the statuses differ
    or are 0, or a launcher exited later than BOUND_S after the fault."""
    outs, statuses, took = result["outs"], result["statuses"], result["took"]
    found, wrong = [verdict(out) for out in outs], []
    if found[0] != found[1]:
        wrong.append("the launchers' verdicts differ:\n" + "\n---\n".join(o[-3000:] for o in outs))
    elif not found[0] or not re.fullmatch(expected, found[0][-1]):
        wrong.append(f"the verdict does not say {expected!r}:\n" + outs[0][-3000:])
    if not statuses[0] == statuses[1] != 0:
        wrong.append(f"the launchers exited {statuses}")
    if not max(took) < BOUND_S:
        wrong.append(f"the launchers exited {took[0]:.1f} and {took[1]:.1f} s after the fault")
    return wrong


KILLED = (
    r"elastic: the job ended: lost worker {0} \(killed by signal 9\), worker {1} \(killed by signal 9\): 2 left, "
    r"fewer than --min-workers 3"
)
HUNG = (
    r"elastic: the job ended: worker {0} failed but is still running \(rank {0} has not entered .*\): a stopped or "
    r"hung worker cannot be replaced while it lives; the job ends"
)
TRIALS = {
    "kill, one per host": (["--kill", "1:1:1", "--kill", "3:1:1"], KILLED.format(1, 3)),
    "kill, both on the first host": (["--kill", "0:1:1", "--kill", "1:1:1"], KILLED.format(0, 1)),
    "kill, both on the second host": (["--kill", "2:1:1", "--kill", "3:1:1"], KILLED.format(2, 3)),
    "hang on the first host": (["--hang", "1:1:1:callback"], HUNG.format(1)),
    "hang on the second host": (["--hang", "3:1:1:callback"], HUNG.format(3)),
}
REPEATS = 4


@pytest.mark.extended
def test_two_workers_killed_one_per_host_one_verdict_on_both_launchers(tmp_path):
    netns.cleanup_stale()
    fault, expected = TRIALS["kill, one per host"]
    result = trial(tmp_path, fault, 29581)
    assert not problems(result, expected), "\n".join(problems(result, expected))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TRIALS))
def test_one_verdict_in_every_trial(tmp_path, case):
    netns.cleanup_stale()
    fault, expected = TRIALS[case]
    wrong, took = [], []
    for i in range(REPEATS):
        result = trial(tmp_path, fault, 29582 + i)
        wrong += [f"trial {i}: {p}" for p in problems(result, expected)]
        took.append(max(result["took"]))
    print(f"elastic, {case}: {REPEATS - len({w.split(':')[0] for w in wrong})}/{REPEATS} trials agree; fault to both "
          f"launchers' exit {min(took):.1f}-{max(took):.1f} s")  # fmt: skip
    assert not wrong, "\n".join(wrong)
