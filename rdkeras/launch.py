"""Launcher: run a script or a function on N worker processes of this machine, or of several.

    python -m rdkeras.launch -n 4 train.py --epochs 3
    python -m rdkeras.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 4 train.py
    rdkeras.launch(train_fn, num_workers=4)           # from a notebook

It picks a free rendezvous port and a fresh job token (one node), sets each
worker's ``RDKERAS_*`` variables and ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``,
forwards worker output byte for byte with a ``[rank] `` prefix (a Keras
progress bar redraws in place), and if any worker fails it stops the others and
reports the worker that failed first. Across nodes (torchrun's flag names), each
node runs this with its ``--node-rank``; the job token then comes from
:mod:`rdkeras.jobtoken` (``RDKERAS_JOB_TOKEN``, or the user's secret file in the
shared home directory). Nothing is left running: workers get their own process
group, killed when the launcher ends, however it ends — on SIGKILL too, through
the kernel's parent-death signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdkeras._workers import (  # noqa: F401 (the launcher's names, re-exported)
    _RESULT_MARK,
    FAILURE_GRACE_S,
    RankResult,
    _failure_message,
    _status,
    failed_rank,
    first_failure,
    run_workers,
)
from rdkeras.errors import EngineError
from rdkeras.launch_elastic import ElasticSettings, add_elastic_arguments, elastic_outcome, run_elastic
from rdkeras.launch_nodes import NodeVerdict
from rdkeras.launch_verdict import verdict

DEFAULT_MASTER_PORT = 29500  # torchrun's


class LaunchError(RuntimeError):
    """A worker failed; the message names its rank and shows the end of its output."""

    def __init__(self, message: str, results: list[RankResult]):
        super().__init__(message)
        self.results = results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(
    rank: int,
    world_size: int,
    port: int,
    token: str | None,
    extra: Mapping[str, str] | None = None,
    *,
    master_addr: str = "127.0.0.1",
    local_rank: int | None = None,
    local_world_size: int | None = None,
    verbose: bool = False,
) -> dict:
    """The environment of one worker: this process's, plus its place in the job."""
    env = dict(os.environ)
    env.update(
        RDKERAS_RANK=str(rank),
        RDKERAS_WORLD_SIZE=str(world_size),
        RDKERAS_MASTER_ADDR=master_addr,
        RDKERAS_MASTER_PORT=str(port),
        LOCAL_RANK=str(rank if local_rank is None else local_rank),
        LOCAL_WORLD_SIZE=str(world_size if local_world_size is None else local_world_size),
        PYTHONUNBUFFERED="1",
    )
    if token is not None:
        env["RDKERAS_JOB_TOKEN"] = token
    env.setdefault("RDKERAS_LOG", "info")  # the launcher is an application: rdkeras's messages are shown
    if not verbose:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up INFO/WARNING lines
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Job:
    """Where this node's workers sit in the job: what :func:`run_local` needs to start them."""

    per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)

    def __post_init__(self) -> None:
        if self.per_node < 1:
            raise ValueError(f"workers per node must be at least 1, got {self.per_node}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need --master-port (and --master-addr: node 0's address)")

    @property
    def world_size(self) -> int:
        return self.per_node * self.nnodes

    @property
    def ranks(self) -> list[int]:
        return [self.node_rank * self.per_node + i for i in range(self.per_node)]


def job_envs(
    job: Job,
    extra: Mapping[str, str] | None = None,
    per_rank: Sequence[Mapping[str, str]] | None = None,
    *,
    only_ranks: Sequence[int] | None = None,
    verbose: bool = False,
    token: str | None = None,
) -> tuple[list[int], list[dict]]:
    """The ranks this node starts and their environments (one port and token for the job)."""
    port = job.master_port or free_port()
    # One node: a fresh secret per job. Several: every node's launcher must agree without talking,
    # so each worker resolves the token itself (rdkeras.jobtoken), unless the user set one.
    if token is None and job.nnodes == 1:
        token = secrets.token_hex(16)
    ranks = list(job.ranks if only_ranks is None else only_ranks)
    envs = []
    for rank in ranks:
        more = dict(extra or {})
        if per_rank is not None:
            more.update(per_rank[rank])
        local = rank - job.node_rank * job.per_node
        envs.append(
            worker_env(
                rank,
                job.world_size,
                port,
                token,
                more,
                master_addr=job.master_addr,
                local_rank=local,
                local_world_size=job.per_node,
                verbose=verbose,
            )
        )
    return ranks, envs


