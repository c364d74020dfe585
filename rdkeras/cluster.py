"""Where this process sits in the job: rank, world size, local rank, and where rank 0 listens.

``resolve()`` reads the environment once and returns a :class:`Cluster`. The
sources, first match wins (:func:`source` names it without resolving):

1. ``"rdkeras"``: ``RDKERAS_WORLD_SIZE`` / ``RDKERAS_RANK`` / ``RDKERAS_MASTER_ADDR`` /
   ``RDKERAS_MASTER_PORT`` (what ``python -m rdkeras.launch`` sets, with
   ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``);
2. ``"TF_CONFIG"`` (what Kubeflow's TFJob sets), read with TensorFlow's
   ``TFConfigClusterResolver``; the chief (or worker 0) hosts the rendezvous on
   its TF_CONFIG port, which TensorFlow's own server would otherwise use;
3. ``"torchrun"``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (torchrun, Kubeflow's PyTorchJob). Under
   torchrun's own agent with a static rendezvous the agent's store holds
   ``MASTER_PORT``, so rdkeras listens on ``MASTER_PORT + 1`` there;
4. ``"SLURM"``: inside an ``srun`` step, ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE`` and
   ``SLURM_STEP_NODELIST``, expanded by ``scontrol show hostnames`` (TensorFlow's
   ``expand_hostlist`` where scontrol is missing); rank 0 runs on the first node;
   the port is ``29500 + SLURM_JOB_ID % 10000``. A batch script outside ``srun``
   is one process, not a job of ``SLURM_NTASKS`` ranks;
5. ``"single"``: nothing; a single process is a valid one-worker job.

``RDKERAS_MASTER_PORT`` overrides the port of every source.

A :class:`Cluster` carries everything a strategy needs: ``rank``, ``world_size``,
``master_addr``, ``master_port``, ``source``, ``local_rank``, ``local_world_size``,
``task_type`` / ``task_id`` (TF_CONFIG's own; ``"worker"`` and the rank
elsewhere), ``hosts`` where the source lists them, ``job_key`` (identifies the
job on every rank, for :mod:`rdkeras.jobtoken`), and
``cluster_resolver(num_gpus)``: TensorFlow's ClusterResolver for the source
(``TFConfigClusterResolver``, ``SlurmClusterResolver``, or a
``SimpleClusterResolver`` built from the rest).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from rdkeras.errors import EngineError

SOURCES = ("rdkeras", "TF_CONFIG", "torchrun", "SLURM", "single")
SLURM_PORT_BASE = 29500
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Cluster:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # one of SOURCES
    local_rank: int = 0
    local_world_size: int = 1
    task_type: str = "worker"
    task_id: int = 0
    hosts: tuple[str, ...] = field(default=(), compare=False)
    job_key: str | None = field(default=None, compare=False)

    def cluster_resolver(self, num_gpus: int | None = None) -> Any:
        """TensorFlow's ClusterResolver for this job (imports TensorFlow).

        Args:
            num_gpus: GPUs this worker uses (reported as ``num_accelerators()``); None: ask TensorFlow.
        """
        import tensorflow as tf

        cr = tf.distribute.cluster_resolver
        if num_gpus is None:
            num_gpus = len(tf.config.get_visible_devices("GPU"))
        accelerators = {"GPU": num_gpus} if num_gpus else {}
        if self.source == "TF_CONFIG":
            return cr.TFConfigClusterResolver()
        if self.source == "SLURM":
            per_node: dict[str, int] = {}
            for host in _slurm_task_hosts():
                per_node[host] = per_node.get(host, 0) + 1
            resolver = cr.SlurmClusterResolver(
                jobs={"worker": self.world_size},
                port_base=self.master_port,
                gpus_per_node=max(num_gpus * self.local_world_size, 0),
                gpus_per_task=num_gpus,
                tasks_per_node=per_node,
                auto_set_gpu=False,  # rdkeras.devices picks the GPU by local rank
            )
            resolver.cluster_spec()  # sets task_type and task_id
            return resolver
        # rdkeras needs only the rendezvous address; the others are the hosts where known, on port 0.
        hosts = list(self.hosts) if len(self.hosts) == self.world_size else [self.master_addr] * self.world_size
        workers = [f"{self.master_addr}:{self.master_port}"] + [f"{h}:0" for h in hosts[1:]]
        spec = tf.train.ClusterSpec({"worker": workers})
        return cr.SimpleClusterResolver(
            spec, task_type="worker", task_id=self.rank, num_accelerators=accelerators, rpc_layer="grpc"
        )


def source(env: Mapping[str, str] | None = None) -> str:
    """Which source describes this process (see the module docstring), without resolving it."""
    env = os.environ if env is None else env
    if env.get("RDKERAS_WORLD_SIZE"):
        return "rdkeras"
    if env.get("TF_CONFIG"):
        return "TF_CONFIG"
    if all(env.get(v) for v in _TORCHRUN_VARS):
        return "torchrun"
    if env.get("SLURM_PROCID") and env.get("SLURM_STEP_NUM_TASKS") and env.get("SLURM_STEP_ID"):
        return "SLURM"
    return "single"


def in_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment already makes this process one worker of a job."""
    return source(env) != "single"


