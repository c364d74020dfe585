"""Two "hosts" (network namespaces on a veth pair): the multi-node launcher, transport=auto, same-host identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rdkeras.testing import netns
from tests.conftest import TESTS_DIR
from tests.readme_commands import command

REPO = TESTS_DIR.parent
WHY = netns.why_not()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"two namespaces: {WHY}"), pytest.mark.timeout(900)]
GLOBAL_BATCH = 16
LAUNCH = [sys.executable, "-m", "rdkeras.launch"]
WORKER = str(TESTS_DIR / "netns" / "fit_worker.py")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDKERAS_")}
    env.update(
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="3",
        RDKERAS_TIMEOUT="120",
        XDG_CONFIG_HOME=str(tmp_path / "config"),  # the job token: one per-user secret both "hosts" read
    )
    return env


def _launch_on(host: netns.Host, node_rank: int, master: netns.Host, out, env) -> subprocess.Popen:
    return subprocess.Popen(
        host.command(
            [
                *LAUNCH,
                "--nnodes",
                "2",
                "--node-rank",
                str(node_rank),
                "--master-addr",
                master.addr,
                "--master-port",
                "29511",
                "-n",
                "2",
                WORKER,
                str(out),
                str(GLOBAL_BATCH),
                "reference",
            ]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def two_host_job(tmp_path_factory):
    """A 2x2 data-parallel fit (2 nodes x 2 workers), plus a 2-worker job inside one namespace."""
    netns.cleanup_stale()  # what a killed earlier run may have left
    tmp = tmp_path_factory.mktemp("netns")
    env = _env(tmp)
    across, within = tmp / "across", tmp / "within"
    across.mkdir()
    within.mkdir()
    with netns.hosts(2) as (a, b):
        procs = [_launch_on(a, 0, a, across, env), _launch_on(b, 1, a, across, env)]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
        inside = subprocess.run(
            b.command([*LAUNCH, "-n", "2", WORKER, str(within), str(GLOBAL_BATCH)]),
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=400,
        )
        assert inside.returncode == 0, inside.stdout[-3000:]
        identities = [
            subprocess.run(
                h.command([sys.executable, "-c", "from rdkeras.engine import host_identity; print(host_identity())"]),
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            ).stdout.strip()
            for h in (a, b)
        ]
    assert not netns.left_by_this_process(), "namespaces left behind"
    load = lambda d, n: [json.loads((d / f"rank-{r}.json").read_text()) for r in range(n)]  # noqa: E731
    return {"across": load(across, 4), "within": load(within, 2), "logs": outs, "identities": identities}


def test_auto_picks_tcp_between_hosts_and_shm_within_one(two_host_job):
    assert {r["transport"] for r in two_host_job["across"]} == {"shm+tcp"}
    assert {r["transport"] for r in two_host_job["within"]} == {"shm"}
    assert "transport=auto chose shm+tcp: 2 hosts, 4 ranks" in two_host_job["logs"][0]
    # algorithm=auto: hierarchical, as 2 hosts run 2 workers each. Each host sums over shm, then worker l of each
    # host sums shard l across the hosts over tcp: every rank writes over both, and the bytes between the hosts
    # are spread evenly over its workers (a flat ring would send them all from ranks 1 and 3).
    assert "allreduce: hierarchical (2 hosts x 2 workers: sum inside each host" in two_host_job["logs"][0]
    # On CPUs the hierarchical allreduce runs once after backprop: its passes pipeline inside the one call.
    assert "One exchange after backprop (overlap off" in two_host_job["across"][0]["plan_text"]
    remote = []
    for r in two_host_job["across"]:
        traffic = r["traffic"]
        local = traffic["bytes_written/shm"]
        remote.append(traffic["bytes_written/tcp"])
        assert local > 0 and remote[-1] > 0, (r["rank"], traffic)
        assert local + remote[-1] == traffic["bytes_written"]
    assert max(remote) < 1.2 * min(remote), remote


def test_namespaces_are_different_hosts_though_they_share_boot_id(two_host_job):
    a, b = two_host_job["identities"]
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert a.startswith(boot) and b.startswith(boot) and a != b


def test_the_four_workers_end_bit_identical(two_host_job):
    first = two_host_job["across"][0]
    assert all(r["weights"] == first["weights"] for r in two_host_job["across"])
    assert all(r["evaluate"] == first["evaluate"] for r in two_host_job["across"])


def test_two_by_two_fit_equals_one_process(two_host_job):
    want = two_host_job["across"][0]["reference"]  # rank 0 trained one plain process after the job
    for r in two_host_job["across"] + two_host_job["within"]:
        for got, ref in zip(r["weights"], want, strict=True):
            np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_readmes_multi_node_command_trains_across_two_hosts(tmp_path):
    """README's `python -m rdkeras.launch --nnodes 2 ... -m rdkeras.train +recipe=fcn5`, one per "host"."""
    small = ["model.input_dim=256", "model.hidden=128", "trainer.epochs=1", "trainer.steps_per_epoch=4"]
    small += ["trainer.verbose=2", "logger=none", "~callbacks.model_checkpoint"]
    env = _env(tmp_path)
    with netns.hosts(2) as (a, b):
        procs = []
        for node, host in enumerate((a, b)):
            overrides = [*small, f"hydra.run.dir={tmp_path}/node{node}"]
            argv = command("python", "rdkeras.launch --nnodes", overrides=overrides)
            for flag, value in (("--node-rank", str(node)), ("--master-addr", a.addr), ("--master-port", "29512")):
                argv[argv.index(flag) + 1] = value
            procs.append(
                subprocess.Popen(
                    host.command(argv),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                    cwd=tmp_path,
                )
            )
        outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = json.loads((tmp_path / "node0" / "results.json").read_text())
    assert results["workers"] == 4 and results["transport"] == "shm+tcp"
    assert "[0] summary: fcn5 on 4 worker(s)" in outs[0]


