"""Elastic training across two "hosts" (network namespaces): a worker of the second host killed mid-epoch, and
the three others go on over shm+tcp, equal to one process, and both launchers print node 0's lines and exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rdkeras.testing import netns
from tests.conftest import TESTS_DIR

REPO = TESTS_DIR.parent
WHY = netns.why_not()
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"two namespaces: {WHY}"),
    pytest.mark.timeout(600),
    pytest.mark.extended,
]
SCRIPT = str(TESTS_DIR / "ranks" / "elastic_fit.py")


def _weights(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[k] for k in f.files]


def test_a_worker_lost_on_one_host_leaves_three_going_on_across_both(tmp_path):
    netns.cleanup_stale()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3", RDKERAS_TIMEOUT="60",
               XDG_CONFIG_HOME=str(tmp_path / "config"))  # fmt: skip  # one per-user secret: the job token
    subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--one-process"], check=True, env=env, timeout=120,
                   capture_output=True)  # fmt: skip
    with netns.hosts(2) as (a, b):

        def launch(host: netns.Host, node_rank: int) -> subprocess.Popen:
            argv = [sys.executable, "-m", "rdkeras.launch", "--nnodes", "2", "--node-rank", str(node_rank),
                    "--master-addr", a.addr, "--master-port", "29517", "-n", "2", "--min-workers", "3", SCRIPT,
                    str(tmp_path), "--kill", "3:1:1"]  # fmt: skip
            return subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, cwd=REPO)  # fmt: skip

        procs = [launch(a, 0), launch(b, 1)]
        outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert re.search(r"lost worker 3 \(.*\); 3 workers \(0, 1, 2\) went on from step 6", outs[0]), outs[0][-2000:]
    verdicts = [re.findall(r"^rdkeras\.launch: (.*)$", out, re.M) for out in outs]  # node 0's, on both launchers
    assert verdicts[0] == verdicts[1], "\n---\n".join(o[-3000:] for o in outs)
    assert "[0] rdkeras: transport=auto chose shm+tcp" in outs[0]
    reference = _weights(tmp_path / "weights-one.npz")
    survivors = [_weights(tmp_path / f"weights-{w}.npz") for w in (0, 1, 2)]
    assert not (tmp_path / "weights-3.npz").exists()
    for other in survivors[1:]:
        for x, y in zip(survivors[0], other, strict=True):
            assert np.array_equal(x, y)
    for mine, ref in zip(survivors[0], reference, strict=True):
        np.testing.assert_allclose(mine, ref, atol=1e-5)