def run_local(
    command: Sequence[str],
    job: Job,
    *,
    env: Mapping[str, str] | None = None,
    per_rank_env: Sequence[Mapping[str, str]] | None = None,
    only_ranks: Sequence[int] | None = None,
    timeout: float | None = None,
    stop_on_failure: bool = True,
    forward: bool = False,
    verbose: bool = False,
    log_dir: str | Path | None = None,
    elastic: ElasticSettings | None = None,
    on_exit: Callable[[int, int], None] | None = None,
) -> list[RankResult]:
    """The one local-launch sequence: this node's ranks of `job`, each running `command`. With `elastic`, the
    launcher hosts the store and re-forms the group when workers are lost (:mod:`rdkeras.elastic`); what
    happened is in `elastic.changes` and `elastic.error` afterwards."""
    if elastic is None:
        ranks, envs = job_envs(job, env, per_rank_env, only_ranks=only_ranks, verbose=verbose)
        return run_workers(
            [list(command)] * len(ranks),
            envs,
            ranks=ranks,
            timeout=timeout,
            stop_on_failure=stop_on_failure,
            forward=forward,
            verbose=verbose,
            log_dir=log_dir,
            on_exit=on_exit,
        )
    job = dataclasses.replace(job, master_port=job.master_port or free_port())
    more = {**(env or {}), "RDKERAS_STORE": "launcher", "RDKERAS_MIN_WORKERS": str(elastic.min_workers)}
    ranks, envs = job_envs(job, more, per_rank_env, only_ranks=only_ranks, verbose=verbose,
                           token=secrets.token_hex(16) if job.nnodes == 1 else None)  # fmt: skip
    return run_elastic([list(command)] * len(ranks), job, ranks, envs, elastic, timeout=timeout, forward=forward,
                       verbose=verbose, log_dir=log_dir)  # fmt: skip


def call_command(target: str, kwargs: dict | None = None) -> list[str]:
    """The command that calls ``module:function(**kwargs)`` in a fresh interpreter and prints what it returned
    (JSON) where :func:`run_workers` reads it into ``RankResult.value``."""
    module, func = target.split(":")
    code = (
        "import json, sys, importlib\n"
        f"fn = getattr(importlib.import_module({module!r}), {func!r})\n"
        "value = fn(**json.loads(sys.argv[1]))\n"
        f"print({_RESULT_MARK!r} + json.dumps(value), flush=True)\n"
    )
    return [sys.executable, "-c", code, json.dumps(kwargs or {})]


def spawn_call(
    target: str,
    world_size: int,
    kwargs: dict | None = None,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    per_rank_env: list[dict[str, str]] | None = None,
    only_ranks: list[int] | None = None,
    stop_on_failure: bool = True,
) -> list[RankResult]:
    """Runs ``module:function(**kwargs)`` on every rank; each RankResult.value is what it returned (JSON).

    Raises nothing itself: inspect ``returncode`` and ``output``. (Tests and benchmarks use this.)
    """
    return run_local(
        call_command(target, kwargs),
        Job(world_size),
        env=env,
        per_rank_env=per_rank_env,
        only_ranks=only_ranks,
        timeout=timeout,
        stop_on_failure=stop_on_failure,
    )


