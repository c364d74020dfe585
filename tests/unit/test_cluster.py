"""Cluster discovery from the launcher's variables, TF_CONFIG, torchrun and SLURM."""

from __future__ import annotations

import json
import shutil

import pytest

from rdkeras import cluster
from rdkeras.errors import EngineError

_PREFIXES = ("RDKERAS_", "SLURM_", "TORCHELASTIC_")
_VARS = ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for v in list(os.environ):
        if v.startswith(_PREFIXES) or v in _VARS:
            monkeypatch.delenv(v)


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """scontrol with a minimal config (expanding host lists needs no daemon)."""
    if not shutil.which("scontrol"):
        pytest.skip("scontrol not installed (apt-get install slurm-wlm; .ci/run installs it)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


def test_no_configuration_is_one_worker():
    assert cluster.resolve() == cluster.Cluster(0, 1, "127.0.0.1", 0, "single")
    assert not cluster.in_job()


def test_launcher_variables(monkeypatch):
    for k, v in dict(
        RDKERAS_WORLD_SIZE="4", RDKERAS_RANK="3", RDKERAS_MASTER_ADDR="10.1.2.3", RDKERAS_MASTER_PORT="29400"
    ).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    c = cluster.resolve()
    assert c == cluster.Cluster(3, 4, "10.1.2.3", 29400, "rdkeras", 1, 2, "worker", 3)
    assert c.job_key == "rdkeras|10.1.2.3|29400|4"


@pytest.mark.parametrize(("task", "rank"), [({"type": "chief", "index": 0}, 0), ({"type": "worker", "index": 1}, 2)])
def test_tf_config_as_kubeflow_sets_it(monkeypatch, task, rank):
    spec = {"chief": ["trainer-chief-0:2222"], "worker": ["trainer-worker-0:2222", "trainer-worker-1:2222"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": task}))
    c = cluster.resolve()
    assert c == cluster.Cluster(rank, 3, "trainer-chief-0", 2222, "TF_CONFIG", 0, 1, task["type"], task["index"])
    assert c.hosts == ("trainer-chief-0", "trainer-worker-0", "trainer-worker-1")
    resolver = c.cluster_resolver(num_gpus=0)
    assert (resolver.task_type, resolver.task_id) == (task["type"], task["index"])
    assert resolver.cluster_spec().as_dict() == spec


def test_tf_config_tasks_sharing_a_host_get_local_ranks(monkeypatch):
    spec = {"worker": ["node1:2222", "node1:2223", "node2:2222", "node2:2223"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 3}}))
    c = cluster.resolve()
    assert (c.rank, c.local_rank, c.local_world_size) == (3, 1, 2)


def test_tf_config_ps_task_is_refused(monkeypatch):
    spec = {"worker": ["w0:1"], "ps": ["p0:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "ps", "index": 0}}))
    with pytest.raises(EngineError, match="task 'ps'"):
        cluster.resolve()


def test_bad_tf_config_is_named(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(EngineError, match="TF_CONFIG is not valid JSON"):
        cluster.resolve()


def test_torchrun_and_pytorchjob_variables(monkeypatch):
    for k, v in dict(
        RANK="5", WORLD_SIZE="8", MASTER_ADDR="job-master-0", MASTER_PORT="23456", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4"
    ).items():
        monkeypatch.setenv(k, v)
    c = cluster.resolve()
    assert c == cluster.Cluster(5, 8, "job-master-0", 23456, "torchrun", 1, 4, "worker", 5)
    resolver = c.cluster_resolver(num_gpus=1)
    assert (resolver.task_type, resolver.task_id, resolver.num_accelerators()) == ("worker", 5, {"GPU": 1})
    assert resolver.cluster_spec().num_tasks("worker") == 8
    # Under torchrun's agent with a static rendezvous, its store holds MASTER_PORT.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    c = cluster.resolve()
    assert c.master_port == 23457 and c.job_key == "torchrun|run7|job-master-0|23456|8"


def _slurm_step(monkeypatch, **extra):
    env = dict(
        SLURM_JOB_ID="123456",
        SLURM_STEP_ID="0",
        SLURM_PROCID="5",
        SLURM_STEP_NUM_TASKS="8",
        SLURM_NTASKS="8",
        SLURM_LOCALID="1",
        SLURM_NODEID="2",
        SLURM_STEP_NODELIST="gpu[07-09,12]",
        SLURM_STEP_TASKS_PER_NODE="2(x4)",
    )
    env.update(extra)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_slurm_step(monkeypatch, scontrol):
    _slurm_step(monkeypatch)
    c = cluster.resolve()
    assert c == cluster.Cluster(5, 8, "gpu07", 29500 + 123456 % 10000, "SLURM", 1, 2, "worker", 5)
    assert c.hosts == ("gpu07", "gpu07", "gpu08", "gpu08", "gpu09", "gpu09", "gpu12", "gpu12")
    assert c.job_key == "slurm||123456|0"
    monkeypatch.setenv("RDKERAS_MASTER_PORT", "31000")
    assert cluster.resolve().master_port == 31000


def test_slurm_cluster_resolver_takes_the_expanded_nodes(monkeypatch, scontrol):
    _slurm_step(monkeypatch, SLURM_STEP_NODELIST="rack[1-2]-n[1-2]")
    resolver = cluster.resolve().cluster_resolver(num_gpus=1)
    assert (resolver.task_type, resolver.task_id) == ("worker", 5)
    workers = resolver.cluster_spec().as_dict()["worker"]
    assert sorted({w.split(":")[0] for w in workers}) == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]


def test_a_batch_script_outside_srun_is_one_process(monkeypatch):
    # sbatch -n 2 exports SLURM_NTASKS=2 to the batch script, but only srun starts the tasks.
    for k, v in dict(SLURM_JOB_ID="9", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1").items():
        monkeypatch.setenv(k, v)
    assert cluster.resolve().source == "single"


@pytest.mark.parametrize(
    ("nodes", "hosts"),
    [
        ("node1", ["node1"]),
        ("n[3-4]", ["n3", "n4"]),
        ("a[10,2]", ["a10", "a2"]),
        ("x-1,x-2", ["x-1", "x-2"]),
        ("gpu[07-09,12],cpu1", ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("r[1-2]-n[1-2],login[5-6]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2", "login5", "login6"]),
    ],
)
def test_node_lists_expand_with_scontrol(scontrol, nodes, hosts):
    assert cluster.expand_hostlist(nodes) == hosts


def test_without_scontrol_tensorflow_expands_single_bracket_lists(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    assert cluster.expand_hostlist("gpu[07-08],cpu1") == ["gpu07", "gpu08", "cpu1"]
    with pytest.raises(EngineError, match="without scontrol"):
        cluster.expand_hostlist("rack[1-2]-node[01-02]")


def test_tasks_per_node():
    assert cluster.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(EngineError, match="tasks-per-node"):
        cluster.expand_tasks_per_node("two")


def test_out_of_range_ranks_are_refused(monkeypatch):
    for k, v in dict(RANK="4", WORLD_SIZE="4", MASTER_ADDR="m", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(EngineError, match="torchrun: rank 4 of 4"):
        cluster.resolve()


def test_a_bare_engine_takes_its_place_from_the_cluster_under_slurm(monkeypatch):
    from rdkeras.cluster import job_shape

    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
             "SLURM_STEP_NODELIST": "nodea", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}  # fmt: skip
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    for name in ("RDKERAS_WORLD_SIZE", "TF_CONFIG", "RANK", "WORLD_SIZE", "RDKERAS_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("rdkeras.cluster.expand_hostlist", lambda nodes: nodes.split(","))
    assert job_shape(None, None, None, None) == (1, 2, "nodea", 29507)
    assert job_shape(0, 1, "127.0.0.1", 0) == (0, 1, "127.0.0.1", 0)  # explicit arguments win


def test_a_port_out_of_range_is_named_before_any_socket():
    from rdkeras.cluster import job_shape

    with pytest.raises(EngineError, match=r"rendezvous port 70000 is not a TCP port: choose one in 1-65535"):
        job_shape(0, 2, "127.0.0.1", 70000)


def test_slurm_and_tf_config_jobs_get_local_rank_exported(monkeypatch, scontrol):
    # Horovod- and torchrun-style scripts read LOCAL_RANK; SLURM and TF_CONFIG do not set it.
    _slurm_step(monkeypatch)
    env: dict = {}
    cluster.export_local_rank(cluster.resolve(), env)
    assert env == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    spec = {"worker": ["node1:2222", "node1:2223", "node2:2222", "node2:2223"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 3}}))
    env = {"LOCAL_WORLD_SIZE": "4"}  # what the start path gave is kept
    cluster.export_local_rank(cluster.resolve(), env)
    assert env == {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    env = {}
    cluster.export_local_rank(cluster.Cluster(0, 1, "127.0.0.1", 0, "single"), env)
    assert env == {}  # one process: nothing to say
