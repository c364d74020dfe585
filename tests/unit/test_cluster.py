"""Cluster discovery from the launcher's variables, TF_CONFIG and SLURM."""

from __future__ import annotations

import json

import pytest

from rdkeras import cluster
from rdkeras.errors import EngineError

_VARS = [
    "RDKERAS_WORLD_SIZE",
    "RDKERAS_RANK",
    "RDKERAS_MASTER_ADDR",
    "RDKERAS_MASTER_PORT",
    "TF_CONFIG",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)


def test_no_configuration_is_one_worker():
    assert cluster.resolve() == cluster.Cluster(0, 1, "127.0.0.1", 0, "single")


def test_launcher_variables(monkeypatch):
    monkeypatch.setenv("RDKERAS_WORLD_SIZE", "4")
    monkeypatch.setenv("RDKERAS_RANK", "3")
    monkeypatch.setenv("RDKERAS_MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("RDKERAS_MASTER_PORT", "29400")
    assert cluster.resolve() == cluster.Cluster(3, 4, "10.1.2.3", 29400, "rdkeras")


@pytest.mark.parametrize(("task", "rank"), [({"type": "chief", "index": 0}, 0), ({"type": "worker", "index": 1}, 2)])
def test_tf_config_as_kubeflow_sets_it(monkeypatch, task, rank):
    spec = {"chief": ["trainer-chief-0:2222"], "worker": ["trainer-worker-0:2222", "trainer-worker-1:2222"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": task}))
    assert cluster.resolve() == cluster.Cluster(rank, 3, "trainer-chief-0", 2222, "TF_CONFIG")


def test_tf_config_ps_task_is_refused(monkeypatch):
    spec = {"worker": ["w0:1"], "ps": ["p0:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "ps", "index": 0}}))
    with pytest.raises(EngineError, match="task 'ps'"):
        cluster.resolve()


def test_bad_tf_config_is_named(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(EngineError, match="TF_CONFIG is not valid JSON"):
        cluster.resolve()


def test_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-09,12],cpu1")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert cluster.resolve() == cluster.Cluster(5, 8, "gpu07", 29500 + 123456 % 10000, "SLURM")


@pytest.mark.parametrize(
    ("nodes", "first"), [("node1", "node1"), ("n[3-4]", "n3"), ("a[10,2]", "a10"), ("x-1,x-2", "x-1")]
)
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert cluster.first_host(nodes) == first