def launch(
    fn: Callable[..., Any],
    num_workers: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    *,
    transport: str | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on `num_workers` local processes and returns their results.

    Usable from a notebook, like Accelerate's ``notebook_launcher``: `fn` (and
    what it refers to) travels by value with cloudpickle, so it may be defined
    in the notebook itself. Worker output appears with a "[rank] " prefix. If a
    worker fails, the others are stopped and LaunchError names the failed rank.
    """
    import cloudpickle

    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    with tempfile.TemporaryDirectory(prefix="rdkeras-launch-") as tmp:
        payload = os.path.join(tmp, "fn.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((fn, tuple(args), dict(kwargs or {})), f)
        code = (
            "import sys, pickle\n"
            "fn, args, kwargs = pickle.load(open(sys.argv[1], 'rb'))\n"
            "value = fn(*args, **kwargs)\n"
            "import os\n"
            "with open(os.path.join(sys.argv[2], 'result-%s.pkl' % os.environ['RDKERAS_RANK']), 'wb') as f:\n"
            "    import cloudpickle; cloudpickle.dump(value, f)\n"
        )
        extra = dict(env or {})
        if transport:
            extra["RDKERAS_TRANSPORT"] = transport
        job = Job(num_workers)
        results = run_local([sys.executable, "-c", code, payload, tmp], job, env=extra, timeout=timeout, forward=True)
        bad = failed_rank(results)
        if bad is not None:
            raise LaunchError(_failure_message(bad, results), results)
        values = []
        for r in range(num_workers):
            with open(os.path.join(tmp, f"result-{r}.pkl"), "rb") as f:
                values.append(cloudpickle.load(f))
        return values


class _Stopped(BaseException):
    """The launcher got a termination signal; its workers are stopped on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rdkeras.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "-n", "--nproc-per-node", "--num-workers", dest="per_node", type=int, required=True, help="workers on this node"
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, where rank 0 listens")
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help=f"rank 0's rendezvous port (default: a free one on one node, {DEFAULT_MASTER_PORT} on several)",
    )
    parser.add_argument(
        "--transport", help="sets RDKERAS_TRANSPORT for every worker (auto, shm, tcp, shm+tcp, verbs, grpc, rpc+...)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before all workers are stopped")
    add_elastic_arguments(parser)
    parser.add_argument("--log-dir", default=None, help="also write each rank's output to DIR/worker-RANK.log")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up messages")
    parser.add_argument("script", help="the Python script to run, or -m MODULE")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    argv = list(sys.argv[1:] if argv is None else argv)
    # "-m MODULE ARGS" as python has it: everything after the module is the module's.
    with_values = {a for action in parser._actions if action.nargs is None and action.option_strings
                   for a in action.option_strings}  # fmt: skip
    i = 0
    while i < len(argv) and argv[i] != "-m" and argv[i].startswith("-"):
        i += 2 if argv[i] in with_values else 1
    module = argv[i + 1 : i + 2] if i < len(argv) and argv[i] == "-m" else None
    if module == []:
        parser.error("-m needs a module name")
    a = parser.parse_args([*(t for t in argv[:i] if t != "--"), "--", "-m", *argv[i + 2 :]] if module else argv)
    if module:
        cmd = [sys.executable, "-m", module[0], *a.args]
    else:
        cmd = [sys.executable, a.script, *a.args]
        if not os.path.exists(a.script):
            parser.error(f"no such script: {a.script}")
    port = a.master_port or (DEFAULT_MASTER_PORT if a.nnodes > 1 else None)
    try:
        job = Job(a.per_node, a.nnodes, a.node_rank, a.master_addr, port)
    except ValueError as e:
        parser.error(str(e))
    extra = {"RDKERAS_TRANSPORT": a.transport} if a.transport else {}
    elastic = None
    if a.min_workers is not None:
        if not 1 <= a.min_workers <= job.world_size:
            parser.error(f"--min-workers must be in 1..{job.world_size} (the workers started), got {a.min_workers}")
        if a.max_restarts < 0:
            parser.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
        elastic = ElasticSettings(a.min_workers, max_restarts=a.max_restarts, join_timeout=a.join_timeout)
    elif a.max_restarts:
        parser.error("--max-restarts needs --min-workers (an elastic job)")
    handlers = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Several nodes: node 0's launcher hosts the store, and every launcher prints the job's one verdict.
    nodes = None
    try:
        nodes = NodeVerdict(job, job_envs(job, extra)[1][0]) if elastic is None and job.nnodes > 1 else None
        results = run_local(cmd, job, env={**extra, **(nodes.env if nodes else {})}, timeout=a.timeout, forward=True,
                            verbose=a.verbose, log_dir=a.log_dir, elastic=elastic,
                            on_exit=nodes.exited if nodes else None)  # fmt: skip
        if elastic is not None:
            status, lines = elastic_outcome(results, elastic)
        else:
            status, lines = verdict(results) if nodes is None else nodes.decide(results)
    except EngineError as e:  # (node 0's launcher cannot host the store: the port is taken)
        print(f"rdkeras.launch: {e}", file=sys.stderr)
        return 1
    except _Stopped as e:
        print(f"rdkeras.launch: stopped by signal {e.signum}; workers killed", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("rdkeras.launch: interrupted; workers killed", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if nodes is not None:
            nodes.close()
    for line in lines:
        print(f"rdkeras.launch: {line}", file=sys.stderr)
    return status


class _CallableModule(types.ModuleType):
    """``rdkeras.launch(fn, num_workers=N)`` and ``python -m rdkeras.launch`` share one name."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return launch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
