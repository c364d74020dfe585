"""Where this process sits in the job: rank, world size, and where rank 0 listens.

Looked up in this order:
1. ``RDKERAS_WORLD_SIZE`` / ``RDKERAS_RANK`` / ``RDKERAS_MASTER_ADDR`` / ``RDKERAS_MASTER_PORT``
   (what ``python -m rdkeras.launch`` sets);
2. ``TF_CONFIG`` (what Kubeflow's TFJob sets), read with TensorFlow's
   ``TFConfigClusterResolver``; the chief (or worker 0) hosts the rendezvous on
   its TF_CONFIG port, which TensorFlow's own server would otherwise use;
3. SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``);
4. nothing: a single process is a valid one-worker job.
The job token always comes from ``RDKERAS_JOB_TOKEN``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from rdkeras.errors import EngineError


@dataclass(frozen=True)
class Cluster:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # "rdkeras", "TF_CONFIG", "SLURM" or "single"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise EngineError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def resolve() -> Cluster:
    env = os.environ
    if env.get("RDKERAS_WORLD_SIZE"):
        world = int(env["RDKERAS_WORLD_SIZE"])
        return Cluster(
            int(env.get("RDKERAS_RANK", 0)),
            world,
            env.get("RDKERAS_MASTER_ADDR", "127.0.0.1"),
            int(env.get("RDKERAS_MASTER_PORT", 0)),
            "rdkeras",
        )
    if env.get("TF_CONFIG"):
        return _from_tf_config()
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        port = int(env.get("RDKERAS_MASTER_PORT") or 29500 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
        return Cluster(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), first_host(nodes), port, "SLURM")
    return Cluster(0, 1, "127.0.0.1", 0, "single")


def _from_tf_config() -> Cluster:
    try:
        config = json.loads(os.environ["TF_CONFIG"])
    except json.JSONDecodeError as e:
        raise EngineError(f"TF_CONFIG is not valid JSON: {e}") from None
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec().as_dict()
    workers = list(spec.get("chief", [])) + list(spec.get("worker", []))
    if not workers:
        raise EngineError(f"TF_CONFIG names no chief or worker tasks: {config.get('cluster')}")
    task_type, task_id = resolver.task_type, int(resolver.task_id or 0)
    if task_type not in ("chief", "worker"):
        raise EngineError(f"this process is TF_CONFIG task {task_type!r}; rdkeras runs chief and worker tasks")
    rank = task_id if task_type == "chief" else len(spec.get("chief", [])) + task_id
    host, _, port = workers[0].rpartition(":")
    return Cluster(rank, len(workers), host.strip("[]"), int(port), "TF_CONFIG")