def job_key(env: Mapping[str, str] | None = None) -> str | None:
    """What names this job identically on each of its ranks (and differs between jobs), or None."""
    env = os.environ if env is None else env
    kind = source(env)
    if kind == "rdkeras":
        return (
            f"rdkeras|{env.get('RDKERAS_MASTER_ADDR', '127.0.0.1')}|{env.get('RDKERAS_MASTER_PORT', '0')}|"
            + env["RDKERAS_WORLD_SIZE"]
        )
    if kind == "TF_CONFIG":
        try:
            spec = json.loads(env["TF_CONFIG"]).get("cluster", {})
        except (json.JSONDecodeError, AttributeError):
            return None
        return "tf|" + json.dumps(spec, sort_keys=True)
    if kind == "torchrun":
        run = env.get("TORCHELASTIC_RUN_ID", "")
        return f"torchrun|{run}|{env['MASTER_ADDR']}|{env['MASTER_PORT']}|{env['WORLD_SIZE']}"
    if kind == "SLURM":
        return f"slurm|{env.get('SLURM_CLUSTER_NAME', '')}|{env.get('SLURM_JOB_ID', '')}|{env['SLURM_STEP_ID']}"
    return None


def expand_hostlist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order: ``rack[1-2]-n[01-02]`` -> rack1-n01, rack1-n02, rack2-n01, ...

    ``scontrol show hostnames`` expands it (SLURM's own parser: every bracket group);
    where scontrol is not installed, TensorFlow's ``expand_hostlist`` (one bracket group per host).
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise EngineError("empty SLURM node list")
    scontrol = shutil.which("scontrol")
    if scontrol:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        hosts = done.stdout.split()
        if done.returncode == 0 and hosts:
            return hosts
        raise EngineError(f"scontrol show hostnames {nodelist!r} failed: {done.stderr.strip() or 'no hosts'}")
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import expand_hostlist as tf_expand

    try:
        return list(tf_expand(nodelist))
    except ValueError as e:
        raise EngineError(f"cannot expand SLURM node list {nodelist!r} without scontrol: {e}") from None


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node ([2, 2, 2, 1])."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import expand_tasks_per_node as tf_tasks

    try:
        return list(tf_tasks(spec))
    except ValueError as e:
        raise EngineError(str(e)) from None


def _slurm_task_hosts(env: Mapping[str, str] | None = None) -> list[str]:
    """The host of each rank of the step (SLURM's default block distribution)."""
    env = os.environ if env is None else env
    hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost")
    counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or str(env["SLURM_STEP_NUM_TASKS"]))
    return [h for h, n in zip(hosts, counts, strict=False) for _ in range(n)]


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value in (None, ""):
        if default is None:
            raise EngineError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise EngineError(f"{name} must be a whole number, got {value!r}") from None


