"""An elastic launch (``--min-workers``): node 0's launcher hosts the store and runs the agent that re-forms the
group when workers are lost (:mod:`rdkeras.elastic`); the other nodes' launchers keep their workers running, post
their workers' bad exits to it (the agent takes them as its own launcher's) and stop them once it ends the job; the
outcome, once every worker ended. With several nodes, node 0's launcher judges every node's results and every
launcher prints that one verdict and exits with its status (:class:`rdkeras.launch_nodes.NodeVerdict`, through
generation 0's store). :func:`rdkeras.launch.run_local` comes here for an elastic job."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rdkeras._workers import RankResult, _failure_message, _status, run_workers
from rdkeras.elastic.protocol import ENDED, EXITED
from rdkeras.errors import EngineError
from rdkeras.launch_nodes import NodeVerdict

if TYPE_CHECKING:
    from rdkeras.launch import Job


def add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's elastic flags."""
    parser.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="elastic: when workers die, the others (at least this many) go on inside the same fit (data parallelism)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="elastic: start up to this many replacements in all, each joining the group at its next epoch end",
    )
    parser.add_argument(
        "--join-timeout",
        type=_seconds,
        default=120.0,
        help="elastic: seconds a replacement has, from its start, to reach the launcher (else it is reported and "
        "the group goes on without it)",
    )


def _seconds(text: str) -> float:
    """A positive number of seconds (an argparse type)."""
    value = float(text)
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text}")
    return value


def run_elastic(
    commands: list[list[str]],
    job: Job,
    ranks: Sequence[int],
    envs: list[dict[str, str]],
    elastic: ElasticSettings,
    *,
    timeout: float | None = None,
    forward: bool = False,
    verbose: bool = False,
    log_dir: str | Path | None = None,
) -> list[RankResult]:
    """This node's workers of an elastic `job` (their environments made, the store hosted by the launcher); what
    happened is in `elastic.changes` and `elastic.error` afterwards."""
    from rdkeras import cluster, jobtoken, options
    from rdkeras.launch_agent import ElasticAgent

    def judge(results: list[RankResult]) -> tuple[int, list[str]]:
        return elastic_outcome(results, elastic)

    if job.node_rank > 0:  # node 0's launcher hosts the group; here, workers are watched and nothing more
        elastic.follower = True
        nodes = NodeVerdict(job, envs[0])
        try:
            results = run_workers(commands, envs, ranks=ranks, timeout=timeout, forward=forward,
                                  verbose=verbose, log_dir=log_dir, watch=_Follower(nodes))  # fmt: skip
            elastic.verdict = nodes.decide(results, judge)
            return results
        finally:
            nodes.close()
    # The token every worker proves: the launcher's own (one node), or what each resolves (several).
    token = jobtoken.resolve(job.world_size, cluster.job_key(envs[0]), options.from_env(envs[0]))
    agent = ElasticAgent("" if job.master_addr in ("0.0.0.0", "") else job.master_addr, int(job.master_port or 0),
                         token, job.world_size, elastic.min_workers, elastic.reform_timeout,
                         max_restarts=elastic.max_restarts, join_timeout=elastic.join_timeout,
                         say=lambda line: print(f"rdkeras.launch: {line}", file=sys.stderr, flush=True))  # fmt: skip
    home = NodeVerdict(job, envs[0], server=agent.home) if job.nnodes > 1 else None
    try:
        results = run_workers(commands, envs, ranks=ranks, timeout=timeout, forward=forward,
                              verbose=verbose, log_dir=log_dir, watch=agent)  # fmt: skip
        if home is not None:  # (the other nodes' launchers read the verdict from the agent's store: still open)
            agent.settle()
            _learn(agent, elastic)
            elastic.verdict = home.decide(results, judge)
        return results
    finally:
        agent.close()
        _learn(agent, elastic)


def _learn(agent: Any, elastic: ElasticSettings) -> None:
    """What happened to the group, from the agent."""
    elastic.changes, elastic.error, elastic.unjoined = list(agent.changes), agent.error, dict(agent.unjoined)