@pytest.mark.parametrize("count", [3, 4])
def test_hosts_on_one_switch_sum_hierarchically_with_bf16_between_them(count):
    """`count` namespaces x 2 workers (shm inside, tcp between, each host's link shaped): the hierarchical
    allreduce with bf16 shards between the hosts sums on every rank, the same bits everywhere."""
    from rdkeras.bench import run_ranks_on_hosts

    sizes = [1, 1000, 4099, 0, 33]
    with netns.hosts(count, rate="1gbit") as made:
        assert len({h.addr for h in made}) == count
        ranks = run_ranks_on_hosts(
            "test", f"{count} hosts", "tests.ranks.workers:hosts_allreduce", 2 * count,
            {"hosts": [f"h{r // 2}" for r in range(2 * count)], "algorithm": "hierarchical", "sizes": sizes,
             "compression": "bf16", "bucket": 4096},
            hosts=made, env={"PYTHONPATH": str(REPO)}, timeout=300,
        )  # fmt: skip
    assert ranks is not None, "a rank failed (its output is printed above)"
    assert not netns.left_by_this_process(), "namespaces left behind"
    assert all(r.value["algorithm"] == "hierarchical" for r in ranks)
    assert all(r.value["calls"] == ranks[0].value["calls"] for r in ranks), "the ranks hold different bits"
    for call, got in enumerate(ranks[0].value["calls"]):
        inputs = []
        for rank in range(2 * count):
            rng = np.random.default_rng(1000 * call + rank)
            inputs.append(
                [rng.standard_normal(n).astype(np.float32 if i % 2 else np.float64) for i, n in enumerate(sizes)]
            )
        for i in range(len(sizes)):
            want = sum(x[i].astype(np.float64) for x in inputs) / (2 * count if got["average"] else 1)
            bound = sum(np.abs(x[i].astype(np.float64)) for x in inputs) / (2 * count if got["average"] else 1)
            tolerance = 1e-12 if i % 2 == 0 else 2.0**-8 * (count + 1)  # float64 exact; float32 on a bf16 wire
            assert np.all(np.abs(np.asarray(got["sums"][i]) - want) <= tolerance * bound + 1e-12), (call, i)