def resolve(env: Mapping[str, str] | None = None) -> Cluster:
    """This process's place in the job, from the environment (see the module docstring)."""
    env = os.environ if env is None else env
    kind = source(env)
    if kind == "rdkeras":
        c = Cluster(
            _int(env, "RDKERAS_RANK", 0),
            _int(env, "RDKERAS_WORLD_SIZE"),
            env.get("RDKERAS_MASTER_ADDR") or "127.0.0.1",
            _int(env, "RDKERAS_MASTER_PORT", 0),
            kind,
            _int(env, "LOCAL_RANK", _int(env, "RDKERAS_RANK", 0)),
            _int(env, "LOCAL_WORLD_SIZE", _int(env, "RDKERAS_WORLD_SIZE")),
        )
    elif kind == "TF_CONFIG":
        c = _from_tf_config(env)
    elif kind == "torchrun":
        port = _int(env, "MASTER_PORT")
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            port += 1  # torchrun's agent store listens on MASTER_PORT itself
        world = _int(env, "WORLD_SIZE")
        c = Cluster(
            _int(env, "RANK"),
            world,
            env["MASTER_ADDR"],
            port,
            kind,
            _int(env, "LOCAL_RANK", 0),
            _int(env, "LOCAL_WORLD_SIZE", world),
        )
    elif kind == "SLURM":
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        hosts = _slurm_task_hosts(env)
        if len(hosts) != world:
            raise EngineError(
                f"SLURM step lists {len(hosts)} tasks on its nodes "
                f"({env.get('SLURM_STEP_TASKS_PER_NODE')} over {env.get('SLURM_STEP_NODELIST')}) "
                f"but SLURM_STEP_NUM_TASKS={world}"
            )
        counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or str(world))
        node = _int(env, "SLURM_NODEID", 0)
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", 0) % 10000
        c = Cluster(
            rank,
            world,
            hosts[0],
            port,
            kind,
            _int(env, "SLURM_LOCALID", 0),
            counts[node] if node < len(counts) else 1,
            hosts=tuple(hosts),
        )
    else:
        c = Cluster(0, 1, "127.0.0.1", 0, kind)
    overrides: dict[str, Any] = {"job_key": job_key(env)}
    if kind != "TF_CONFIG":
        overrides.update(task_type="worker", task_id=c.rank)
    if kind != "rdkeras" and env.get("RDKERAS_MASTER_PORT"):
        overrides["master_port"] = _int(env, "RDKERAS_MASTER_PORT")
    c = dataclasses.replace(c, **overrides)
    if not 0 <= c.rank < c.world_size or not 0 <= c.local_rank < max(c.local_world_size, 1):
        raise EngineError(
            f"{kind}: rank {c.rank} of {c.world_size}, local rank {c.local_rank} of {c.local_world_size}: out of range"
        )
    return c


def export_local_rank(c: Cluster, env: MutableMapping[str, str] | None = None) -> None:
    """Sets ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` in this process's environment where its start path did not
    (SLURM, TF_CONFIG), as the launcher and torchrun do: Horovod- and torchrun-style scripts read them. A value
    already there is kept; a one-process job gets none."""
    env = os.environ if env is None else env
    if c.world_size > 1:
        env.setdefault("LOCAL_RANK", str(c.local_rank))
        env.setdefault("LOCAL_WORLD_SIZE", str(c.local_world_size))


def _from_tf_config(env: Mapping[str, str]) -> Cluster:
    try:
        config = json.loads(env["TF_CONFIG"])
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
    hosts = tuple(w.rpartition(":")[0].strip("[]") for w in workers)
    mine = hosts[rank]
    # One task per pod or host is Kubeflow's way; several tasks naming one host share it.
    local = [i for i, h in enumerate(hosts) if h == mine]
    _, _, port = workers[0].rpartition(":")
    return Cluster(
        rank,
        len(workers),
        hosts[0],
        int(port),
        "TF_CONFIG",
        local.index(rank),
        len(local),
        task_type=task_type,
        task_id=task_id,
        hosts=hosts,
    )


def job_shape(
    rank: int | None, world_size: int | None, master_addr: str | None, master_port: int | None
) -> tuple[int, int, str, int]:
    """(rank, world size, rendezvous address and port): those given, the rest from the cluster the environment
    describes (read only if needed); a port outside 0-65535 is an error."""
    if None in (rank, world_size, master_addr, master_port):
        job = resolve()
        rank = job.rank if rank is None else rank
        world_size = job.world_size if world_size is None else world_size
        master_addr = job.master_addr if master_addr is None else master_addr
        master_port = job.master_port if master_port is None else master_port
    port = int(master_port)  # type: ignore[arg-type]
    if not 0 <= port <= 65535:
        raise EngineError(f"rendezvous port {port} is not a TCP port: choose one in 1-65535 (RDKERAS_MASTER_PORT)")
    return int(rank), int(world_size), str(master_addr), port  # type: ignore[arg-type]