class _Follower:
    """An elastic job's launcher on a node other than 0: node 0's agent sees its workers through the store (a
    dead one's connection drops, and this launcher posts how it ended), so this one keeps them running until they
    end, or until the agent ends the job (its error is then this one's: the workers it blames are stopped)."""

    PEEK_S = 0.2  # how often the agent's store is asked whether the job ended

    def __init__(self, nodes: NodeVerdict):
        self._nodes, self._peeked = nodes, 0.0
        self._ended: str | None = None

    @property
    def error(self) -> str | None:
        client = self._nodes.client
        if self._ended is None and client is not None and time.monotonic() > self._peeked + self.PEEK_S:
            self._peeked = time.monotonic()
            try:
                found = client.peek(ENDED)
            except (EngineError, OSError):
                found = None
            self._ended = None if found is None else found.decode()
        return self._ended

    def exited(self, worker: int, returncode: int) -> None:
        if returncode != 0 and (client := self._nodes.client) is not None:
            try:
                client.set(f"{EXITED}{worker}", str(returncode).encode())
            except (EngineError, OSError):
                pass  # node 0's launcher is gone: it sees nothing more of this node

    def finished(self) -> bool:
        return False

    def take_spawns(self, base_env: dict) -> list:
        return []


@dataclass
class ElasticSettings:
    """An elastic launch: the fewest workers the job goes on with, and (afterwards) what happened."""

    min_workers: int
    reform_timeout: float = 30.0
    max_restarts: int = 0  # replacements to start in all, each after a loss
    join_timeout: float = 120.0  # seconds a replacement has to reach the lobby
    follower: bool = False  # set by the launch: this node is not node 0, whose launcher decides the outcome
    changes: list[Any] = dataclasses.field(default_factory=list)  # rdkeras.launch_agent.Change, one per loss
    error: str | None = None
    unjoined: dict[int, str] = dataclasses.field(default_factory=dict)  # replacements that never joined: why
    verdict: tuple[int, list[str]] | None = None  # several nodes: the job's, every launcher's (node 0's judged it)

    def lost(self) -> set[int]:
        """The workers (ids: their first ranks) the job went on without."""
        return {w for change in self.changes for w in change.lost}


def elastic_outcome(results: list[RankResult], elastic: ElasticSettings) -> tuple[int, list[str]]:
    """(exit status, lines to print) of an elastic launch: 0 when the group went on after every loss and every
    worker left at the end exited 0."""
    if elastic.verdict is not None:
        return elastic.verdict
    if elastic.follower:  # node 0's launcher knows the group; here, a worker killed by a signal may be a loss
        died = [r for r in results if r.returncode is not None and r.returncode < 0 and not r.killed]
        bad = next((r for r in results if r not in died and r.returncode != 0), None)
        lines = [f"elastic: worker {r.rank} died ({_status(r)}); node 0's launcher says whether the job went on "
                 "without it" for r in died]  # fmt: skip
        if bad is not None:
            return (bad.returncode if bad.returncode and bad.returncode > 0 else 1), [*lines, _failure_message(bad)]
        return 0, lines
    lines = [f"elastic: {change.line()}" for change in elastic.changes]
    lines += [_unjoined_line(worker, why, results) for worker, why in sorted(elastic.unjoined.items())]
    final = elastic.changes[-1].members if elastic.changes else [r.rank for r in results]
    kept = [r for r in results if r.rank in final]  # (lost workers, and replacements the job ended without)
    if elastic.error is not None:
        return 1, [*lines, f"elastic: the job ended: {elastic.error}"]
    bad = next((r for r in kept if r.returncode != 0), None)
    if bad is not None:
        return (bad.returncode if bad.returncode and bad.returncode > 0 else 1), [*lines, _failure_message(bad, kept)]
    return 0, lines


def _unjoined_line(worker: int, why: str, results: list[RankResult]) -> str:
    """A replacement that never joined: which, why, how its process ended and its last output."""
    r = next((r for r in results if r.rank == worker), None)
    if r is None:
        return f"elastic: replacement worker {worker} {why}"
    tail = "".join(list(r.tail)[-5:]).rstrip() or "(nothing)"
    return (f"elastic: replacement worker {worker} {why}; the group went on without it; its process: {_status(r)}; "
            f"its last output:\n{tail}")  # fmt: skip
